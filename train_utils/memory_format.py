"""Which memory format a run trains in: channels_last or contiguous (NCHW), from timed train
steps that also give :func:`train_utils.precision.choose_cpu_amp` its figures.

On CUDA channels_last is always right (the fast cuDNN kernels are NHWC). On a CPU it depends on
the model: a small cfg can train faster in channels_last while YOLOv3-SPP trains slower
(bench/README.md "channels_last"), so one rule loses somewhere. ``--channels-last`` and
``--no-channels-last`` force a format; otherwise :func:`choose_channels_last` times a few real
train steps (forward, loss-like reduction, backward) of each format on this model, image size
and batch, and keeps the faster. The decision is cached (JSON, keyed by cfg text, size, batch,
threads, precision, CPU model and torch version) so that the next run of the same setting pays
nothing; a noisy timing (a busy machine) decides its own run only, and the next run times again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from build_utils.atomic import atomic_write
from train_utils.precision import (
    AmpChoice,
    InferencePrecision,
    autocast_context,
    choose_cpu_amp,
    describe_amp,
)

logger = logging.getLogger(__name__)

ROUNDS = 5  # timed train steps per variant, interleaved, after one untimed warm-up step
MAX_ROUNDS = 15  # steps per variant at most, while the machine is too busy to time it
# A variant's steps spreading by more than this fraction of their median: time more of them.
NOISY_SPREAD = 0.5
# Seconds of timing (warm-up included) after which no further round starts: a big model on a
# busy CPU is decided from the rounds done by then (at least one), and they are not cached
# unless steady. The flags that force a format and precision skip the timing altogether.
TIMING_CAP_S = 30.0
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


# (channels_last, autocast dtype or None): one way a train step can run.
Variant = tuple[bool, torch.dtype | None]


@dataclass(frozen=True)
class StepTiming:
    """A variant's train-step time: the median of its timed steps, their spread
    ((slowest - fastest) / median) and how many there were."""

    seconds: float
    spread: float
    steps: int

    @property
    def steady(self) -> bool:
        """Whether the steps agreed well enough (:data:`NOISY_SPREAD`) to be cached; one step
        alone (cut short by :data:`TIMING_CAP_S`) cannot tell."""
        return self.steps >= 2 and self.spread <= NOISY_SPREAD


def time_variants(
    model: nn.Module,
    img_size: int,
    batch_size: int,
    device: torch.device,
    variants: Sequence[Variant],
    rounds: int = ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    cap_s: float = TIMING_CAP_S,
    clock: Callable[[], float] = time.monotonic,
) -> dict[Variant, StepTiming]:
    """Time forward+backward passes of copies of ``model`` (training mode, a random batch) in
    each of ``variants``, interleaved: round after round, one step of each variant, so that a
    burst of load from another process falls on all of them alike. After one untimed warm-up
    step each, ``rounds`` rounds; while some variant's steps spread by more than
    :data:`NOISY_SPREAD` of their median (a busy machine), ``rounds`` more, up to
    ``max_rounds`` in all. No round starts once ``cap_s`` seconds (of ``clock``) have passed
    since the start: the timings are then those of the rounds done, at least one, and a line
    says so. Each variant's time is the median of its steps, which one slow step cannot move.
    The model itself is left untouched."""
    start = clock()
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch_size, 3, img_size, img_size, generator=gen).to(device)
    formats = {cl for cl, _ in variants}
    fmt = {cl: torch.channels_last if cl else torch.contiguous_format for cl in formats}
    probes = {
        cl: copy.deepcopy(model).to(device).train().to(memory_format=fmt[cl]) for cl in formats
    }
    inputs = {cl: x.contiguous(memory_format=fmt[cl]) for cl in formats}
    for cl, amp in variants:  # oneDNN primitive creation, allocations
        _timed_step(probes[cl], inputs[cl], device, amp)
    samples: dict[Variant, list[float]] = {v: [] for v in variants}
    while True:
        for _ in range(rounds):
            for cl, amp in variants:
                samples[(cl, amp)].append(_timed_step(probes[cl], inputs[cl], device, amp))
            capped = clock() - start >= cap_s
            if capped:
                break
        timings = {v: _summary(times) for v, times in samples.items()}
        steps = len(samples[variants[0]])
        if capped and steps < max_rounds:
            logger.info(
                "timing stopped at its %.0f s cap after %d step(s) of each variant: decided "
                "from them",
                cap_s,
                steps,
            )
            return timings
        if steps >= max_rounds or all(t.steady for t in timings.values()):
            return timings


def _timed_step(probe: nn.Module, x: torch.Tensor, device: torch.device, amp: Any) -> float:
    t0 = time.perf_counter()
    with autocast_context(device, amp):
        out = probe(x)
    # A reduction over every head output stands in for the loss: same backward graph shape.
    loss = sum(o.float().mean() for o in (out if isinstance(out, (list, tuple)) else [out]))
    loss.backward()
    probe.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _summary(times: Sequence[float]) -> StepTiming:
    median = statistics.median(times)
    return StepTiming(median, (max(times) - min(times)) / median, len(times))


def time_train_step(
    model: nn.Module,
    img_size: int,
    batch_size: int,
    device: torch.device,
    channels_last: bool,
    steps: int = ROUNDS,
) -> StepTiming:
    """``steps`` fp32 train steps in one format (see :func:`time_variants`)."""
    variant = (channels_last, None)
    return time_variants(model, img_size, batch_size, device, [variant], steps, steps)[variant]


def choose_channels_last(
    forced: bool | None,
    device: torch.device,
    key: str,
    measure: Callable[[bool], StepTiming],
    cache: Path | None = None,
) -> MemoryFormatChoice:
    """The memory format for this run.

    Args:
        forced: ``--channels-last`` (True) / ``--no-channels-last`` (False), or None for auto.
        device: where training runs; CUDA always takes channels_last.
        key: :func:`cache_key` of the setting.
        measure: the train step's timing in a format (``True`` = channels_last); called only
            when the cache has no steady entry for ``key``. A noisy timing decides this run
            but is not cached: the next run times again.
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
                # Entries without a spread predate the check: possibly noisy, timed again.
                cached = float(entry["spread"]) <= NOISY_SPREAD
            except (KeyError, TypeError, ValueError):
                cached = False
            if cached:
                return MemoryFormatChoice(
                    decide(t_nchw, t_nhwc), f"timed earlier (cache {cache})", t_nchw, t_nhwc
                )
    nchw, nhwc = measure(False), measure(True)
    t_nchw, t_nhwc = nchw.seconds, nhwc.seconds
    reason = "timed now"
    if not (nchw.steady and nhwc.steady):
        why = "on a busy machine" if min(nchw.steps, nhwc.steps) > 1 else "in one step each"
        reason = f"timed now {why}: not cached, the next run times again"
    elif cache is not None:
        spread = max(nchw.spread, nhwc.spread)
        entry = {"contiguous_s": t_nchw, "channels_last_s": t_nhwc, "spread": spread}
        _write_cache(cache, key, entry)
    return MemoryFormatChoice(decide(t_nchw, t_nhwc), reason, t_nchw, t_nhwc)


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


def choose_format_and_precision(
    model: nn.Module,
    img_size: int,
    batch_size: int,
    device: torch.device,
    amp: torch.dtype | None,
    amp_mode: str,
    forced: bool | None,
    cfg_text: str,
    recorded: AmpChoice | None = None,
    recorded_format: bool | None = None,
) -> tuple[bool, torch.dtype | None]:
    """Whether a run trains in channels_last, and in which autocast dtype (rank 0 decides).

    The format is forced by the flags (``forced``), always channels_last on CUDA, and otherwise
    the faster for this model, size and batch, timed (or cached). Where ``--amp auto``
    (``amp_mode``) resolved to bf16 on a CPU, fp32 is timed too and bf16 kept only when clearly
    faster (:func:`train_utils.precision.choose_cpu_amp`), unless a resumed run's ``recorded``
    precision decides; on a CPU a resumed run's ``recorded_format`` decides the format unless
    a flag forces one. Every variant the decision may need is timed in one interleaved
    measurement (:func:`time_variants`), the first time one is needed. The precision is one
    log line whichever way it was decided.
    """
    cpu_auto_bf16 = amp_mode == "auto" and device.type == "cpu" and amp == torch.bfloat16
    said = cpu_auto_bf16  # the timed choice or the resumed run's: describe_amp's line
    if cpu_auto_bf16 and recorded is not None:
        amp, cpu_auto_bf16 = recorded.amp, False
        logger.info(describe_amp(recorded))
    dtypes = [None, torch.bfloat16] if cpu_auto_bf16 else [amp]
    variants = [(cl, dtype) for dtype in dtypes for cl in (False, True)]
    timings: dict[Variant, StepTiming] = {}

    def measure_in(dtype: torch.dtype | None) -> Callable[[bool], StepTiming]:
        def measure(channels_last: bool) -> StepTiming:
            if not timings:
                logger.info(
                    "timing %scontiguous vs channels_last train steps at %d px, batch %d: two "
                    "steps of each at least, no new round after %.0f s (cached for later runs "
                    "of this setting)",
                    "fp32 vs bf16 autocast, " if cpu_auto_bf16 else "",
                    img_size,
                    batch_size,
                    TIMING_CAP_S,
                )
                # The probe's forward passes must not move the run's random streams.
                with torch.random.fork_rng(devices=[]):
                    timings.update(time_variants(model, img_size, batch_size, device, variants))
                logger.info(describe_timings(timings))
            return timings[(channels_last, dtype)]

        return measure

    def format_in(dtype: torch.dtype | None, forced: bool | None) -> MemoryFormatChoice:
        if forced is None and recorded_format is not None and device.type == "cpu":
            return MemoryFormatChoice(recorded_format, "the resumed run trained so")
        key = cache_key(cfg_text, img_size, batch_size, dtype)
        return choose_channels_last(forced, device, key, measure_in(dtype), cache_path())

    choice = None
    if cpu_auto_bf16:
        formats = {dtype: format_in(dtype, None) for dtype in dtypes}
        amp_choice = choose_cpu_amp(
            step_seconds(formats[None], forced), step_seconds(formats[torch.bfloat16], forced)
        )
        amp = amp_choice.amp
        logger.info(describe_amp(amp_choice))
        choice = formats[amp] if forced is None else None  # timed above: not twice
    if choice is None:
        choice = format_in(amp, forced)
    if not said:
        why = f"--amp {amp_mode}"
        logger.info(InferencePrecision(torch.float32, amp, why).describe(choice.channels_last))
    logger.info(describe(choice))
    return choice.channels_last, amp


def describe_timings(timings: dict[Variant, StepTiming]) -> str:
    """One log line: how the train step was timed and how steady the timings were."""
    steps = max(t.steps for t in timings.values())
    spread = max(t.spread for t in timings.values())
    if all(t.steady for t in timings.values()):
        steady = "steady"
    elif steps < 2:
        steady = "one step each: not cached"
    else:
        steady = "noisy: the machine was busy"
    return (
        f"timed {len(timings)} train-step variants, {steps} interleaved steps each: medians "
        f"compared, spread up to {spread:.0%} ({steady})"
    )
