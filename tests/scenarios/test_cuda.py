"""CUDA twins of paths the CPU suite covers: a training run on the GPU with ``--amp auto`` whose
checkpoint reloads on the CPU, the same under ``--compile`` (torch.compile: too slow for the CPU
suite), ``--recipe darknet`` on the GPU against the same run on the CPU, and the channels_last +
autocast forward against fp32.

Every test here is marked ``cuda`` (tests/cuda_marker.py): skipped without a CUDA device, a
failure under ``YOLO_REQUIRE_CUDA=1``, which ``make gpu-check`` sets. Each takes seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import NANO_CFG, read_results, train_argv

from models.darknet import Darknet
from train_utils.checkpoint import load_checkpoint, read_weights
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.process_group import DistInfo
from train_utils.load_model import model_from_weights
from train_utils.precision import (
    autocast_context,
    cuda_has_native_bf16,
    resolve_amp,
    to_model_input,
)
from train_utils.trainer import run

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)
# Relative L2 error of each head's raw logits, autocast + channels_last against fp32 (TF32
# off). bf16 keeps 8 significant bits, fp16 11: the nano cfg's convolutions on BatchNorm-
# calibrated activations end at ~9e-3 (bf16) and ~1.6e-3 (fp16), measured with the CPU's autocast
# on this test's model; fp32 channels_last alone differs by ~1e-6; a wrong layout or cast ~1.
AUTOCAST_REL_TOLERANCE = 0.05
# Below this the forward did not compute in the lower precision at all.
AUTOCAST_MIN_ERROR = 1e-4
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def test_a_cuda_device_computes() -> None:
    x = torch.arange(4.0, device=CUDA)
    assert (x * 2).sum().item() == 12.0


def test_training_on_cuda_with_amp_auto_reloads_on_the_cpu(make_shapes_data, tmp_path) -> None:
    """``--amp auto`` on a GPU trains under autocast (bf16 where the GPU has it, else fp16 with
    a GradScaler), the losses stay finite, the checkpoint records the dtype, and it loads and
    runs on the CPU."""
    data = make_shapes_data(8, 4)
    out = tmp_path / "run"
    argv = train_argv(data, out, "--amp", "auto", img=64, batch=4, device="cuda")
    run(build_config(get_args_parser().parse_args(argv)), DistInfo.single(CUDA))

    expected = torch.bfloat16 if cuda_has_native_bf16() else torch.float16
    assert resolve_amp("auto", CUDA) is expected
    row = read_results(out / "results.csv")[-1]
    for key in ("box_loss", "obj_loss", "cls_loss", "mAP50"):
        assert math.isfinite(float(row[key])), key
    weights = read_weights(out / "last.pt")
    assert weights.precision == {"amp": DTYPE_NAMES[expected], "channels_last": True}
    # A GradScaler (and its state in the checkpoint) exactly when the run was fp16.
    assert (weights.ckpt["scaler"] is not None) == (expected is torch.float16)
    assert all(t.device.type == "cpu" for t in weights.ckpt["model"].values())
    model = model_from_weights(weights, None, None, 64).eval()
    with torch.no_grad():
        det, _ = model(torch.rand(1, 3, 64, 64))
    assert det.shape[0] == 1 and torch.isfinite(det).all()


@pytest.mark.slow  # a minute of compiling on an H200: make gpu-check runs it with --compile
def test_compiled_training_on_cuda_saves_plain_weights_and_resumes(make_shapes_data, tmp_path):
    """``--compile``: the run trains and evaluates through torch.compile, its checkpoint holds
    the model's own parameter names (no ``_orig_mod.``), and ``--resume`` continues it."""
    data = make_shapes_data(8, 4)
    out = tmp_path / "run"
    argv = train_argv(data, out, "--compile", img=64, batch=4, device="cuda")
    run(build_config(get_args_parser().parse_args(argv)), DistInfo.single(CUDA))
    ckpt = load_checkpoint(out / "last.pt")
    assert set(ckpt["model"]) == set(Darknet(NANO_CFG).state_dict())
    resumed = train_argv(data, out, "--compile", "--resume", epochs=2, img=64, device="cuda")
    run(build_config(get_args_parser().parse_args(resumed)), DistInfo.single(CUDA))
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert all(math.isfinite(float(r["box_loss"])) for r in rows)


def test_darknet_recipe_on_cuda_follows_the_cpu_run(shapes_data, tmp_path_factory) -> None:
    """``--recipe darknet`` on the GPU: the cfg's schedule and counters as on the CPU, the first
    round's loss within 2% of the CPU run's (TF32 convolutions, another summation order) and
    the later rounds' within 10%: CUDA's atomic-add backward is not deterministic, and after 5
    updates two runs on the same H200 ended at 7.46 and 7.62 against the CPU's 7.28. A wrong
    device path (truths on the wrong device, a dropped term) fails or differs by far more."""
    from tests.scenarios.test_darknet_recipe_runs import recipe_argv, recipe_cfg

    tmp = tmp_path_factory.mktemp("recipe-cuda")
    cfg = recipe_cfg(tmp)
    results = {}
    for device in ("cpu", "cuda"):
        argv = [*recipe_argv(shapes_data, tmp / device, cfg), "--device", device]
        dist = DistInfo.single(CUDA if device == "cuda" else torch.device("cpu"))
        run(build_config(get_args_parser().parse_args(argv)), dist)
        results[device] = read_results(tmp / device / "results.csv")
    assert [r["epoch"] for r in results["cuda"]] == [r["epoch"] for r in results["cpu"]]
    for k, (cpu, gpu) in enumerate(zip(results["cpu"], results["cuda"], strict=True)):
        assert float(gpu["lr"]) == float(cpu["lr"])
        assert float(gpu["loss"]) == pytest.approx(float(cpu["loss"]), rel=0.02 if k == 0 else 0.1)
    ckpt = load_checkpoint(tmp / "cuda" / "last.pt")
    assert ckpt["recipe"] == "darknet" and ckpt["seen"] == 6 * 4
    assert (tmp / "cuda" / "last.weights").is_file()


def calibrated_model(device: torch.device, side: int, seed: int = 0) -> Darknet:
    """The nano model in eval mode with each BatchNorm's running statistics set to those of a
    random batch (one training-mode pass with cumulative averaging), so that activations are
    well-scaled at every depth, as in a trained model, rather than growing layer by layer."""
    torch.manual_seed(seed)
    model = Darknet(NANO_CFG, img_size=side).to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # cumulative: one pass sets the statistics of that pass
    model.train()
    with torch.no_grad():
        model(torch.rand(4, 3, side, side, device=device))
    return model.eval()


def autocast_head_errors(device: torch.device, amp: torch.dtype, side: int = 128) -> list[float]:
    """Relative L2 error of each head's raw logits: channels_last + autocast to ``amp`` (as
    training and evaluation compute on CUDA) against contiguous fp32 without TF32."""
    model = calibrated_model(device, side)
    imgs = torch.randint(0, 256, (2, 3, side, side), dtype=torch.uint8)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # fp32 proper: TF32 convolutions round to 10 bits
    try:
        with torch.no_grad():
            _, ref = model(to_model_input(imgs, device))
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    model = model.to(memory_format=torch.channels_last)
    with torch.no_grad(), autocast_context(device, amp):
        _, got = model(to_model_input(imgs, device, channels_last=True))
    return [((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, ref)]


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_channels_last_autocast_forward_matches_fp32(amp: torch.dtype) -> None:
    if amp is torch.bfloat16 and not cuda_has_native_bf16():
        pytest.skip("this GPU has no bf16 (--amp auto uses fp16 on it)")
    errors = autocast_head_errors(CUDA, amp)
    assert max(errors) < AUTOCAST_REL_TOLERANCE, errors
    assert min(errors) > AUTOCAST_MIN_ERROR, errors  # autocast did compute in bf16/fp16


def test_validation_half_scores_as_fp32(shapes_data, tmp_path) -> None:
    """validation.py --half (predict.py's flag): fp16 weights and inputs on CUDA, the run's bf16
    autocast not replayed; the 12 COCO stats within 0.01 of float32's."""
    import json

    from conftest import validation_argv

    import validation
    from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes
    from train_utils.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = Darknet(rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 5), img_size=128)
    with torch.no_grad():
        for i in model.yolo_layers:  # confident boxes, class 0
            model.module_list[i - 1].Conv2d.bias.view(3, -1)[:, 4:6] = 3.0
    ckpt = tmp_path / "w.pt"
    record = {"amp": "bfloat16", "channels_last": True}
    save_checkpoint({"model": model.state_dict(), "epoch": -1, "precision": record}, ckpt)
    stats = {}
    for name, flags in {"half": ["--half"], "fp32": ["--amp", "off"]}.items():
        argv = validation_argv(NANO_CFG, shapes_data, ckpt, *flags, device="cuda")
        argv += ["--json-out", str(tmp_path / f"{name}.json"), "--save-dir", str(tmp_path / name)]
        assert validation.main(argv) == 0
        stats[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert stats["half"].keys() == stats["fp32"].keys()
    for key, value in stats["fp32"].items():
        assert abs(stats["half"][key] - value) <= 0.01, (key, stats)


def test_predict_half_after_a_bf16_run(tmp_path) -> None:
    """predict.py --half on a checkpoint whose run evaluated in bf16 (the default on a GPU
    with bf16): fp16 weights and inputs, the run's autocast not replayed (was: BatchNorm got
    bf16 input with fp16 parameters, which CUDA refuses)."""
    import cv2
    import numpy as np

    import predict
    from train_utils.checkpoint import save_checkpoint

    model = calibrated_model(torch.device("cpu"), 64)
    ckpt = tmp_path / "bf16.pt"
    record = {"amp": "bfloat16", "channels_last": True}
    save_checkpoint({"model": model.state_dict(), "epoch": -1, "precision": record}, ckpt)
    image = tmp_path / "x.jpg"
    cv2.imwrite(str(image), np.full((64, 64, 3), 127, np.uint8))
    argv = ["--weights", str(ckpt), "--cfg", str(NANO_CFG), "--source", str(image)]
    argv += ["--img-size", "64", "--device", "cuda", "--half", "--output", str(tmp_path / "o")]
    assert predict.main(argv) == 0
    assert (tmp_path / "o" / "x.jpg").is_file()
