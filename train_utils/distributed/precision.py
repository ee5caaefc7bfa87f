"""The precision policy: which autocast dtype ``--amp`` means on a device, and the autocast
context every script computes under (training, evaluation, prediction, timing)."""

from __future__ import annotations

import functools
import logging
from contextlib import nullcontext
from typing import Any

import torch

from build_utils.errors import ConfigError

logger = logging.getLogger(__name__)


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """True when oneDNN has native bf16 kernels on this CPU (AVX512-BF16 or AMX).

    Without them (e.g. AVX2-only CPUs) a bf16 convolution falls back to ATen's generic
    ``_slow_conv2d`` and a YOLO training step runs about 10x slower than in fp32
    (``bench/bench_model.py`` measures it), so ``--amp`` would only cost time there.
    """
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


@functools.cache
def _warn_slow_cpu_bf16() -> None:
    logger.warning(
        "--amp: this CPU has no native bf16 kernels (AVX512-BF16/AMX); bf16 autocast "
        "would make training and evaluation about 10x slower, so they run in fp32"
    )


def resolve_amp(
    mode: str | bool, device: torch.device, cuda_bf16: bool | None = None
) -> torch.dtype | None:
    """The autocast dtype for ``--amp mode`` on ``device``, or None for full precision.

    ``auto`` (the default) is on for CUDA, as users of this lineage expect on a GPU (bf16 where
    the GPU supports it: no GradScaler and no overflow; fp16 with a GradScaler otherwise), and
    off on CPU, where it would change the numbers (and is slow without native bf16). ``on``
    (``--amp`` alone) is ``auto`` plus bf16 on CPU; ``fp16``/``bf16`` force a type; ``off``
    (or False) is full precision. ``cuda_bf16`` defaults to asking this machine's GPU.

    Raises:
        ConfigError: a type the device cannot autocast to.
    """
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    if mode == "off":
        return None
    if device.type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported()
        if mode == "bf16" and not cuda_bf16:
            raise ConfigError("--amp bf16: this GPU has no bf16 support; use --amp fp16 or off")
        if mode in ("auto", "on"):
            return torch.bfloat16 if cuda_bf16 else torch.float16
        return torch.bfloat16 if mode == "bf16" else torch.float16
    if mode == "auto":
        return None
    if mode == "fp16":
        raise ConfigError("--amp fp16 needs CUDA; on the CPU use --amp bf16 (or --amp) or off")
    return torch.bfloat16


def autocast_context(device: torch.device, amp: bool | torch.dtype | None) -> Any:
    """Autocast to ``amp`` (a dtype from :func:`resolve_amp`; True means fp16 on CUDA, bf16 on
    CPU); a no-op without amp, and on a CPU without native bf16 kernels (with a warning, once):
    see :func:`cpu_bf16_is_fast`."""
    if amp is None or amp is False:
        return nullcontext()
    if device.type == "cpu" and not cpu_bf16_is_fast():
        _warn_slow_cpu_bf16()
        return nullcontext()
    if isinstance(amp, torch.dtype):
        dtype = amp
    else:
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_model_input(
    imgs: torch.Tensor,
    device: torch.device,
    channels_last: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 images ``(bs, 3, h, w)`` (0..255) -> ``dtype`` in [0, 1] on ``device``, in the
    channels_last memory format if asked (the model's own format must match).

    The copy to the device comes first, so only uint8 (a quarter of the float bytes) crosses
    the bus; ``non_blocking`` overlaps it with the host when ``imgs`` is in pinned memory.
    Every script's input goes through here: the same pixels give the same tensor bit for bit
    in training, evaluation, timing and prediction.
    """
    x = imgs.to(device, non_blocking=True).to(dtype).div_(255)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x
