"""Distributed training and evaluation under torchrun on the CPU (gloo), via the real scripts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import (
    read_results,
    script_env,
    train_argv,
    validate_run,
    validation_argv,
)

from train_utils.checkpoint import load_checkpoint
from train_utils.distributed.launch import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _torchrun(
    script: str,
    args: list[str],
    nproc: int = 2,
    extra: list[str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    cmd = [
        *TORCHRUN,
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *(extra or []),
        str(REPO / script),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def ddp_run(shapes_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = _torchrun("train_multi_GPU.py", train_argv(shapes_data, out, epochs=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_torchrun_training_writes_the_outputs(ddp_run):
    out, proc = ddp_run
    for name in (
        "last.pt",
        "best.pt",
        "results.csv",
        "results.png",
        "args.yaml",
        "hyp.yaml",
        "model.cfg",
        "train.log",
    ):
        assert (out / name).is_file(), name
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0", "1"]
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["epoch"] == 1 and not any(k.startswith("module.") for k in ckpt["model"])
    assert ckpt["config"]["batch_size"] == 4
    log = (out / "train.log").read_text()
    # Global batch 2 x 4 = 8 accumulates to the nominal 64; one rank writes the log.
    assert "device cpu x 2 process(es) | batch 4 x 8 accumulate (nominal 64)" in log
    assert log.count("done: 2 epochs") == 1
    assert "SyncBatchNorm skipped" in proc.stderr


def test_distributed_evaluation_equals_single_process(ddp_run, shapes_data, tmp_path):
    """10 validation images over 3 processes (4/3/3 in whole rect batches of 2, no padding): the
    gathered detections and the 12 stats equal a single-process run."""
    out, _ = ddp_run
    common = validation_argv(
        out / "model.cfg", shapes_data, out / "last.pt", "--conf-thres", "0.001", batch=2
    )
    single = _python(
        "validation.py",
        [
            *common,
            "--json-out",
            str(tmp_path / "single.json"),
            "--save-dir",
            str(tmp_path / "val_single"),
            "--save-json",
            str(tmp_path / "single"),
        ],
    )
    assert single.returncode == 0, single.stderr[-2000:]
    multi = _torchrun(
        "validation.py",
        [
            *common,
            "--json-out",
            str(tmp_path / "multi.json"),
            "--save-dir",
            str(tmp_path / "val_multi"),
            "--save-json",
            str(tmp_path / "multi"),
        ],
        nproc=3,
    )
    assert multi.returncode == 0, multi.stderr[-2000:]
    a = json.loads((tmp_path / "single.json").read_text())
    b = json.loads((tmp_path / "multi.json").read_text())
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=1e-6), k

    def key(d):
        return (
            d["image_id"],
            d["category_id"],
            round(d["score"], 5),
            [round(v, 2) for v in d["bbox"]],
        )

    pa = sorted(map(key, json.loads((tmp_path / "single" / "predictions.json").read_text())))
    pb = sorted(map(key, json.loads((tmp_path / "multi" / "predictions.json").read_text())))
    assert pa == pb and len(pa) > 0
    # Every validation image was scored exactly once.
    gt = json.loads((tmp_path / "multi" / "ground_truth.json").read_text())
    assert sorted(im["id"] for im in gt["images"]) == list(range(10))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_worker_is_restarted_and_the_run_completes(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=48, n_val=4)
    out = tmp_path / "elastic"
    cmd = [
        *TORCHRUN,
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "--max-restarts=1",
        str(REPO / "train_multi_GPU.py"),
        *train_argv(data, out, epochs=3),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # Wait until epoch 0 is checkpointed, then SIGKILL one worker during epoch 1.
        deadline = time.time() + 240
        while not (out / "last.pt").is_file():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "epoch 0 never finished"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert "resuming from" in log
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]  # each epoch exactly once
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


def test_plain_python_launch_runs_single_process_with_a_hint(shapes_data, tmp_path):
    proc = _python("train_multi_GPU.py", train_argv(shapes_data, tmp_path / "plain"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchrun --nproc_per_node" in proc.stderr
    assert torch.load(tmp_path / "plain" / "last.pt", weights_only=True)["epoch"] == 0


def _python(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python <script> args`` from the repository root (forked warm: tests/warm_python.py)."""
    argv = [sys.executable, str(REPO / script), *args]
    return warm_python.run(argv, cwd=REPO, env=script_env(), timeout=300)


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

    first = _python("train.py", flags(1))
    assert first.returncode == 0, first.stderr[-3000:]
    assert initial_lrs() == {lr0}
    grown = _torchrun("train_multi_GPU.py", flags(2, "--resume"))
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert "lr0 0.001 -> 0.002, accumulate 1 -> 1" in grown.stderr
    assert "global batch 4 x 2 process(es) (the checkpoint's: 4 x 1)" in grown.stderr
    assert initial_lrs() == {2 * lr0}
    shrunk = _python("train.py", flags(3, "--resume"))
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    assert "lr0 0.002 -> 0.001" in shrunk.stderr and "(the checkpoint's: 4 x 2)" in shrunk.stderr
    # The other settings that changed (epochs) are named too.
    assert "this run differs from the checkpoint's: epochs: 2 -> 3" in shrunk.stderr
    assert initial_lrs() == {lr0}
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0", "1", "2"]
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


# ---- clusters, emulated on this machine: two "nodes" of one process each, and SLURM --------


def _popen(
    cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen | warm_python.WarmProcess:
    """``cmd`` started from the repository root, stderr into stdout: a launcher (torchrun) as a
    process of its own, a script forked warm (tests/warm_python.py)."""
    env = env or script_env()
    if cmd[1].endswith(".py"):
        return warm_python.start(cmd, cwd=REPO, env=env, merge_stderr=True)
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(
    procs: list[subprocess.Popen | warm_python.WarmProcess], timeout: float = 400
) -> list[str]:
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(p, warm_python.WarmProcess):
                p.wait(left)
                logs.append(p.output()[0])
            else:
                logs.append(p.communicate(timeout=left)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return logs


def test_two_nodes_static_rendezvous_equals_single_process_validation(make_shapes_data, tmp_path):
    """Two torchrun launchers (--nnodes=2, node_rank 0 and 1), one gloo process each, as on
    two machines: 2 epochs, and the final mAP equals validation.py on last.pt."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "two_nodes"
    port = free_port()
    flags = train_argv(data, out, epochs=2, img=64, multi_scale=True)
    launchers = [
        _popen(
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(REPO / "train_multi_GPU.py"),
                *flags,
            ]
        )
        for node in range(2)
    ]
    logs = _finish(launchers)
    assert "device cpu x 2 process(es)" in logs[0]
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    single = validate_run(data, out, tmp_path)
    for key, value in single.items():
        assert float(rows[-1][key]) == pytest.approx(value, abs=1e-6), key


def test_two_nodes_c10d_rendezvous_survive_a_killed_process(make_shapes_data, tmp_path):
    """Two launchers with the c10d rendezvous and --max-restarts=1; the process of "node" 1 is
    killed during epoch 1: both restart, resume from last.pt, and each epoch runs once."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "c10d"
    port = free_port()
    flags = train_argv(data, out, epochs=3, img=64)
    launchers = [
        _popen(
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
                str(REPO / "train_multi_GPU.py"),
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
        workers = _children(launchers[1].pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
    except BaseException:
        for p in launchers:
            p.kill()
        raise
    logs = _finish(launchers)
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
            _popen(
                [
                    sys.executable,
                    str(REPO / "train_multi_GPU.py"),
                    *train_argv(data, out, img=64),
                ],
                env,
            )
        )
    logs = _finish(procs)
    assert f"master localhost:{15000 + job_id % 15000}" in logs[0]
    assert "device cpu x 2 process(es)" in logs[0]
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["0"]


def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank(make_shapes_data, tmp_path):
    """As on a node without the shared output folder: rank 1's --resume path does not exist
    there. Both ranks stop at once with the same one-line error naming rank 1 (no hang)."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "shared"
    first = _python("train.py", train_argv(data, out, img=64))
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
        argv = [sys.executable, str(REPO / "train_multi_GPU.py"), *flags]
        argv += ["--resume", str(resume), "--dist-timeout", "120"]
        procs.append(warm_python.start(argv, cwd=REPO, env=env))
    deadline = time.monotonic() + 100
    try:
        for p in procs:
            p.wait(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
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
