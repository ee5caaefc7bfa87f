"""Which memory format a run trains in: channels_last or contiguous (NCHW), from timed train
steps that also give :func:`train_utils.precision.choose_cpu_amp` its figures.

On CUDA channels_last is always right (the fast cuDNN kernels are NHWC). On a CPU it depends on
the model: a small cfg can train faster in channels_last while YOLOv3-SPP trains slower
(bench/README.md "channels_last"), so one rule loses somewhere. ``--channels-last`` and
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
from train_utils.precision import autocast_context

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


def step_seconds(choice: MemoryFormatChoice, forced: bool | None) -> float:
    """The train step time of a timed ``choice`` in the format the run would use: the forced
    one, else the faster."""
    t_nchw, t_nhwc = choice.contiguous_s, choice.channels_last_s
    if t_nchw is None or t_nhwc is None:
        raise ValueError(f"the memory-format choice was not timed: {choice.reason}")
    if forced is None:
        return min(t_nchw, t_nhwc)
    return t_nhwc if forced else t_nchw


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
