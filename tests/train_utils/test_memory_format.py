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
from train_utils.memory_format import (
    cache_key,
    choose_channels_last,
    decide,
    describe,
    time_train_step,
)

CPU = torch.device("cpu")


class Timer:
    """A fake ``measure``: fixed seconds per format, counting its calls."""

    def __init__(self, contiguous_s: float, channels_last_s: float):
        self.times = {False: contiguous_s, True: channels_last_s}
        self.calls: list[bool] = []

    def __call__(self, channels_last: bool) -> float:
        self.calls.append(channels_last)
        return self.times[channels_last]


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
        seconds = time_train_step(model, 64, 2, CPU, channels_last, steps=1)
        assert 0 < seconds < 60
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN statistics included
    assert all(p.grad is None for p in model.parameters())
    assert next(model.parameters()).is_contiguous()
    assert format_model_cfg(blocks)  # the blocks were not consumed
