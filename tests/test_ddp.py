"""Distributed training and evaluation under torchrun on the CPU (gloo), via the real scripts."""

from __future__ import annotations

import csv
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

from train_utils.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _train_flags(data: Path, out: Path, epochs: int) -> list[str]:
    return [
        "--data",
        str(data),
        "--cfg",
        str(REPO / "cfg" / "yolov3-spp-nano.cfg"),
        "--hyp",
        str(REPO / "cfg" / "hyp.yaml"),
        "--epochs",
        str(epochs),
        "--batch-size",
        "4",
        "--img-size",
        "128",
        "--no-multi-scale",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--output-dir",
        str(out),
    ]


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
        f"--master_port={_free_port()}",
        *(extra or []),
        str(REPO / script),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def ddp_run(shapes_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = _torchrun("train_multi_GPU.py", _train_flags(shapes_data, out, 2))
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
    assert [r["epoch"] for r in _rows(out / "results.csv")] == ["0", "1"]
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
    common = [
        "--cfg",
        str(out / "model.cfg"),
        "--data",
        str(shapes_data),
        "--weights",
        str(out / "last.pt"),
        "--img-size",
        "128",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--workers",
        "0",
        "--conf-thres",
        "0.001",
    ]
    single = subprocess.run(
        [
            sys.executable,
            str(REPO / "validation.py"),
            *common,
            "--json-out",
            str(tmp_path / "single.json"),
            "--save-json",
            str(tmp_path / "single"),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    multi = _torchrun(
        "validation.py",
        [
            *common,
            "--json-out",
            str(tmp_path / "multi.json"),
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
        f"--master_port={_free_port()}",
        "--max-restarts=1",
        str(REPO / "train_multi_GPU.py"),
        *_train_flags(data, out, 3),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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
    rows = _rows(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]  # each epoch exactly once
    assert load_checkpoint(out / "last.pt")["epoch"] == 2


def test_plain_python_launch_runs_single_process_with_a_hint(shapes_data, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train_multi_GPU.py"),
            *_train_flags(shapes_data, tmp_path / "plain", 1),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchrun --nproc_per_node" in proc.stderr
    assert torch.load(tmp_path / "plain" / "last.pt", weights_only=True)["epoch"] == 0
