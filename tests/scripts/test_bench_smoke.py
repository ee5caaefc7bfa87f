"""The benchmark scripts run from the repository root with tiny settings and write valid JSON.

Their numbers are never asserted: they depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

REPO = Path(__file__).resolve().parents[2]
NANO = str(REPO / "cfg" / "yolov3-spp-nano.cfg")


def _bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(REPO / "bench" / script), *args]
    proc = warm_python.run(argv, cwd=REPO, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_bench_model_writes_a_row_per_variant(tmp_path):
    out = tmp_path / "model.json"
    proc = _bench(
        "bench_model.py",
        "--cfg",
        NANO,
        "--sizes",
        "64",
        "--train-batch",
        "2",
        "--steps",
        "1",
        "--threads",
        "1",
        "--skip-ceiling",
        "--precisions",
        "fp32",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    rows = result["results"]
    assert {(r["mode"], r["format"]) for r in rows} == {
        (m, f) for m in ("eval", "train") for f in ("contiguous", "channels_last")
    }
    for r in rows:
        assert r["img_per_s"] > 0 and r["gflop_per_img"] > 0
        assert r["vs_fp32_contiguous"] is not None
    assert "mkldnn_bf16" in result["info"]
    assert "vs fp32/contig" in proc.stdout


@pytest.mark.slow
def test_bench_model_times_the_optimizer_training_uses(monkeypatch):
    """Fused where training fuses it (CUDA: optim.uses_fused_optimizer), as the
    trainer builds it; faked here on the CPU, whose fused kernels exist too."""
    import torch

    from bench import bench_model
    from models.darknet import Darknet

    model = Darknet(NANO, img_size=64)
    step = bench_model.TrainStep(model, model, "fp32", "contiguous", 64)
    assert not any(g["fused"] for g in step.optimizer.param_groups)  # the CPU's default
    # Was: never fused, while training on CUDA is.
    monkeypatch.setattr(bench_model, "uses_fused_optimizer", lambda device: True)
    step = bench_model.TrainStep(model, model, "fp32", "contiguous", 64)
    assert all(g["fused"] for g in step.optimizer.param_groups)
    imgs, targets = bench_model.synthetic_batch(2, 64, model.nc, seed=0)
    assert torch.isfinite(step(imgs, targets))


@pytest.mark.parametrize(
    ("native", "expected"), [(True, ["fp32", "fp16", "bf16"]), (False, ["fp32", "fp16"])]
)
def test_bench_model_times_bf16_on_gpus_that_compute_it(monkeypatch, native, expected):
    import torch

    from bench import bench_model

    monkeypatch.setattr(bench_model, "cuda_has_native_bf16", lambda: native)
    assert bench_model.default_precisions(torch.device("cuda"), None) == expected
    assert bench_model.default_precisions(torch.device("cpu"), True) == ["fp32", "bf16"]


def test_bench_ddp_reports_the_ratio(tmp_path):
    out = tmp_path / "ddp.json"
    proc = _bench(
        "bench_ddp.py",
        "--img-size",
        "64",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--accumulate",
        "2",
        "--repeat",
        "1",
        "--skip-no-sync",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert [r["processes"] for r in result["results"]] == [1, 2, 2]
    assert [r["all_reduce"] for r in result["results"]] == ["-", "per step", "per batch"]
    assert "accumulate 2: all-reduce per optimizer step (no_sync) vs per micro-batch" in proc.stdout
    assert result["ratio"] > 0
    # One repetition: the paired median is that repetition's own 2-process / 1-process ratio.
    assert len(result["ratios_paired"]) == 1
    assert result["ratio_paired_median"] == result["ratios_paired"][0] > 0
    assert "2-process / 1-process throughput" in proc.stdout


@pytest.mark.slow
def test_bench_e2e_reports_epochs_and_map(shapes_data, tmp_path):
    out = tmp_path / "e2e.json"
    _bench(
        "bench_e2e.py",
        "--data",
        str(shapes_data),
        "--epochs",
        "1",
        "--img-size",
        "64",
        "--workers",
        "0",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert [r["epoch"] for r in result["epochs"]] == [0]
    assert 0 <= result["epochs"][0]["mAP50"] <= 1
    assert result["s_per_epoch"] > 0


def test_bench_memory_format_reports_the_choice(tmp_path):
    out = tmp_path / "mf.json"
    proc = _bench(
        "bench_memory_format.py",
        "--models",
        "nano",
        "--size",
        "64",
        "--batch",
        "2",
        "--repeat",
        "1",
        "--threads",
        "1",
        "--json",
        str(out),
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["auto"] in ("contiguous", "channels_last")
    # The choice follows its own decision timings (rounded to 0.1 ms in the JSON: two that
    # round equal do not tell which was faster).
    nhwc, nchw = row["decision_channels_last_s"], row["decision_contiguous_s"]
    if nhwc != nchw:
        assert (row["auto"] == "channels_last") is (nhwc < nchw)
    assert row["auto_vs_contiguous"] > 0 and "auto/contig" in proc.stdout


def test_bench_shared_cores_times_each_policy_idle_and_busy(tmp_path):
    out = tmp_path / "shared.json"
    _bench(
        "bench_shared_cores.py",
        *("--seconds", "2", "--img-size", "64", "--batch", "2", "--skip", "1"),
        *("--variants", "fixed1", "--json", str(out)),
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["busy"]) for r in rows] == [("fixed1", False), ("fixed1", True)]
    assert all(r["steps"] >= 1 and r["median_s"] > 0 for r in rows)
    assert rows[0]["threads"] == rows[1]["threads"] == [1]  # YOLO_THREADS=1 reached the child


def test_bench_scale_measures_scan_and_ram_cache(tmp_path):
    out = tmp_path / "scale.json"
    proc = _bench(
        "bench_scale.py",
        "--only",
        "scan",
        "ram",
        "--scan-sizes",
        "12",
        "--ram-sizes",
        "64",
        "--ram-images",
        "3",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    # A cold scan checks every file and writes the cache; the warm start reads it.
    assert [(r["phase"], r["images"]) for r in result["scan"]] == [("cold", 12), ("warm", 12)]
    cold, warm = result["scan"]
    assert "build_label_cache" in cold["phases_s"] and "build_label_cache" not in warm["phases_s"]
    assert cold["cache_bytes"] == warm["cache_bytes"] > 0
    assert cold["objects"] == warm["objects"]
    assert cold["cpu_s"] > 0 and cold["growth"] is None  # one size: nothing to compare
    (ram,) = result["ram"]
    # COCO-sized images (640 x 480 and the like) cached with their long side at 64 px.
    assert ram["hw3_bytes_per_image"] == ram["array_bytes_per_image"] <= 64 * 64 * 3
    assert "Label scan and cache" in proc.stdout and "RAM image cache" in proc.stdout


@pytest.mark.slow
def test_bench_scale_scores_and_gathers_every_rank_to_rank_0(tmp_path):
    out = tmp_path / "eval.json"
    _bench(
        "bench_scale.py",
        "--only",
        "eval",
        "gather",
        "--eval-sizes",
        "5",
        "--dets-per-image",
        "4",
        "--backends",
        "pycocotools",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert [(r["what"], r["detections"]) for r in result["eval"]] == [
        ("metrics", 20),
        ("pycocotools", 20),
    ]
    assert all(0 <= r["mAP50"] <= 1 for r in result["eval"])
    rows = result["gather"]
    assert [r["rank"] for r in rows] == [0, 1]
    # 5 images sharded 3 + 2: rank 0 gets all 20 detections, rank 1 none.
    assert [r["local_detections"] for r in rows] == [12, 8]
    assert [r["gathered_detections"] for r in rows] == [20, 0]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--repeat", "0"], "--repeat must be >= 1, got 0"),
        (["--dets-per-image", "-5"], "--dets-per-image must be >= 1, got -5"),
        (["--scan-image-side", "0"], "--scan-image-side must be >= 1, got 0"),
        (["--ram-images", "-1"], "--ram-images must be >= 1, got -1"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--objects", "nan"], "--objects must be a number >= 0, got nan"),
        (["--nproc", "100000"], "--nproc 100000 is more than the"),
        (["--json", "{file}/scale.json"], "is a file where a folder should be"),
    ],
)
def test_bench_scale_refuses_bad_flags_before_measuring(args, line, tmp_path, capsys):
    # Were children's tracebacks (a negative array size, set_num_threads(0), Poisson of nan),
    # 100000 torchrun processes, or a traceback at the end of the run for --json.
    from bench import bench_scale

    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file") for a in args]
    assert bench_scale.main(["--only", "eval", "--eval-sizes", "5", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and line in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--seconds", "0"], "--seconds must be a positive number, got 0.0"),
        (["--seconds", "nan"], "--seconds must be a positive number, got nan"),
        (["--variants", "fixed0"], "unknown variant 'fixed0'"),
        (["--variants", "fixed99999"], "variant 'fixed99999': at most 1024 threads"),
        (["--img-size", "100"], "--img-size 100 is not a positive multiple of 32"),
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--batch", "100000000"], "the model does not fit"),
        (["--json", "{file}/shared.json"], "is a file where a folder should be"),
    ],
)
def test_bench_shared_cores_refuses_bad_flags_before_any_child(args, line, tmp_path, capsys):
    # Were an empty measurement's StatisticsError, a child's CalledProcessError, a batch of
    # 10^8 allocated in the child, or a traceback at the end of the run for --json.
    from bench import bench_shared_cores

    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file") for a in args]
    assert bench_shared_cores.main(["--variants", "fixed1", "--img-size", "64", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and line in err[-1]


@pytest.mark.parametrize(
    ("script", "args", "line"),
    [
        ("bench_data", ["--workers", "-1"], "--workers must be >= 0, got -1"),
        ("bench_data", ["--img-size", "100"], "--img-size 100 is not a positive multiple of 32"),
        ("bench_ddp", ["--nproc", "1"], "--nproc must be >= 2, got 1"),
        ("bench_ddp", ["--cfg", "{file}.cfg"], "model cfg not found"),
        ("bench_ddp", ["--batch", "100000000"], "the model does not fit"),
        ("bench_eval", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("bench_eval", ["--json", "{file}/eval.json"], "is a file where a folder should be"),
        ("bench_e2e", ["--epochs", "0"], "--epochs must be >= 1, got 0"),
        ("bench_darknet_recipe", ["--iterations", "0"], "--iterations must be >= 1, got 0"),
        ("bench_darknet_recipe", ["--size", "100"], "--size 100 is not a positive multiple"),
        ("bench_darknet_recipe", ["--parts", "gpu"], "--parts: unknown gpu"),
        ("bench_memory_format", ["--size", "100"], "--size 100 is not a positive multiple of 32"),
        ("bench_memory_format", ["--threads", "0"], "--threads must be >= 1, got 0"),
    ],
)
def test_bench_scripts_refuse_bad_flags_in_one_line(script, args, line, tmp_path, capsys):
    # Were a traceback from a child process, a DataLoader or the model, or at the end of a run.
    import importlib

    main = importlib.import_module(f"bench.{script}").main
    (tmp_path / "file").write_text("")
    assert main([a.format(file=tmp_path / "file") for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and line in err[-1]
