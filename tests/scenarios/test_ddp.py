"""Distributed training and evaluation under torchrun on the CPU (gloo), via the real scripts:
one node, a killed worker restarted, two emulated nodes. The other launch forms (plain python,
SLURM, the c10d rendezvous, a resume on another process count) are in test_ddp_launches.py, a
file of its own so that two pytest workers share these minutes."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import (
    REPO_ROOT,
    WARM_TORCHRUN,
    child_pids,
    finish_all,
    read_results,
    run_script,
    start_process,
    torchrun,
    train_argv,
    validate_run,
    validation_argv,
)

from train_utils.checkpoint import load_checkpoint
from train_utils.distributed.launch import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_run(shapes_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = torchrun("train_multi_GPU.py", train_argv(shapes_data, out, epochs=2, plots=True))
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
    single = run_script(
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
    multi = torchrun(
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


def test_killed_worker_is_restarted_and_the_run_completes(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=48, n_val=4)
    out = tmp_path / "elastic"
    proc = start_process(
        [
            *WARM_TORCHRUN,
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "--max-restarts=1",
            str(REPO_ROOT / "train_multi_GPU.py"),
            *train_argv(data, out, epochs=3),
        ]
    )
    try:
        # Wait until epoch 0 is checkpointed, then SIGKILL one worker during epoch 1.
        deadline = time.time() + 240
        while not (out / "last.pt").is_file():
            assert proc.poll() is None, proc.output()[0][-3000:]
            assert time.time() < deadline, "epoch 0 never finished"
            time.sleep(0.2)
        workers = child_pids(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    (log,) = finish_all([proc], timeout=300)
    assert "resuming from" in log
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]  # each epoch exactly once
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


# ---- clusters, emulated on this machine: two "nodes" of one process each, and SLURM --------


def test_two_nodes_static_rendezvous_equals_single_process_validation(make_shapes_data, tmp_path):
    """Two torchrun launchers (--nnodes=2, node_rank 0 and 1), one gloo process each, as on
    two machines: 2 epochs, and the final mAP equals validation.py on last.pt."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "two_nodes"
    port = free_port()
    flags = train_argv(data, out, epochs=2, img=64, multi_scale=True)
    launchers = [
        start_process(
            [
                *WARM_TORCHRUN,
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(REPO_ROOT / "train_multi_GPU.py"),
                *flags,
            ]
        )
        for node in range(2)
    ]
    logs = finish_all(launchers)
    assert "device cpu x 2 process(es)" in logs[0]
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    single = validate_run(data, out, tmp_path)
    for key, value in single.items():
        assert float(rows[-1][key]) == pytest.approx(value, abs=1e-6), key
