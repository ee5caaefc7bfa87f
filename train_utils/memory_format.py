"""Which memory format a run trains in: channels_last or contiguous (NCHW); and on a CPU with
native bf16, whether ``--amp auto`` trains in bf16 (:func:`choose_cpu_amp`), from the same timings.

On CUDA channels_last is always right (the fast cuDNN kernels are NHWC). On a CPU it depends on
the model: on a 2-core AVX2 CPU the nano cfg trains 1.3x faster in channels_last while YOLOv3-SPP
trains ~0.93x (bench/README.md), so one rule loses somewhere. ``--channels-last`` and
``--no-channels-last`` force a format; otherwise :func:`choose_channels_last` times a few real
train steps (forward, loss-like reduction, backward) of each format on this model, image size
and batch, and keeps the faster. The decision is cached (JSON, keyed by cfg text, size, batch,
threads, precision, CPU model and torch version) so that the next run of the same setting pays
nothing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from build_utils.atomic import atomic_write
from train_utils.distributed.precision import autocast_context

logger = logging.getLogger(__name__)

TIMED_STEPS = 2  # timed train steps per format, after one untimed warm-up step
CACHE_ENV = "YOLO_CACHE_DIR"
CACHE_FILE = "memory_format.json"


@dataclass(frozen=True)
class MemoryFormatChoice:
    """The decision and why: ``contiguous_s``/``channels_last_s`` are seconds per train step
    (None when the format was forced or chosen without timing)."""

    channels_last: bool
    reason: str
    contiguous_s: float | None = None
    channels_last_s: float | None = None


def decide(contiguous_s: float, channels_last_s: float) -> bool:
    """channels_last only when it is strictly faster; a tie keeps the plain layout, which
    needs no conversion of inputs and weights."""
    return channels_last_s < contiguous_s


def cache_path() -> Path:
    """``$YOLO_CACHE_DIR/memory_format.json``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / CACHE_FILE
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "yolov3-spp" / CACHE_FILE


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), or what ``platform`` knows elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(cfg_text: str, img_size: int, batch_size: int, amp: torch.dtype | None) -> str:
    """What the timings depend on; a change of any of these measures afresh."""
    parts = [
        hashlib.sha256(cfg_text.encode()).hexdigest()[:16],
        f"img{img_size}",
        f"batch{batch_size}",
        f"threads{torch.get_num_threads()}",
        str(amp).replace("torch.", "") if amp else "fp32",
        cpu_model(),
        f"torch{torch.__version__}",
    ]
    return "|".join(parts)


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: measure again and rewrite it
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, entry: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        with atomic_write(path, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:  # a read-only home must not stop training
        logger.info("could not cache the memory-format decision in %s: %s", path, e)


def time_train_step(
    model: nn.Module,
    img_size: int,
    batch_size: int,
    device: torch.device,
    channels_last: bool,
    amp: torch.dtype | None = None,
    steps: int = TIMED_STEPS,
) -> float:
    """Fastest of ``steps`` forward+backward passes (after one warm-up) of a copy of ``model``
    in training mode on a random batch, in seconds. The model itself is left untouched."""
    probe = copy.deepcopy(model).to(device).train()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    probe.to(memory_format=fmt)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch_size, 3, img_size, img_size, generator=gen).to(device)
    x = x.contiguous(memory_format=fmt)
    best = float("inf")
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with autocast_context(device, amp):
            out = probe(x)
        # A reduction over every head output stands in for the loss: same backward graph shape.
        loss = sum(o.float().mean() for o in (out if isinstance(out, (list, tuple)) else [out]))
        loss.backward()
        probe.zero_grad(set_to_none=True)
        if i:  # step 0 is the warm-up (oneDNN primitive creation, allocations)
            best = min(best, time.perf_counter() - t0)
    return best


def choose_channels_last(
    forced: bool | None,
    device: torch.device,
    key: str,
    measure: Callable[[bool], float],
    cache: Path | None = None,
) -> MemoryFormatChoice:
    """The memory format for this run.

    Args:
        forced: ``--channels-last`` (True) / ``--no-channels-last`` (False), or None for auto.
        device: where training runs; CUDA always takes channels_last.
        key: :func:`cache_key` of the setting.
        measure: seconds per train step in a format (``True`` = channels_last); called only
            when the cache has no entry for ``key``.
        cache: the JSON cache file, or None to neither read nor write one.
    """
    if forced is not None:
        flag = "--channels-last" if forced else "--no-channels-last"
        return MemoryFormatChoice(forced, f"{flag} given")
    if device.type == "cuda":
        return MemoryFormatChoice(True, "CUDA: NHWC is the layout of the fast cuDNN kernels")
    if cache is not None:
        entry = _read_cache(cache).get(key)
        if isinstance(entry, dict):
            try:
                t_nchw, t_nhwc = float(entry["contiguous_s"]), float(entry["channels_last_s"])
            except (KeyError, TypeError, ValueError):
                pass
            else:
                return MemoryFormatChoice(
                    decide(t_nchw, t_nhwc), f"timed earlier (cache {cache})", t_nchw, t_nhwc
                )
    t_nchw, t_nhwc = measure(False), measure(True)
    if cache is not None:
        _write_cache(cache, key, {"contiguous_s": t_nchw, "channels_last_s": t_nhwc})
    return MemoryFormatChoice(decide(t_nchw, t_nhwc), "timed now", t_nchw, t_nhwc)


# bf16 may cost accuracy per epoch: emulated on the demo recipe over three seeds it ended 0.01-0.05
# mAP@0.5 lower at equal epochs, and fp32 had reached bf16's final mAP in 1/1.16-1/1.35 of the
# epochs (within the seed spread on a harder set; bench/README.md "bf16 on the CPU by default").
# So bf16 wins at equal time only where its step is faster by more than the worst of those.
BF16_MIN_SPEEDUP = 1.35


@dataclass(frozen=True)
class AmpChoice:
    """The CPU precision ``--amp auto`` trains in, and the train-step seconds it was chosen on
    (each precision in the format the run will use with it)."""

    amp: torch.dtype | None
    reason: str
    fp32_s: float | None = None
    bf16_s: float | None = None


def step_seconds(choice: MemoryFormatChoice, forced: bool | None) -> float:
    """The train step time of a timed ``choice`` in the format the run would use: the forced
    one, else the faster."""
    t_nchw, t_nhwc = choice.contiguous_s, choice.channels_last_s
    if t_nchw is None or t_nhwc is None:
        raise ValueError(f"the memory-format choice was not timed: {choice.reason}")
    if forced is None:
        return min(t_nchw, t_nhwc)
    return t_nhwc if forced else t_nchw


def choose_cpu_amp(
    fp32_s: float, bf16_s: float, min_speedup: float = BF16_MIN_SPEEDUP
) -> AmpChoice:
    """bf16 autocast when its train step is at least ``min_speedup`` times faster than fp32's.

    Even with native bf16 a small model at a small size can lose: its convolutions are too small
    for bf16 to pay back the casts (the timings decide, per model, size, batch and CPU).
    """
    if fp32_s >= min_speedup * bf16_s:
        return AmpChoice(torch.bfloat16, "bf16 timed faster", fp32_s, bf16_s)
    return AmpChoice(None, f"bf16 not {min_speedup:.2f}x faster", fp32_s, bf16_s)


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


def describe(choice: MemoryFormatChoice) -> str:
    """One log line: the format and the figures it was chosen on."""
    name = "channels_last" if choice.channels_last else "contiguous (NCHW)"
    if choice.contiguous_s is None or choice.channels_last_s is None:
        return f"memory format {name}: {choice.reason}"
    return (
        f"memory format {name}: train step {choice.contiguous_s * 1000:.0f} ms contiguous vs "
        f"{choice.channels_last_s * 1000:.0f} ms channels_last ({choice.reason}; "
        f"--channels-last/--no-channels-last force one)"
    )
