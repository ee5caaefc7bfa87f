"""The precision policy: which autocast dtype ``--amp`` means on a device, and the autocast
context every script computes under (training, evaluation, prediction, timing)."""

from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from build_utils.checks import check_choice
from build_utils.errors import ConfigError

logger = logging.getLogger(__name__)

# --amp values, the same in every script; resolved per device by resolve_amp.
AMP_CHOICES = ("auto", "on", "fp16", "bf16", "off")


# oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA): values that leave
# oneDNN no bf16 convolution at all, and values that leave it no native (non-emulated) one.
_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
_ISAS_WITHOUT_NATIVE_BF16 = _ISAS_WITHOUT_BF16 | {"AVX512_CORE", "AVX512_CORE_VNNI"}


def onednn_isa_cap() -> str | None:
    """The ISA oneDNN was capped at by its environment variable, upper case; None if uncapped."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value and value not in ("ALL", "DEFAULT"):
            return value
    return None


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """True when oneDNN has native bf16 kernels on this CPU (AVX512-BF16 or AMX).

    Without them (e.g. AVX2-only CPUs) a bf16 convolution falls back to ATen's generic
    ``_slow_conv2d`` and a YOLO training step runs many times slower than in fp32
    (``bench/bench_model.py`` measures it), so ``--amp`` would only cost time there.
    """
    if onednn_isa_cap() in _ISAS_WITHOUT_BF16:
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 arithmetic: AVX512-BF16 or AMX on x86 (Cooper Lake,
    Sapphire Rapids and later Xeons; Zen 4 and later), bf16 instructions on Arm (oneDNN's
    check there is the instruction's).

    Stricter than :func:`cpu_bf16_is_fast`: on an AVX-512 CPU without AVX512-BF16 oneDNN
    emulates bf16 (it runs, at about the fp32 speed), which ``--amp`` may ask for but the
    default does not take, since it would change the numbers for no gain. Also False where
    oneDNN is capped below its bf16 kernels (``ONEDNN_MAX_CPU_ISA=AVX2``, say).
    """
    if onednn_isa_cap() in _ISAS_WITHOUT_NATIVE_BF16:
        return False
    cpu = getattr(torch, "cpu", None)
    x86_checks = [
        getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return any(bool(check()) for check in x86_checks if check is not None)
    return cpu_bf16_is_fast()


def cuda_has_native_bf16() -> bool:
    """True when the current CUDA device computes bf16 natively: compute capability 8.0 or
    later (Ampere, Hopper, ...), or ROCm.

    ``torch.cuda.is_bf16_supported()`` alone also says True on a T4 or V100, where a bf16 tensor
    can be made (it counts emulation) but cuDNN has no bf16 convolution; fp16 with a GradScaler
    is the mixed precision of those GPUs. The device is the current one, which
    :func:`~train_utils.distributed.devices.select_device` set.
    """
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


@functools.cache
def _warn_slow_cpu_bf16() -> None:
    logger.warning(
        "--amp: this CPU has no native bf16 kernels (AVX512-BF16/AMX); bf16 autocast "
        "would make training and evaluation many times slower, so they run in fp32"
    )


def resolve_amp(
    mode: str | bool,
    device: torch.device,
    cuda_bf16: bool | None = None,
    cpu_native_bf16: bool | None = None,
) -> torch.dtype | None:
    """The autocast dtype for ``--amp mode`` on ``device``, or None for full precision.

    ``auto`` (the default) is on for CUDA, as users of YOLOv3 repositories expect on a GPU (bf16
    where the GPU computes it natively, :func:`cuda_has_native_bf16`: no GradScaler and no
    overflow; fp16 with a GradScaler otherwise, e.g. on a T4 or V100).
    On a CPU it is bf16 where the CPU has bf16 arithmetic (:func:`cpu_has_native_bf16`; training
    then times both precisions and keeps bf16 only where it is faster, see
    :func:`choose_cpu_amp`) and fp32 elsewhere, where bf16 autocast runs on a generic
    convolution many times slower. bf16 autocast keeps the weights, the optimizer
    and the loss in fp32; bench/README.md "bf16 on the CPU" has the accuracy measurements.
    ``on`` (``--amp`` alone) is ``auto`` plus bf16 on any CPU oneDNN runs bf16 on;
    ``fp16``/``bf16`` force a type, except bf16 on a CPU without oneDNN bf16 kernels
    (:func:`cpu_bf16_is_fast`), which is fp32 with a warning; ``off`` (or False) is full
    precision. ``cuda_bf16`` and
    ``cpu_native_bf16`` default to asking this machine.

    Raises:
        ConfigError: a type the device cannot autocast to.
    """
    if isinstance(mode, bool):
        mode = "on" if mode else "off"
    # A mode may come from a checkpoint's recorded run, which argparse never checked.
    check_choice("--amp", mode, AMP_CHOICES)
    if mode == "off":
        return None
    if device.type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = cuda_has_native_bf16()
        if mode == "bf16" and not cuda_bf16:
            raise ConfigError(
                "--amp bf16: this GPU has no native bf16 support (it needs compute capability "
                "8.0, Ampere, or later); use --amp fp16 or off"
            )
        if mode in ("auto", "on"):
            return torch.bfloat16 if cuda_bf16 else torch.float16
        return torch.bfloat16 if mode == "bf16" else torch.float16
    if mode == "auto":
        native = cpu_has_native_bf16() if cpu_native_bf16 is None else cpu_native_bf16
        return torch.bfloat16 if native else None
    if mode == "fp16":
        raise ConfigError("--amp fp16 needs CUDA; on the CPU use --amp bf16 (or --amp) or off")
    if not cpu_bf16_is_fast():
        # Resolved here, not only in autocast_context, so that checkpoints record fp32, which
        # is what ran, and an evaluation of them on a bf16 CPU replays fp32.
        _warn_slow_cpu_bf16()
        return None
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


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(amp: torch.dtype | None) -> str | None:
    """The autocast dtype as checkpoints and messages between ranks name it (None: fp32)."""
    return _DTYPE_NAMES.get(amp) if amp is not None else None


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """The inverse of :func:`dtype_name`; an unknown name is full precision."""
    return {v: k for k, v in _DTYPE_NAMES.items()}.get(name) if name else None


def precision_record(amp: torch.dtype | None, channels_last: bool) -> dict[str, Any]:
    """How a run computes, as its checkpoints record it (plain types): the autocast dtype's
    name (None: full precision) and whether batches were channels_last."""
    return {"amp": dtype_name(amp), "channels_last": channels_last}


def replay_precision(
    record: Mapping[str, Any],
    run_amp: str | None,
    amp_flag: str | None,
    channels_last_flag: bool | None,
    device: torch.device,
) -> tuple[torch.dtype | None, bool, str]:
    """The autocast dtype and memory format an evaluation of a run's checkpoint uses, and why.

    Flags win. Otherwise the run's own: the dtype its checkpoints record (so that the mAP the
    run logged is reproduced), unless this device cannot autocast to it (fp16 on a CPU, bf16 on
    a GPU older than Ampere), when the run's ``--amp`` mode is resolved for this device instead
    (``auto`` for a mode that forced the type this device lacks); a checkpoint that records no
    dtype (written before it was recorded) resolves the run's ``--amp`` mode (``run_amp``,
    default ``auto``) on this device.
    """
    if amp_flag is not None:
        amp, why = resolve_amp(amp_flag, device), f"--amp {amp_flag}"
    elif "amp" in record:
        name = record["amp"]
        amp = dtype_from_name(name)
        why = f"the run's {name or 'full precision'}"
        if amp is torch.bfloat16 and device.type == "cpu" and not cpu_bf16_is_fast():
            _warn_slow_cpu_bf16()
            amp, why = None, f"{why}, in fp32: this CPU has no bf16 kernels"
        if amp is torch.float16 and device.type != "cuda":
            mode = _mode_for_another_device(run_amp)
            amp = resolve_amp(mode, device)
            why = f"the run's float16 needs CUDA; --amp {mode} on {device.type}"
        if amp is torch.bfloat16 and device.type == "cuda" and not cuda_has_native_bf16():
            mode = _mode_for_another_device(run_amp)
            amp = resolve_amp(mode, device)
            why = f"the run's bfloat16 needs an Ampere or later GPU; --amp {mode} here"
    else:
        amp, why = resolve_amp(run_amp or "auto", device), f"--amp {run_amp or 'auto'}"
    if channels_last_flag is not None:
        channels_last = channels_last_flag
    else:
        channels_last = bool(record.get("channels_last", False))
    return amp, channels_last, why


def half_model_autocast(
    half: bool, amp_flag: str | None, replayed: torch.dtype | None
) -> torch.dtype | None:
    """The autocast dtype of an inference whose model may be float16 (``predict.py --half``):
    ``replayed`` (what :func:`replay_precision` chose) for a float32 model, none for a float16
    one, whose weights and inputs already are the precision. Autocast to bf16 around a float16
    model (a run trained in bf16, replayed) hands BatchNorm bf16 inputs with float16 parameters,
    which CPU and CUDA kernels refuse.

    Raises:
        ConfigError: ``--half`` with ``--amp bf16`` or ``on`` (two precisions asked for at once).
    """
    if not half:
        return replayed
    if amp_flag not in (None, "auto", "off", "fp16"):
        raise ConfigError(
            f"--half runs float16 weights and inputs; --amp {amp_flag} asks for another "
            f"autocast: give one of them"
        )
    return None


def _mode_for_another_device(run_amp: str | None) -> str:
    """The run's ``--amp`` mode to resolve on a device that lacks its recorded dtype: the mode
    itself unless it forced a type (``fp16``/``bf16``, which that device refuses): ``auto``."""
    return run_amp if run_amp in ("auto", "on", "off") else "auto"


@dataclass(frozen=True)
class InferencePrecision:
    """How a run, an evaluation or a prediction computes: ``weights``, the dtype of the model's
    parameters and of its input; ``autocast``, the dtype autocast computes in (None: none);
    ``why``, where that came from (a flag, the run's record)."""

    weights: torch.dtype
    autocast: torch.dtype | None
    why: str

    def describe(self, channels_last: bool) -> str:
        """The log line every script writes: ``precision: bfloat16 autocast (the run's
        bfloat16), contiguous``."""
        if self.weights != torch.float32:
            what = f"{dtype_name(self.weights)} weights and inputs"
        elif self.autocast is not None:
            what = f"{dtype_name(self.autocast)} autocast"
        else:
            what = "full (float32)"
        layout = "channels_last" if channels_last else "contiguous"
        return f"precision: {what} ({self.why}), {layout}"


def inference_precision(
    amp: torch.dtype | None, why: str, half: bool, amp_flag: str | None, device: torch.device
) -> InferencePrecision:
    """What ``predict.py`` and ``validation.py`` compute in: the autocast ``amp`` that
    :func:`replay_precision` chose (``why``: its reason) for a float32 model, or with ``--half``
    float16 weights and inputs and no autocast (:func:`half_model_autocast`, ``amp_flag``: the
    ``--amp`` typed).

    Raises:
        ConfigError: ``--half`` off CUDA, or with an ``--amp`` of another dtype.
    """
    if half and device.type != "cuda":
        raise ConfigError(f"--half needs a CUDA device, not {device}; on CPU use --amp (bf16)")
    autocast = half_model_autocast(half, amp_flag, amp)
    if not half:
        return InferencePrecision(torch.float32, autocast, why)
    replayed = amp_flag is None and amp is not None and amp is not torch.float16
    note = f"; the run's {dtype_name(amp)} autocast is not replayed" if replayed else ""
    return InferencePrecision(torch.float16, None, f"--half{note}")


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


# bf16 may cost accuracy per epoch: at equal epochs it ended lower than fp32, which reached bf16's
# final mAP in fewer epochs (bench/README.md "bf16 on the CPU by default" has the measurements).
# So bf16 wins at equal time only where its step is faster by more than the worst of those ratios.
BF16_MIN_SPEEDUP = 1.35


@dataclass(frozen=True)
class AmpChoice:
    """The CPU precision ``--amp auto`` trains in, and the train-step seconds it was chosen on
    (each precision in the format the run will use with it)."""

    amp: torch.dtype | None
    reason: str
    fp32_s: float | None = None
    bf16_s: float | None = None


def choose_cpu_amp(fp32_s: float, bf16_s: float) -> AmpChoice:
    """bf16 autocast when its train step is at least :data:`BF16_MIN_SPEEDUP` times faster than
    fp32's.

    Even with native bf16 a small model at a small size can lose: its convolutions are too small
    for bf16 to pay back the casts (the timings decide, per model, size, batch and CPU).
    """
    if fp32_s >= BF16_MIN_SPEEDUP * bf16_s:
        return AmpChoice(torch.bfloat16, "bf16 timed faster", fp32_s, bf16_s)
    return AmpChoice(None, f"bf16 not {BF16_MIN_SPEEDUP:.2f}x faster", fp32_s, bf16_s)


def recorded_precision(ckpt: Mapping[str, Any] | None) -> tuple[AmpChoice | None, bool | None]:
    """The CPU precision and the memory format a resumed run trained in, from its checkpoint's
    :func:`precision_record`, so that resuming continues the same computation (the two formats
    round differently too: a resumed run that re-timed and chose the other would not). Each is
    None when not resuming or not recorded (the precision: not as fp32/bf16)."""
    record = (ckpt or {}).get("precision")
    record = record if isinstance(record, dict) else {}
    kept = record.get("channels_last")
    channels_last = kept if isinstance(kept, bool) else None
    if record.get("amp", "") not in (None, "bfloat16"):
        return None, channels_last
    amp = dtype_from_name(record["amp"])
    why = f"the resumed run trained in {'fp32' if amp is None else 'bf16'}"
    return AmpChoice(amp, why), channels_last


def describe_amp(choice: AmpChoice) -> str:
    """One log line: the CPU precision of ``--amp auto`` and the figures behind it."""
    name = "bf16 autocast" if choice.amp is not None else "fp32"
    if choice.fp32_s is None or choice.bf16_s is None:
        return f"precision {name}: {choice.reason}"
    return (
        f"precision {name} (--amp auto on a CPU with native bf16): train step "
        f"{choice.fp32_s * 1000:.0f} ms fp32 vs {choice.bf16_s * 1000:.0f} ms bf16, "
        f"{choice.fp32_s / choice.bf16_s:.2f}x ({choice.reason}; --amp bf16/off force one)"
    )
