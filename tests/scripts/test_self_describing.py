"""Runs that describe themselves: every script works from a train.py checkpoint alone.

``validation.py --weights best.pt`` reproduces the mAP the run logged (same data, image and batch
size, thresholds, autocast dtype and memory format, all read from the checkpoint);
``predict.py``, ``tools/export.py`` and ``tools/convert_weights.py`` need only
``--weights``; ``train.py --resume runs/x/last.pt`` alone continues that run in runs/x; weights
are recognised by content; an ONNX file gets a sentence, not a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, read_results, train_argv

import predict
import train
import validation
from build_utils.errors import CheckpointError
from train_utils import precision
from train_utils.checkpoint import read_weights, weights_kind
from train_utils.cli import parse_args, take_from_run
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.evaluation.options import eval_options
from train_utils.precision import precision_record, replay_precision

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _train_argv(data: Path, out: Path, epochs: int) -> list[str]:
    # Batch 3 and 96 px are not validation.py's defaults (rect batches are shaped per batch),
    # and the run's channels_last must come back from the checkpoint.
    hyp = REPO_ROOT / "cfg" / "hyp_demo.yaml"
    return train_argv(data, out, "--channels-last", hyp=hyp, epochs=epochs, batch=3, img=96, nbs=6)


@pytest.fixture(scope="module")
def run_dir(shapes_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("selfdesc") / "run"
    assert train.main(_train_argv(shapes_data, out, 2)) == 0
    return out


def test_checkpoint_records_how_the_run_computed(run_dir):
    weights = read_weights(run_dir / "best.pt")
    assert weights.kind == "torch" and weights.cfg_text and weights.names
    assert weights.run["img_size"] == 96 and weights.run["batch_size"] == 3
    assert weights.precision == {"amp": None, "channels_last": True}


def test_validation_with_the_checkpoint_alone_reproduces_the_logged_map(run_dir, tmp_path):
    stats_file = tmp_path / "stats.json"
    argv = ["--weights", str(run_dir / "best.pt"), "--json-out", str(stats_file)]
    assert validation.main([*argv, "--save-dir", str(tmp_path / "val"), "--no-plots"]) == 0
    got = json.loads(stats_file.read_text())
    best = max(read_results(run_dir / "results.csv"), key=lambda r: float(r["mAP50-95"]))
    for name in STAT_NAMES:
        assert got[name] == pytest.approx(float(best[name]), abs=1e-4), name
    # Some recall at all: the comparison would be vacuous if every number were 0.
    assert any(got[n] > 0 for n in ("mAR100", "mAR10", "mAP50"))


def test_validation_flags_override_the_run_with_a_line(run_dir, tmp_path, caplog):
    stats_file = tmp_path / "stats.json"
    argv = ["--weights", str(run_dir / "best.pt"), "--img-size", "128", "--no-plots"]
    argv += ["--json-out", str(stats_file), "--save-dir", str(tmp_path / "val")]
    with caplog.at_level("INFO"):
        assert validation.main(argv) == 0
    assert "--img-size 128 (the run had 96)" in caplog.text


def test_predict_export_and_convert_take_the_checkpoint_alone(run_dir, shapes_data, tmp_path):
    images = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[:2]
    out = tmp_path / "pred"
    argv = ["--weights", str(run_dir / "best.pt"), "--source", *map(str, images)]
    assert predict.main([*argv, "--output", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.jpg")) == sorted(p.name for p in images)

    from tools import convert_weights, export

    pt = tmp_path / "copy.pt"
    shutil.copy(run_dir / "best.pt", pt)
    assert convert_weights.main(["--weights", str(pt)]) == 0
    darknet = tmp_path / "copy.weights"
    assert weights_kind(darknet) == "darknet"
    assert export.main(["--weights", str(pt), "--no-verify"]) == 0
    assert (tmp_path / "copy.onnx").stat().st_size > 0
    # The exported ONNX file given back to a script: one sentence, exit 2.
    assert predict.main(["--weights", str(tmp_path / "copy.onnx"), "--source", str(images[0])]) == 2


def test_weights_are_recognised_by_content_not_suffix_case(run_dir, tmp_path, capsys):
    upper = tmp_path / "BEST.PT"
    shutil.copy(run_dir / "best.pt", upper)
    assert weights_kind(upper) == "torch"
    odd = tmp_path / "best.Weights"  # a checkpoint with a Darknet-like name is still a checkpoint
    shutil.copy(run_dir / "best.pt", odd)
    assert weights_kind(odd) == "torch"
    onnx = tmp_path / "model.ONNX"
    onnx.write_bytes(b"\x08\x07\x12\x07pytorch")
    with pytest.raises(CheckpointError, match="ONNX model.*onnxruntime.*\\.pt checkpoint"):
        weights_kind(onnx)
    darknet = tmp_path / "renamed.pt"  # Darknet header 0.2.0 + 8-byte seen
    darknet.write_bytes(np.array([0, 2, 0], "<i4").tobytes() + bytes(8) + bytes(40))
    assert weights_kind(darknet) == "darknet"


def test_resume_with_the_path_alone_continues_the_run_in_its_folder(
    shapes_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "exp"
    assert train.main(_train_argv(shapes_data, run, 1)) == 0
    # Make it a run interrupted after epoch 0 of 2, as a preempted job leaves it.
    ckpt = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    ckpt["config"]["epochs"] = 2
    torch.save(ckpt, run / "last.pt")
    assert train.main(["--resume", str(run / "last.pt")]) == 0
    assert [r["epoch"] for r in read_results(run / "results.csv")] == ["0", "1"]
    assert torch.load(run / "last.pt", weights_only=True)["epoch"] == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["exp"]


def test_bare_resume_takes_the_latest_run(shapes_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train.main(["--resume"]) == 2
    assert "no runs/*/last.pt to continue" in capsys.readouterr().err
    run = tmp_path / "runs" / "a"
    assert train.main(_train_argv(shapes_data, run, 1)) == 0
    ckpt = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    ckpt["config"]["epochs"] = 2
    torch.save(ckpt, run / "last.pt")
    assert train.main(["--resume"]) == 0
    assert [r["epoch"] for r in read_results(run / "results.csv")] == ["0", "1"]


# ---- the pure parts, including the CUDA decisions ------------------------------------------


@pytest.mark.parametrize(
    ("record", "run_amp", "flag", "device", "want"),
    [
        ({"amp": "bfloat16", "channels_last": True}, "auto", None, CUDA, torch.bfloat16),
        ({"amp": "float16", "channels_last": True}, "auto", None, CUDA, torch.float16),
        ({"amp": None, "channels_last": False}, "auto", None, CUDA, None),  # a CPU run on a GPU
        ({"amp": "bfloat16", "channels_last": False}, "on", None, CPU, torch.bfloat16),
        ({"amp": "float16", "channels_last": True}, "auto", None, CPU, None),  # no fp16 on CPU
        ({"amp": "bfloat16", "channels_last": True}, "auto", "off", CUDA, None),  # flag wins
        ({}, "auto", None, CPU, None),  # an older checkpoint: the run's mode on this device
    ],
)
def test_replay_precision(record, run_amp, flag, device, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)  # a CPU oneDNN runs bf16 on
    amp, channels_last, why = replay_precision(record, run_amp, flag, None, device)
    assert amp == want and why
    assert channels_last == bool(record.get("channels_last", False))
    assert replay_precision(record, run_amp, flag, False, device)[1] is False


def test_a_bf16_record_replays_in_fp32_on_a_cpu_without_bf16_kernels(monkeypatch):
    """What autocast_context would run there anyway (fp32), now also what the report says."""
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: False)
    amp, _, why = replay_precision({"amp": "bfloat16"}, "auto", None, None, CPU)
    assert amp is None and why == "the run's bfloat16, in fp32: this CPU has no bf16 kernels"


def test_precision_record_round_trips(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # an Ampere GPU
    for dtype in (torch.bfloat16, torch.float16, None):
        for cl in (True, False):
            rec = precision_record(dtype, cl)
            assert replay_precision(rec, "auto", None, None, CUDA)[:2] == (dtype, cl)


def test_eval_options_are_the_same_for_training_and_validation():
    run = {"conf_thres": 0.01, "iou_thres": 0.5, "coco_backend": "faster-coco-eval"}
    opts = eval_options(run, CUDA, torch.bfloat16, True, True)
    assert (opts.conf_thres, opts.iou_thres, opts.backend) == (0.01, 0.5, "faster-coco-eval")
    assert (opts.amp, opts.channels_last, opts.per_class, opts.device) == (
        torch.bfloat16,
        True,
        True,
        CUDA,
    )


def test_take_from_run_fills_only_what_was_not_typed(caplog):
    parser = validation.get_parser()
    args = parse_args(parser, ["--weights", "w.pt", "--img-size", "320"])
    run = {"img_size": 416, "batch_size": 16, "conf_thres": None}
    with caplog.at_level("INFO"):
        taken = take_from_run(
            args, run, {"img_size": 512, "batch_size": 8, "conf_thres": 0.001}, "test"
        )
    assert taken == ["batch_size"]
    assert (args.img_size, args.batch_size, args.conf_thres) == (320, 16, 0.001)
    assert "--img-size 320 (the run had 416)" in caplog.text


@pytest.mark.parametrize(
    ("key", "value", "message", "validates"),
    [
        # validation.py replays the recorded precision, not the run's --amp mode.
        ("amp", "xyz", "--amp 'xyz' is not one of", False),
        ("coco_backend", "nope", "--coco-backend 'nope' is not one of", True),
        ("img_size", 65536, "larger than the limit", True),
        ("batch_size", -3, "--batch-size must be >= 1", True),
        ("conf_thres", 7.0, "--conf-thres must be in [0, 1]", True),
    ],
)
def test_a_checkpoint_recording_a_bad_run_gets_one_line(
    run_dir, tmp_path, key, value, message, validates
):
    """A recorded run is input too: its values pass the same checks as typed flags."""
    ckpt = torch.load(run_dir / "best.pt", map_location="cpu", weights_only=True)
    ckpt["config"][key] = value
    bad = tmp_path / "runs" / "bad" / "last.pt"
    bad.parent.mkdir(parents=True)
    torch.save(ckpt, bad)
    if validates:
        argv = ["--weights", str(bad), "--save-dir", str(tmp_path / "val")]
        code, err = _main_err(validation.main, argv)
        assert code == 2 and message in err and "Traceback" not in err, err
    code, err = _main_err(train.main, ["--resume", str(bad)])
    assert code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in bad.parent.iterdir()) == ["last.pt"]  # nothing written


def test_recorded_values_of_the_wrong_kind_are_ignored(run_dir, tmp_path, caplog):
    ckpt = torch.load(run_dir / "best.pt", map_location="cpu", weights_only=True)
    ckpt["config"]["img_size"] = "96"  # a string where a number belongs
    ckpt["config"]["data"] = {"path": 5}
    bad = tmp_path / "bad.pt"
    torch.save(ckpt, bad)
    code, err = _main_err(validation.main, ["--weights", str(bad)])
    assert code == 2 and "pass --data" in err
    assert "ignoring the run's img_size='96'" in caplog.text


def _main_err(main, argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        code = main(argv)
    return code, buf.getvalue()
