"""models/budget.py: the estimate is held to the real model (parameters and layer shapes exact,
training activations within a stated factor of what autograd keeps), costs milliseconds, and a
model that cannot fit is refused in one line naming the layer, before anything is allocated."""

from __future__ import annotations

import re
import time

import pytest
import torch

from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg, parse_model_cfg_text
from models.budget import (
    EXPORT_ACTIVATION_COPIES,
    EXPORT_PARAM_COPIES,
    MEMORY_ENV,
    activation_bytes,
    available_memory,
    check_model_fits,
    estimate_model,
)
from models.darknet import Darknet
from tests.conftest import NANO_CFG, REPO_ROOT

SIZE = 128
# The training estimate over the bytes autograd saves for backward (measured per image at 128
# px): nano 1.04, yolov3-tiny 1.31, yolov3-spp 1.01. It counts a convolution's output and its
# activation's apart, which in-place activations share, so it errs high, never low.
TRAIN_FACTOR = (1.0, 1.5)
CFGS = [NANO_CFG, REPO_ROOT / "cfg" / "yolov3-tiny.cfg", REPO_ROOT / "cfg" / "yolov3-spp.cfg"]


def _saved_for_backward(model: Darknet, batch: int, amp: torch.dtype | None = None) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of a training forward
    (under autocast to ``amp`` on the model's device), the parameters excluded: the activation
    memory of training, measured."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.train()
    device = next(model.parameters()).device
    x = torch.rand(batch, 3, SIZE, SIZE, device=device)
    autocast = torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("cfg", CFGS, ids=lambda p: p.stem)
def test_estimate_matches_the_real_model(cfg):
    blocks = parse_model_cfg(cfg)
    est = estimate_model(blocks, (SIZE, SIZE))
    model = Darknet(blocks, img_size=SIZE)
    assert est.params == sum(p.numel() for p in model.parameters())  # exact

    shapes: dict[int, tuple[int, ...]] = {}
    for i, m in enumerate(model.module_list):
        m.register_forward_hook(
            lambda _m, _i, out, i=i: (
                shapes.__setitem__(i, tuple(out.shape[1:]))
                if isinstance(out, torch.Tensor)
                else None
            )
        )
    saved = _saved_for_backward(model, batch=2) / 2
    for cost in est.layers:
        if cost.kind != "yolo":
            assert shapes[cost.index] == cost.shape, (cost.index, cost.kind)
    ratio = est.train_bytes_per_image() / saved
    assert TRAIN_FACTOR[0] <= ratio <= TRAIN_FACTOR[1], ratio


@pytest.mark.parametrize("cfg", CFGS[:2], ids=lambda p: p.stem)
def test_the_estimate_under_autocast_counts_its_dtype(cfg):
    """bf16 autocast (torch's CPU autocast, which runs on any CPU): activations take 2 bytes.
    Per image: what a batch of 2 saves beyond a batch of 1, so that autocast's low-precision
    weight copies (saved once per step, counted with the parameters) cancel."""
    # Was: counted at 4 bytes, twice the need, so fits between 1x and 2x were refused.
    blocks = parse_model_cfg(cfg)
    est = estimate_model(blocks, (SIZE, SIZE), activation_bytes(torch.bfloat16))
    model = Darknet(blocks, img_size=SIZE)
    saved = _saved_for_backward(model, 2, torch.bfloat16) - _saved_for_backward(
        model, 1, torch.bfloat16
    )
    ratio = est.train_bytes_per_image() / saved
    assert TRAIN_FACTOR[0] <= ratio <= TRAIN_FACTOR[1], ratio


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CFGS[:2], ids=lambda p: p.stem)
def test_the_estimate_under_cuda_autocast_counts_its_dtype(cfg):
    blocks = parse_model_cfg(cfg)
    est = estimate_model(blocks, (SIZE, SIZE), activation_bytes(torch.float16))
    model = Darknet(blocks, img_size=SIZE).cuda()
    saved = _saved_for_backward(model, 2, torch.float16) - _saved_for_backward(
        model, 1, torch.float16
    )
    ratio = est.train_bytes_per_image() / saved
    assert TRAIN_FACTOR[0] <= ratio <= TRAIN_FACTOR[1], ratio


def test_a_model_that_fits_only_under_autocast_is_accepted_under_autocast(monkeypatch):
    blocks = parse_model_cfg(NANO_CFG)
    half = estimate_model(blocks, (640, 640), activation_bytes(torch.float16))
    # Parameters, their training copies and autocast's 2-byte copy, and 16 images' activations.
    need = half.params * (4 * 5 + 2) + 16 * half.train_bytes_per_image()
    monkeypatch.setenv(MEMORY_ENV, str(need))
    for amp in (torch.float16, torch.bfloat16):
        check_model_fits(blocks, 640, batch=16, training=True, amp=amp)
    with pytest.raises(ConfigError, match=r"training, batch 16, 640x640 px\), .*an estimate"):
        check_model_fits(blocks, 640, batch=16, training=True)  # float32 needs more
    monkeypatch.setenv(MEMORY_ENV, str(need - 1))
    with pytest.raises(ConfigError, match=r"640x640 px, bfloat16 autocast\), "):
        check_model_fits(blocks, 640, batch=16, training=True, amp=torch.bfloat16)


def test_the_check_costs_milliseconds(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(1 << 50))  # walk every layer (the largest cfg, batch 8)
    blocks = parse_model_cfg(REPO_ROOT / "cfg" / "darknet" / "yolov4-p6.cfg")
    t0 = time.perf_counter()
    for _ in range(10):
        check_model_fits(blocks, 1280, batch=8, training=True)
    assert (time.perf_counter() - t0) / 10 < 0.05


WIDE = (
    "[convolutional]\nbatch_normalize=1\nfilters=65536\nsize=3\nstride=1\npad=1\nactivation=leaky\n"
)
HUGE_CFG = (
    "[net]\nwidth=64\nheight=64\n"  # lines 1-3
    + WIDE  # lines 4-10
    + WIDE  # lines 11-17: 65536 x 65536 x 3 x 3 weights, 154 GB
    + "[convolutional]\nsize=1\nfilters=24\nactivation=linear\n"
    + "[yolo]\nmask=0,1,2\nanchors=10,13,16,30,33,23\nclasses=3\n"
)


def test_a_model_that_cannot_fit_is_refused_at_its_layer_before_allocating():
    # Every value is within its bounds; the model is not within any machine's RAM.
    blocks = parse_model_cfg_text(HUGE_CFG, "huge.cfg")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        Darknet(blocks, img_size=64)
    assert time.perf_counter() - t0 < 1.0  # nothing was allocated
    message = str(info.value)
    assert message.startswith("huge.cfg:11: [convolutional] layer 1: the model does not fit: ")
    assert re.search(r"about 144(\.\d)? GiB needed up to this layer", message), message
    assert "RAM available (MemAvailable)" in message and "\n" not in message


def test_activations_refused_at_the_size_and_batch(monkeypatch):
    blocks = parse_model_cfg(NANO_CFG)
    est = estimate_model(blocks, (640, 640))
    need = est.params * 4 * 5 + 16 * est.train_bytes_per_image()
    monkeypatch.setenv(MEMORY_ENV, str(need - 1))
    with pytest.raises(ConfigError, match=r"training, batch 16, 640x640 px\), .* YOLO_MEMORY"):
        check_model_fits(blocks, 640, batch=16, training=True)
    monkeypatch.setenv(MEMORY_ENV, str(need))
    check_model_fits(blocks, 640, batch=16, training=True)  # exactly enough
    # Two DDP ranks training on one node's CPU share its RAM: half each is not enough.
    with pytest.raises(ConfigError, match=r"YOLO_MEMORY_AVAILABLE, shared by 2 processes;"):
        check_model_fits(blocks, 640, batch=16, training=True, share=2)
    assert available_memory() == (need, MEMORY_ENV)


def test_an_export_counts_its_trace_conversion_and_check(monkeypatch):
    """An export holds several sets of one image's activations and copies of the weights at
    once (tools/export.py; bench/README.md "Export memory"): its need is those copies of the
    inference estimate of batch 1."""
    blocks = parse_model_cfg(NANO_CFG)
    est = estimate_model(blocks, (640, 640))
    need = est.params * 4 * EXPORT_PARAM_COPIES
    need += EXPORT_ACTIVATION_COPIES * est.live_bytes_per_image()
    monkeypatch.setenv(MEMORY_ENV, str(need - 1))
    check_model_fits(blocks, 640)  # inference alone fits
    with pytest.raises(
        ConfigError, match=r"\(export, trace and check, 640x640 px\), .* YOLO_MEMORY"
    ):
        check_model_fits(blocks, 640, export=True)
    monkeypatch.setenv(MEMORY_ENV, str(need))
    check_model_fits(blocks, 640, export=True)  # exactly enough


def test_an_input_too_small_for_the_downsampling_is_named():
    pool = "[maxpool]\nsize=2\nstride=2\npadding=0\n"  # halves, rounding down: 16 -> 0 in 5
    text = "[net]\n" + 5 * pool + HUGE_CFG[HUGE_CFG.index("[convolutional]\nsize=1") :]
    blocks = parse_model_cfg_text(text, "pools.cfg")
    check_model_fits(blocks, 32)
    with pytest.raises(
        ConfigError,
        match=r"^pools.cfg:18: \[maxpool\] layer 4: the feature map "
        r"is 0x0 at an input of 16x16",
    ):
        check_model_fits(blocks, 16)


def test_cuda_memory_is_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (123 << 20, 1 << 30))
    assert available_memory(torch.device("cuda:0")) == (123 << 20, "free on cuda:0")


_PEAK_PROGRAM = """
import ctypes, sys, torch
from build_utils.parse_config import parse_model_cfg
from models.budget import estimate_model
from models.darknet import Darknet

def status(key):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))

torch.set_num_threads(1)
blocks = parse_model_cfg(sys.argv[1])
side, training = int(sys.argv[2]), sys.argv[3] == "train"
model = Darknet(blocks).train(training)
with torch.set_grad_enabled(training):
    model(torch.rand(1, 3, 64, 64))  # libraries and kernels loaded, not measured
    x = torch.rand(1, 3, side, side)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    before = status("VmRSS:")
    out = model(x)
    peak = status("VmHWM:") - before
est = estimate_model(blocks, (side, side))
print(est.train_bytes_per_image() if training else est.live_bytes_per_image(), peak)
"""


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CFGS, ids=lambda p: p.stem)
def test_activation_estimate_against_measured_peak_memory(cfg, tmp_path):
    """The estimate against the peak resident memory a forward pass of one 512 px image adds
    (a process of its own, forked warm: the pages it shares with the server are resident
    before the reset, so only what the pass allocates counts; its peak reset to the current
    RSS just before). Measured on CPU: training 0.90 / 1.10 / 0.97x (nano / tiny / spp),
    inference 0.58 / 1.33 / 0.84x (the convolution backend's buffers vary by layer shape)."""
    import sys

    import warm_python

    from tests.conftest import script_env

    program = tmp_path / "peak.py"
    program.write_text(_PEAK_PROGRAM)
    for mode, (lo, hi) in (("train", (0.7, 1.4)), ("eval", (0.4, 1.7))):
        argv = [sys.executable, str(program), str(cfg), "512", mode]
        proc = warm_python.run(argv, cwd=REPO_ROOT, env=script_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        estimate, peak = map(int, proc.stdout.split())
        assert lo <= estimate / peak <= hi, (mode, estimate, peak)
