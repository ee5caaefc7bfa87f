"""Tests for train_utils/memory_format.py: the automatic channels_last decision is a pure
function of its timings, the flags and CUDA bypass it, the cache spares a second timing, and
the timing probe leaves the model as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from build_utils.parse_config import format_model_cfg
from models.darknet import Darknet, model_blocks_for
from train_utils import memory_format
from train_utils.memory_format import (
    StepTiming,
    cache_key,
    choose_channels_last,
    decide,
    describe,
    time_train_step,
)
from train_utils.precision import choose_cpu_amp

CPU = torch.device("cpu")


class Timer:
    """A fake ``measure``: fixed seconds per format (their steps spreading by ``spread``),
    counting its calls."""

    def __init__(self, contiguous_s: float, channels_last_s: float, spread: float = 0.1):
        self.times = {False: contiguous_s, True: channels_last_s}
        self.spread = spread
        self.calls: list[bool] = []

    def __call__(self, channels_last: bool) -> StepTiming:
        self.calls.append(channels_last)
        return StepTiming(self.times[channels_last], self.spread, 5)


def test_the_faster_format_wins_and_a_tie_stays_contiguous() -> None:
    assert decide(1.0, 0.9) is True
    assert decide(0.9, 1.0) is False
    assert decide(1.0, 1.0) is False
    for t_nchw, t_nhwc in ((0.31, 0.30), (0.30, 0.31), (2.0, 2.0)):
        timer = Timer(t_nchw, t_nhwc)
        choice = choose_channels_last(None, CPU, "k", timer)
        assert choice.channels_last is decide(t_nchw, t_nhwc)
        assert (choice.contiguous_s, choice.channels_last_s) == (t_nchw, t_nhwc)
        assert sorted(timer.calls) == [False, True]
        assert "train step" in describe(choice)


@pytest.mark.parametrize("forced", [True, False])
def test_the_flags_bypass_timing(forced: bool, tmp_path: Path) -> None:
    timer = Timer(1.0, 2.0)
    choice = choose_channels_last(forced, CPU, "k", timer, tmp_path / "c.json")
    assert choice.channels_last is forced and timer.calls == []
    assert not (tmp_path / "c.json").exists()
    assert "given" in describe(choice)


def test_cuda_takes_channels_last_without_timing() -> None:
    timer = Timer(0.1, 9.9)
    assert choose_channels_last(None, torch.device("cuda", 0), "k", timer).channels_last
    assert timer.calls == []


def test_the_cache_spares_the_second_timing(tmp_path: Path) -> None:
    cache = tmp_path / "sub" / "memory_format.json"
    first = Timer(1.0, 0.5)
    assert choose_channels_last(None, CPU, "a", first, cache).channels_last
    assert len(first.calls) == 2
    # Same key: the cached figures decide, even if timing now would say otherwise.
    again = Timer(0.5, 1.0)
    choice = choose_channels_last(None, CPU, "a", again, cache)
    assert choice.channels_last and again.calls == [] and "cache" in choice.reason
    # Another key is timed and stored beside the first.
    other = Timer(0.5, 1.0)
    assert not choose_channels_last(None, CPU, "b", other, cache).channels_last
    assert len(other.calls) == 2
    assert set(json.loads(cache.read_text())) == {"a", "b"}
    # A damaged cache is measured over and rewritten.
    cache.write_text("{not json")
    damaged = Timer(1.0, 0.5)
    assert choose_channels_last(None, CPU, "a", damaged, cache).channels_last
    assert len(damaged.calls) == 2 and "a" in json.loads(cache.read_text())


def test_a_noisy_timing_decides_its_run_but_is_not_cached(tmp_path: Path) -> None:
    """A busy machine's figures (the tester's: 466 ms fp32 vs 285 ms bf16, spread 846%) choose
    this run's format only; the next run times again, and its steady figures are cached."""
    cache = tmp_path / "memory_format.json"
    busy = Timer(0.466, 0.5, spread=8.46)
    choice = choose_channels_last(None, CPU, "a", busy, cache)
    assert not choice.channels_last and len(busy.calls) == 2
    assert choice.reason == "timed now on a busy machine: not cached, the next run times again"
    assert not cache.exists()
    quiet = Timer(0.101, 0.066)
    assert choose_channels_last(None, CPU, "a", quiet, cache).channels_last
    assert len(quiet.calls) == 2
    entry = json.loads(cache.read_text())["a"]
    assert entry == {"contiguous_s": 0.101, "channels_last_s": 0.066, "spread": 0.1}
    cached = choose_channels_last(None, CPU, "a", Timer(9.0, 9.0), cache)
    assert cached.channels_last and "cache" in cached.reason
    # An entry cached before the spread was recorded may be noisy: timed again.
    cache.write_text(json.dumps({"a": {"contiguous_s": 0.466, "channels_last_s": 0.5}}))
    again = Timer(0.101, 0.066)
    assert choose_channels_last(None, CPU, "a", again, cache).channels_last
    assert len(again.calls) == 2 and json.loads(cache.read_text())["a"]["spread"] == 0.1


def test_cache_key_names_what_the_timing_depends_on() -> None:
    key = cache_key("[net]\n", 320, 4, None)
    assert "img320" in key and "batch4" in key and "fp32" in key
    assert f"threads{torch.get_num_threads()}" in key and torch.__version__ in key
    assert cache_key("[net]\n", 320, 4, torch.bfloat16) != key
    assert cache_key("[net]\nwidth=1\n", 320, 4, None) != key


def test_timing_probe_leaves_the_model_alone(repo_root, single_thread) -> None:
    blocks = model_blocks_for(repo_root / "cfg" / "yolov3-spp-nano.cfg", 3)
    model = Darknet(blocks, img_size=(64, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for channels_last in (False, True):
        seconds = time_train_step(model, 64, 2, CPU, channels_last, steps=1).seconds
        assert 0 < seconds < 60
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN statistics included
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).is_contiguous()
    assert format_model_cfg(blocks)  # the blocks were not consumed


class ScriptedSteps:
    """Stands in for ``memory_format._timed_step``: the seconds of each step of each variant
    (channels_last, amp) in turn, the calls recorded in order."""

    def __init__(self, script: dict) -> None:
        self.script = {v: iter(times) for v, times in script.items()}
        self.calls: list = []

    def __call__(self, probe, x, device, amp) -> float:
        variant = (not x.is_contiguous(), amp)
        self.calls.append(variant)
        return next(self.script[variant])


def test_one_slow_step_cannot_decide_the_precision(monkeypatch, repo_root) -> None:
    """The probe of two demo runs minutes apart: fp32 hit by a 5 s stall once. The median of
    interleaved steps still compares the steady times (here 1.28x: fp32 kept); the old probe
    took the fastest of two steps per variant, one after the other, and flipped with load."""
    model = Darknet(model_blocks_for(repo_root / "cfg" / "yolov3-spp-nano.cfg", 3), img_size=64)
    bf16 = torch.bfloat16
    steady = {
        (False, None): [0.05, 5.143, 0.05, 0.051, 0.049] + [0.05] * 11,  # warm-up first
        (True, None): [0.06] * 16,
        (False, bf16): [0.039] * 16,
        (True, bf16): [0.041] * 16,
    }
    fake = ScriptedSteps(steady)
    monkeypatch.setattr(memory_format, "_timed_step", fake)
    monkeypatch.setattr(memory_format, "cache_path", lambda: None)
    variants = list(steady)
    timings = memory_format.time_variants(model, 64, 2, CPU, variants, rounds=5, max_rounds=15)
    assert timings[(False, None)].seconds == 0.05 and timings[(False, bf16)].seconds == 0.039
    # Interleaved: every round times each variant once, after one warm-up step each.
    assert fake.calls[:8] == variants + variants
    # The stall spread fp32's first five steps: ten more of each variant were timed.
    assert timings[(False, None)].steps == 15 and len(fake.calls) == 4 + 4 * 15
    ratio = timings[(False, None)].seconds / timings[(False, bf16)].seconds
    assert choose_cpu_amp(0.05, 0.039).amp is None and ratio < 1.35  # fp32 kept


def test_a_busy_machine_is_timed_longer_and_said_so(monkeypatch, repo_root) -> None:
    model = Darknet(model_blocks_for(repo_root / "cfg" / "yolov3-spp-nano.cfg", 3), img_size=64)
    noisy = [0.1, 0.1, 0.3, 0.1, 0.1, 0.1] + [0.1] * 10  # spread 200% in the first five
    fake = ScriptedSteps({(False, None): noisy})
    monkeypatch.setattr(memory_format, "_timed_step", fake)
    timings = memory_format.time_variants(model, 64, 2, CPU, [(False, None)], 5, 15)
    assert len(fake.calls) == 1 + 15 and timings[(False, None)].steps == 15
    assert timings[(False, None)].seconds == 0.1
    line = memory_format.describe_timings(timings)
    assert line == (
        "timed 1 train-step variants, 15 interleaved steps each: medians compared, spread up to "
        "200% (noisy: the machine was busy)"
    )


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == memory_format.__name__]


class FakeClock:
    """``time.monotonic`` for :func:`memory_format.time_variants`: it moves only by the
    seconds of the (scripted) steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_timing_stops_at_its_cap_and_says_so(monkeypatch, repo_root, caplog) -> None:
    """A big model on a busy CPU (the tester's yolov3-spp at 320 px: still timing after 140 s):
    no round starts after the cap; the rounds done decide, and a single step is not cached."""
    model = Darknet(model_blocks_for(repo_root / "cfg" / "yolov3-spp-nano.cfg", 3), img_size=64)
    clock = FakeClock()
    variants = [(False, None), (True, None)]
    fake = ScriptedSteps({v: [9.0, 9.0, 3.0, 9.0, 9.0] for v in variants})

    def step(*args) -> float:
        seconds = fake(*args)
        clock.now += seconds
        return seconds

    monkeypatch.setattr(memory_format, "_timed_step", step)
    with caplog.at_level("INFO", logger=memory_format.__name__):
        timings = memory_format.time_variants(model, 64, 2, CPU, variants, 5, 15, 30.0, clock)
    # Warm-up (18 s) and one round (36 s) pass the 30 s cap: nothing more is timed.
    assert len(fake.calls) == 4 and clock.now == 36.0
    assert timings[(False, None)] == memory_format.StepTiming(9.0, 0.0, 1)
    assert not timings[(False, None)].steady
    assert _lines(caplog) == [
        "timing stopped at its 30 s cap after 1 step(s) of each variant: decided from them"
    ]
    assert memory_format.describe_timings(timings).endswith("(one step each: not cached)")

    # Noisy rounds are re-timed only until the cap: two rounds here, not fifteen.
    caplog.clear()
    noisy = ScriptedSteps({v: [1.0, 1.0, 3.0, 1.0, 1.0, 1.0] + [1.0] * 10 for v in variants})

    def noisy_step(*args) -> float:
        clock.now += 1.0
        return noisy(*args)

    monkeypatch.setattr(memory_format, "_timed_step", noisy_step)
    clock.now = 0.0
    with caplog.at_level("INFO", logger=memory_format.__name__):
        timings = memory_format.time_variants(model, 64, 2, CPU, variants, 5, 15, 12.0, clock)
    assert timings[(False, None)].steps == 5 and clock.now == 12.0
    assert "after 5 step(s)" in _lines(caplog)[0]


def test_a_one_step_timing_is_used_but_not_cached(tmp_path: Path) -> None:
    class OneStep(Timer):
        def __call__(self, channels_last: bool) -> StepTiming:
            return StepTiming(self.times[channels_last], 0.0, 1)

    cache = tmp_path / "memory_format.json"
    choice = choose_channels_last(None, CPU, "a", OneStep(2.0, 1.0), cache)
    assert choice.channels_last and not cache.exists()
    assert choice.reason == "timed now in one step each: not cached, the next run times again"
