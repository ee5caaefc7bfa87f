"""Darknet fidelity: every cfg of cfg/darknet/ computes what an independent implementation of
Darknet's layers computes from the same ``.weights`` file.

The reference is OpenCV's Darknet importer (``cv2.dnn.readNetFromDarknet``), which OpenCV
dropped in 5.0: it runs in its own small environment ``.venv-cv4`` (``make test`` creates it
from requirements-cv4.txt) through ``tests/opencv_darknet_ref.py``. Without that environment
the comparison is skipped with the reason, except where ``YOLO_REQUIRE_OPENCV4=1`` (set by
``make test``, hence in CI), where it fails instead.

For each cfg, at full size with batch 1 and a small input (96 px, 128 for stride-64 models):
random weights are written with :func:`models.weights.save_weights` after a BatchNorm
calibration that keeps every layer's activations well-scaled (each BatchNorm's running mean and
variance are the statistics of its input on the test image, measured in one pass), the file is
read back into the model (every value first set to NaN, so that anything not read would show)
and must be written back byte for byte, and the conv outputs feeding each ``[yolo]`` head must
match OpenCV's within 1e-4 of that head's largest magnitude.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from build_utils.parse_config import head_conv_index
from models.darknet import Darknet
from models.weights import load_darknet_weights, save_weights

REPO = Path(__file__).resolve().parents[2]
DARKNET_CFGS = sorted((REPO / "cfg" / "darknet").glob("*.cfg"))
CV4_PYTHON = REPO / ".venv-cv4" / "bin" / "python"
REF_SCRIPT = Path(__file__).resolve().parents[1] / "opencv_darknet_ref.py"
REQUIRE_ENV = "YOLO_REQUIRE_OPENCV4"

# Head logits must agree within this fraction of the head's largest |logit|.
REL_TOLERANCE = 1e-4
# Smallest test input: the largest stride times at least 3 cells where the stride allows.
MIN_SIDE = 96
# Random weights. Conv weights before a BatchNorm are N(0, CONV_STD**2), not fan-in scaled:
# BatchNorm inputs then have variances above ~2000 (the first layer: 27 * 30**2 / 12), so that
# OpenCV's BatchNorm epsilon (1e-6) and Darknet's (1e-5, ours) differ by less than 3e-9 relative
# per layer. Convs without BatchNorm (the heads) are fan-in scaled: logits of order 1.
CONV_STD = 30.0
# BatchNorm scales and shifts: small scales around shifts of order 1 keep each activation close
# to linear over the spread of its input. With scales of order 1, random 100-300 layer networks
# are chaotic: float32 rounding (~1e-7, summed in another order by OpenCV) grows to 1e-3..1e-1
# at the heads, while a real difference in a layer (zero padding in a max-pool, say) still shows
# as ~1e-2 here.
BN_GAMMA_RANGE = (0.05, 0.15)
BN_BETA_RANGE = (-0.5, 0.5)
HEAD_BIAS_RANGE = (-1.0, 1.0)
# A BatchNorm input channel nearly constant on the test image (after an SPP max-pool over a
# 2x2 map, say) gets at least this fraction of its second moment as variance: dividing by ~0
# would amplify rounding, which is relative to its mean, by |mean| / std.
MIN_VAR_FRACTION = 1e-1
TIMEOUT_S = 300


def _cv4_python() -> Path:
    if CV4_PYTHON.is_file():
        return CV4_PYTHON
    reason = (
        f"{CV4_PYTHON.relative_to(REPO)} is missing: OpenCV < 5 (the last with a Darknet "
        "importer) lives there; `make test` creates it from requirements-cv4.txt (the parameter "
        "count and the .weights round trip were checked)"
    )
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(reason)


def input_side(model: Darknet) -> int:
    stride = int(max(model.strides))
    return stride * math.ceil(MIN_SIDE / stride)


def _fill_random(model: Darknet, gen: torch.Generator) -> None:
    with torch.no_grad():
        for mdef, m in zip(model.module_defs, model.module_list):
            if mdef["type"] != "convolutional":
                continue
            conv = m.Conv2d
            # Uniform with the wanted standard deviation: twice as fast as normal_ on 10^8 values.
            if hasattr(m, "BatchNorm2d"):
                half_width = CONV_STD * math.sqrt(3)
                m.BatchNorm2d.weight.uniform_(*BN_GAMMA_RANGE, generator=gen)
                m.BatchNorm2d.bias.uniform_(*BN_BETA_RANGE, generator=gen)
            else:
                half_width = math.sqrt(3 / conv.weight[0].numel())
                conv.bias.uniform_(*HEAD_BIAS_RANGE, generator=gen)
            conv.weight.uniform_(-half_width, half_width, generator=gen)


def _calibrate_batchnorm(model: Darknet, x: torch.Tensor) -> None:
    """Set every BatchNorm's running statistics to those of its input on ``x``, in one eval
    pass: each pre-hook runs before its layer, so later layers see calibrated inputs."""

    def hook(bn: nn.BatchNorm2d, args: tuple[torch.Tensor]) -> None:
        v = args[0].detach().double()
        mean = v.mean((0, 2, 3))
        var = v.var((0, 2, 3), unbiased=False)
        floor = MIN_VAR_FRACTION * (var + mean.square())
        bn.running_mean.copy_(mean.float())
        bn.running_var.copy_(torch.maximum(var, floor).float())

    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    handles = [bn.register_forward_pre_hook(hook) for bn in bns]
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        for h in handles:
            h.remove()


def head_conv_outputs(model: Darknet, x: torch.Tensor) -> list[np.ndarray]:
    """The output of the conv feeding each head, (1, na * no, ny, nx), as Darknet lays it out:
    the eval-mode raw head outputs (logits) packed back."""
    with torch.no_grad():
        _, raw = model.eval()(x)
    return [r.permute(0, 1, 4, 2, 3).reshape(r.shape[0], -1, *r.shape[2:4]).numpy() for r in raw]


def opencv_names(model: Darknet) -> list[tuple[str, str | None]]:
    """OpenCV layer names of each head's conv output and, where the conv ends in a logistic
    activation that OpenCV keeps as a layer of its own (new_coords heads), of that."""
    blocks = [model.hyperparams, *model.module_defs]
    names = []
    for i in model.yolo_layers:
        j = head_conv_index(blocks, i + 1) - 1  # the conv's layer index
        act = model.module_defs[j].get("activation", "logistic")
        # OpenCV numbers an activation layer after its conv: conv_j, then logistic_(j + 1).
        names.append((f"conv_{j}", f"logistic_{j + 1}" if act == "logistic" else None))
    return names


def run_opencv(cfg: Path, weights: Path, x: np.ndarray, names: list[str], tmp: Path) -> dict:
    python = _cv4_python()
    np.save(tmp / "input.npy", x)
    out = tmp / "opencv.npz"
    proc = subprocess.run(
        [
            str(python),
            str(REF_SCRIPT),
            str(cfg),
            str(weights),
            str(tmp / "input.npy"),
            str(out),
            *names,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(out) as data:
        return {k: data[k] for k in data.files}


def relative_difference(ours: np.ndarray, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-12))


def documented_params() -> dict[str, int]:
    """The parameter table of cfg/darknet/README.md."""
    text = (REPO / "cfg" / "darknet" / "README.md").read_text()
    rows = re.finditer(r"^\| (\S+\.cfg) \| ([\d,]+) \|", text, re.MULTILINE)
    return {m[1]: int(m[2].replace(",", "")) for m in rows}


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("cfg", DARKNET_CFGS, ids=lambda p: p.stem)
def test_darknet_cfg_matches_opencv(cfg, tmp_path, record_property, monkeypatch):
    # Every value is set below: skip PyTorch's random initialisation of up to 1.3e8 values.
    for name in ("kaiming_uniform_", "uniform_"):
        monkeypatch.setattr(nn.init, name, lambda t, *args, **kwargs: t)
    model = Darknet(cfg)
    monkeypatch.undo()
    assert sum(p.numel() for p in model.parameters()) == documented_params()[cfg.name]
    side = input_side(model)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1, 3, side, side, generator=gen)
    _fill_random(model, gen)
    _calibrate_batchnorm(model, x)
    weights = tmp_path / "random.weights"
    save_weights(model, weights)

    # Everything the model computes from must come from the file.
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))
    load_darknet_weights(model, weights)
    again = tmp_path / "again.weights"
    save_weights(model, again)
    assert again.read_bytes() == weights.read_bytes()
    again.unlink()

    # The rest needs OpenCV 4: skipped (or failed, under make test) here when it is missing.
    _cv4_python()
    ours = head_conv_outputs(model, x)
    names = opencv_names(model)
    ref = run_opencv(cfg, weights, x.numpy(), [n for pair in names for n in pair if n], tmp_path)
    worst = 0.0
    for k, (o, (conv_name, act_name)) in enumerate(zip(ours, names)):
        diff = relative_difference(o, ref[conv_name])
        assert diff < REL_TOLERANCE, f"head {k} ({conv_name}): {diff:.2e}"
        worst = max(worst, diff)
        if act_name is not None:
            # Darknet's conv output is the sigmoid, which OpenCV keeps as a layer of its own.
            sig = 1 / (1 + np.exp(-o.astype(np.float64)))
            assert np.abs(sig - ref[act_name]).max() < REL_TOLERANCE, act_name
    record_property("max_relative_difference", worst)
    print(json.dumps({"cfg": cfg.name, "side": side, "max_rel_diff": worst}))
