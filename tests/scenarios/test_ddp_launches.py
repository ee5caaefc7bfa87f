"""Distributed training launched in the other ways a user does, on the CPU (gloo) via the real
scripts: plain ``python train_multi_GPU.py``, a resume on another number of processes, two
emulated nodes under the c10d rendezvous with a killed process, SLURM's variables, and a rank
that cannot read the checkpoint. (One torchrun on one node: test_ddp.py.)"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest
import torch
import warm_python
from conftest import (
    REPO_ROOT,
    TORCHRUN,
    child_pids,
    finish_all,
    read_results,
    run_script,
    script_env,
    start_process,
    torchrun,
    train_argv,
    wait_all,
)

from train_utils.checkpoint import load_checkpoint
from train_utils.distributed.launch import free_port

pytestmark = pytest.mark.slow


def test_plain_python_launch_runs_single_process_with_a_hint(shapes_data, tmp_path):
    proc = run_script("train_multi_GPU.py", train_argv(shapes_data, tmp_path / "plain"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchrun --nproc_per_node" in proc.stderr
    assert torch.load(tmp_path / "plain" / "last.pt", weights_only=True)["epoch"] == 0


def test_resume_on_another_number_of_processes(make_shapes_data, tmp_path):
    """1 process -> 2 -> 1, one epoch each, in one output folder: each epoch once in
    results.csv, and the learning rate and accumulation of each run's own global batch."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "resize"
    lr0 = 0.001  # cfg/hyp.yaml

    def flags(epochs: int, *extra: str) -> list[str]:
        # nbs 4: a global batch of 4 x 2 doubles the learning rate, 4 x 1 keeps it.
        return train_argv(data, out, *extra, epochs=epochs, img=64, nbs=4)

    def initial_lrs() -> set[float]:
        ckpt = load_checkpoint(out / "last.pt")
        return {g["initial_lr"] for g in ckpt["optimizer"]["param_groups"]}

    first = run_script("train.py", flags(1))
    assert first.returncode == 0, first.stderr[-3000:]
    assert initial_lrs() == {lr0}
    grown = torchrun("train_multi_GPU.py", flags(2, "--resume"))
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "lr0 0.001 -> 0.002, accumulate 1 -> 1" in grown.stderr
    assert "global batch 4 x 2 process(es) (the checkpoint's: 4 x 1)" in grown.stderr
    assert initial_lrs() == {2 * lr0}
    shrunk = run_script("train.py", flags(3, "--resume"))
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    assert "lr0 0.002 -> 0.001" in shrunk.stderr and "(the checkpoint's: 4 x 2)" in shrunk.stderr
    # The other settings that changed (epochs) are named too.
    assert "this run differs from the checkpoint's: epochs: 2 -> 3" in shrunk.stderr
    assert initial_lrs() == {lr0}
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0", "1", "2"]
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


# ---- clusters, emulated on this machine: two "nodes" of one process each, and SLURM --------


def test_two_nodes_c10d_rendezvous_survive_a_killed_process(make_shapes_data, tmp_path):
    """Two launchers with the c10d rendezvous and --max-restarts=1; the process of "node" 1 is
    killed during epoch 1: both restart, resume from last.pt, and each epoch runs once."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "c10d"
    port = free_port()
    flags = train_argv(data, out, epochs=3, img=64)
    launchers = [
        start_process(
            [
                *TORCHRUN,
                "--nnodes=2",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-conf=is_host={1 - node}",
                "--rdzv-id=yolo-test",
                "--max-restarts=1",
                "--monitor-interval=0.5",
                str(REPO_ROOT / "train_multi_GPU.py"),
                *flags,
            ]
        )
        for node in range(2)
    ]
    try:
        deadline = time.time() + 300
        while not (out / "last.pt").is_file():
            for p in launchers:
                assert p.poll() is None, p.stdout.read()[-3000:]
            assert time.time() < deadline, "epoch 0 never finished"
            time.sleep(0.2)
        workers = child_pids(launchers[1].pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
    except BaseException:
        for p in launchers:
            p.kill()
        raise
    logs = finish_all(launchers)
    assert "resuming from" in logs[0]
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0", "1", "2"]
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


def _slurm_job_id() -> int:
    """A job id whose derived rendezvous port (15000 + id % 15000) is free here."""
    for job_id in range(4242, 4242 + 15000, 37):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job_id % 15000))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in 15000..29999")


def test_slurm_two_tasks_train_one_epoch(make_shapes_data, tmp_path):
    """train_multi_GPU.py started twice with the variables srun sets for a 2-task job on one
    node: no MASTER_ADDR/MASTER_PORT, the node list in SLURM's compressed form."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "slurm"
    job_id = _slurm_job_id()
    procs = []
    for task in range(2):
        env = script_env()
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        env.update(
            CUDA_VISIBLE_DEVICES="",
            SLURM_JOB_ID=str(job_id),
            SLURM_JOB_NODELIST="localhost",
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_NTASKS="2",
            SLURM_TASKS_PER_NODE="2",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_LAUNCH_NODE_IPADDR="10.255.255.1",  # the login node: must not be used
        )
        procs.append(
            start_process(
                [
                    sys.executable,
                    str(REPO_ROOT / "train_multi_GPU.py"),
                    *train_argv(data, out, img=64),
                ],
                env,
            )
        )
    logs = finish_all(procs)
    assert f"master localhost:{15000 + job_id % 15000}" in logs[0]
    assert "device cpu x 2 process(es)" in logs[0]
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0"]


def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank(make_shapes_data, tmp_path):
    """As on a node without the shared output folder: rank 1's --resume path does not exist
    there. Both ranks stop at once with the same one-line error naming rank 1 (no hang)."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "shared"
    first = run_script("train.py", train_argv(data, out, img=64))
    assert first.returncode == 0, first.stderr[-3000:]
    port = str(free_port())
    procs = []
    for rank, resume in enumerate([out / "last.pt", tmp_path / "node1" / "last.pt"]):
        env = script_env()
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            CUDA_VISIBLE_DEVICES="",
            SLURMD_NODENAME=f"node{rank}",
        )
        flags = train_argv(data, tmp_path / f"out{rank}", epochs=2, img=64)
        argv = [sys.executable, str(REPO_ROOT / "train_multi_GPU.py"), *flags]
        argv += ["--resume", str(resume), "--dist-timeout", "120"]
        procs.append(warm_python.start(argv, cwd=REPO_ROOT, env=env))
    wait_all(procs, 100)
    results = [p.output() for p in procs]
    errors = [
        [line for line in err.splitlines() if line.startswith("error:")] for _, err in results
    ]
    assert [p.returncode for p in procs] == [2, 2], results
    assert errors[0] == errors[1] and len(errors[0]) == 1
    assert errors[0][0].startswith(
        "error: --resume failed on rank 1 (node1): --resume: no checkpoint"
    )
    assert "needs the output folder on storage every node shares" in errors[0][0]
