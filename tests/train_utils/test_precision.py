"""train_utils/precision.py: autocast and the --amp resolution per device, the --amp
flag values, and the SyncBatchNorm decision (train_utils/trainer.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from build_utils.errors import ConfigError
from train_utils import precision
from train_utils.precision import autocast_context, resolve_amp, to_model_input

CPU = torch.device("cpu")


def _forward_dtype(amp: bool) -> torch.dtype:
    conv = torch.nn.Conv2d(3, 4, 1)
    with autocast_context(CPU, amp):
        return conv(torch.zeros(1, 3, 2, 2)).dtype


def test_autocast_is_off_without_amp():
    assert _forward_dtype(False) == torch.float32


def test_cpu_amp_uses_bf16_where_the_cpu_has_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    assert _forward_dtype(True) == torch.bfloat16


def test_cpu_amp_falls_back_to_fp32_with_a_warning_without_native_bf16(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: False)
    precision._warn_slow_cpu_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        assert _forward_dtype(True) == torch.float32
        assert _forward_dtype(True) == torch.float32
    warnings = [r for r in caplog.records if "no native bf16" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not per step


CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("mode", "device", "cuda_bf16", "expected"),
    [
        # A CPU without native bf16: off by default, bf16 with --amp where oneDNN runs it.
        ("auto", CPU, None, None),
        ("off", CPU, None, None),
        (False, CPU, None, None),
        ("on", CPU, None, torch.bfloat16),
        (True, CPU, None, torch.bfloat16),
        ("bf16", CPU, None, torch.bfloat16),
        # CUDA: on by default, bf16 where the GPU has it (no GradScaler), else fp16.
        ("auto", CUDA, True, torch.bfloat16),
        ("auto", CUDA, False, torch.float16),
        ("on", CUDA, False, torch.float16),
        ("fp16", CUDA, True, torch.float16),
        ("bf16", CUDA, True, torch.bfloat16),
        ("off", CUDA, True, None),
    ],
)
def test_resolve_amp(mode, device, cuda_bf16, expected, monkeypatch):
    # A CPU without bf16 arithmetic that oneDNN still runs bf16 on (AVX-512 emulation;
    # tests/train_utils/test_cpu_bf16.py has the others).
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    assert resolve_amp(mode, device, cuda_bf16, cpu_native_bf16=False) == expected


@pytest.mark.parametrize("mode", ["on", True, "bf16"])
def test_asked_for_bf16_is_fp32_where_onednn_has_no_bf16_kernels(mode, monkeypatch, caplog):
    """What autocast_context runs there (fp32), so what checkpoints record (an AVX2 CPU)."""
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: False)
    precision._warn_slow_cpu_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger=precision.__name__):
        assert resolve_amp(mode, CPU, cpu_native_bf16=False) is None
    assert any("no native bf16" in r.getMessage() for r in caplog.records)


def test_resolve_amp_refuses_what_the_device_cannot_do():
    with pytest.raises(ConfigError, match="--amp fp16 needs CUDA"):
        resolve_amp("fp16", CPU)
    with pytest.raises(ConfigError, match="no native bf16 support .*; use --amp fp16 or off"):
        resolve_amp("bf16", CUDA, cuda_bf16=False)


# torch.cuda.is_bf16_supported() of a GPU, by whether emulation counts: an A100/H100 computes
# bf16 (sm80+); a T4 (sm75) or V100 (sm70) can hold bf16 tensors but has no bf16 convolution.
AMPERE = {True: True, False: True}
TURING = {True: True, False: False}


def fake_gpu(monkeypatch, answers: dict[bool, bool]) -> list[bool]:
    """This machine's GPU, as torch.cuda.is_bf16_supported answers; records how it was asked."""
    asked: list[bool] = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return answers[including_emulation]

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    return asked


@pytest.mark.parametrize(("gpu", "expected"), [(AMPERE, torch.bfloat16), (TURING, torch.float16)])
def test_auto_is_bf16_only_on_gpus_that_compute_it(monkeypatch, gpu, expected):
    # Was: bf16 on a T4/V100 too (is_bf16_supported() counts emulation).
    asked = fake_gpu(monkeypatch, gpu)
    assert resolve_amp("auto", CUDA) is expected
    assert resolve_amp("on", CUDA) is expected
    assert asked == [False, False]


def test_bf16_asked_for_on_a_turing_gpu_is_one_line(monkeypatch):
    fake_gpu(monkeypatch, TURING)
    with pytest.raises(ConfigError, match="needs compute capability 8.0, Ampere, or later"):
        resolve_amp("bf16", CUDA)


@pytest.mark.parametrize("run_amp", ["auto", "bf16"])
def test_a_bf16_run_replays_in_fp16_on_a_turing_gpu(monkeypatch, run_amp):
    """A checkpoint trained in bf16 on an H100, evaluated on a T4."""
    fake_gpu(monkeypatch, TURING)
    amp, _, why = precision.replay_precision({"amp": "bfloat16"}, run_amp, None, None, CUDA)
    assert amp is torch.float16
    assert why == "the run's bfloat16 needs an Ampere or later GPU; --amp auto here"
    fake_gpu(monkeypatch, AMPERE)
    assert precision.replay_precision({"amp": "bfloat16"}, run_amp, None, None, CUDA)[0] is (
        torch.bfloat16
    )


def test_an_fp16_run_replays_on_the_cpu_whatever_its_amp_flag_said(monkeypatch):
    # Was: a run trained with --amp fp16 could not be evaluated on a CPU ("needs CUDA").
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    amp, _, why = precision.replay_precision({"amp": "float16"}, "fp16", None, None, CPU)
    assert amp is None and why == "the run's float16 needs CUDA; --amp auto on cpu"


@pytest.mark.cuda
def test_auto_on_this_gpu_follows_its_compute_capability():
    major, _ = torch.cuda.get_device_capability()
    native = major >= 8 or torch.version.hip is not None
    assert precision.cuda_has_native_bf16() is native
    assert resolve_amp("auto", CUDA) is (torch.bfloat16 if native else torch.float16)


def test_amp_flag_values():
    from train_utils.config import get_args_parser

    parser = get_args_parser()
    assert parser.parse_args([]).amp == "auto"
    assert parser.parse_args(["--amp"]).amp == "on"
    assert parser.parse_args(["--amp", "fp16"]).amp == "fp16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--amp", "False"])


def test_autocast_to_a_given_dtype(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_is_fast", lambda: True)
    conv = torch.nn.Conv2d(3, 4, 1)
    with autocast_context(CPU, torch.bfloat16):
        assert conv(torch.zeros(1, 3, 2, 2)).dtype == torch.bfloat16
    with autocast_context(CPU, None):
        assert conv(torch.zeros(1, 3, 2, 2)).dtype == torch.float32


@pytest.mark.parametrize("channels_last", [False, True])
def test_model_input_is_the_scaled_float_batch(channels_last):
    imgs = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    imgs[0, 0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    x = to_model_input(imgs, CPU, channels_last)
    expected = imgs.float() / 255
    assert x.dtype == torch.float32 and torch.equal(x, expected)
    assert x[0, 0, 0, :2].tolist() == [0.0, 1.0]
    assert x.is_contiguous(memory_format=torch.channels_last) == channels_last
    half = to_model_input(imgs, CPU, dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, imgs.half().div_(255))


def test_sync_batchnorm_only_on_cuda_without_compile():
    from train_utils.distributed.ddp import use_sync_batchnorm

    assert use_sync_batchnorm(CUDA, False) == (True, "")
    sync, why = use_sync_batchnorm(CUDA, True)
    assert not sync and "pytorch#161302" in why and "--batch-size >= 8 per GPU" in why
    sync, why = use_sync_batchnorm(CPU, False)
    assert not sync and "CUDA modules only" in why
    # Turned off: the flag or the recipe that did it is named, on any device.
    assert use_sync_batchnorm(CUDA, False, False) == (False, "--no-sync-bn")
    assert use_sync_batchnorm(CPU, False, False, "--recipe darknet") == (False, "--recipe darknet")


def _half_conv_bn(device: torch.device) -> torch.nn.Module:
    layers = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    return layers.to(device).eval().half()


def test_a_half_model_runs_without_the_replayed_bf16_autocast():
    """predict.py --half on a checkpoint trained in bf16 (issue 39, item 3): autocast to bf16
    around a float16 model gives BatchNorm bf16 inputs and float16 parameters."""
    model, x = _half_conv_bn(CPU), torch.rand(1, 3, 8, 8, dtype=torch.float16)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="mixed dtype"), bf16:
        model(x)
    amp = precision.half_model_autocast(True, None, torch.bfloat16)
    assert amp is None
    with torch.no_grad(), autocast_context(CPU, amp):
        assert model(x).dtype == torch.float16
    assert precision.half_model_autocast(False, None, torch.bfloat16) is torch.bfloat16


@pytest.mark.parametrize("flag", ["bf16", "on"])
def test_half_with_another_autocast_is_one_line(flag):
    with pytest.raises(ConfigError, match=f"--half runs float16 .*--amp {flag} asks for another"):
        precision.half_model_autocast(True, flag, torch.bfloat16)


@pytest.mark.cuda
def test_a_half_model_runs_on_cuda_without_the_replayed_autocast():
    cuda = torch.device("cuda")
    model, x = _half_conv_bn(cuda), torch.rand(1, 3, 8, 8, device=cuda, dtype=torch.float16)
    with torch.no_grad(), autocast_context(cuda, precision.half_model_autocast(True, None, None)):
        y = model(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()


# ---- --half and the replayed autocast: one decision (predict.py) -------------------------------

CUDA = torch.device("cuda")  # a device object only: the decision needs no GPU
BF16_RUN = "the run's bfloat16"


def test_half_replaces_the_replayed_autocast():
    """Was: predict.py --half made the weights fp16 while autocast replayed the run's bf16, and
    BatchNorm got bf16 input with fp16 parameters (CUDA refuses it). Now --half means fp16
    weights and inputs and no autocast, and says that the run's autocast is not replayed."""
    p = precision.inference_precision(torch.bfloat16, BF16_RUN, True, None, CUDA)
    assert (p.weights, p.autocast) == (torch.float16, None)
    assert p.describe(channels_last=False) == (
        "precision: float16 weights and inputs (--half; the run's bfloat16 autocast is not "
        "replayed), contiguous"
    )
    plain = precision.inference_precision(torch.bfloat16, BF16_RUN, False, None, CUDA)
    assert (plain.weights, plain.autocast) == (torch.float32, torch.bfloat16)
    assert plain.describe(channels_last=True) == (
        "precision: bfloat16 autocast (the run's bfloat16), channels_last"
    )
    fp16 = precision.inference_precision(torch.float16, "--amp fp16", True, "fp16", CUDA)
    assert (fp16.weights, fp16.autocast) == (torch.float16, None)


def test_half_with_another_amp_or_off_cuda_is_one_line():
    with pytest.raises(ConfigError, match="--half runs float16 .*--amp bf16 asks for another"):
        precision.inference_precision(torch.bfloat16, "--amp bf16", True, "bf16", CUDA)
    auto = precision.inference_precision(torch.bfloat16, "--amp auto", True, "auto", CUDA)
    assert (auto.weights, auto.autocast) == (torch.float16, None)
    with pytest.raises(ConfigError, match="--half needs a CUDA device, not cpu"):
        precision.inference_precision(None, "--amp auto", True, None, CPU)
