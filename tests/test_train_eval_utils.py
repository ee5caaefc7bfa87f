"""Tests for train_utils/train_eval_utils.py helpers that need no training run."""

from __future__ import annotations

import logging

import torch

from train_utils import train_eval_utils
from train_utils.train_eval_utils import autocast_context

CPU = torch.device("cpu")


def _forward_dtype(amp: bool) -> torch.dtype:
    conv = torch.nn.Conv2d(3, 4, 1)
    with autocast_context(CPU, amp):
        return conv(torch.zeros(1, 3, 2, 2)).dtype


def test_autocast_is_off_without_amp():
    assert _forward_dtype(False) == torch.float32


def test_cpu_amp_uses_bf16_where_the_cpu_has_native_bf16(monkeypatch):
    monkeypatch.setattr(train_eval_utils, "cpu_bf16_is_fast", lambda: True)
    assert _forward_dtype(True) == torch.bfloat16


def test_cpu_amp_falls_back_to_fp32_with_a_warning_without_native_bf16(monkeypatch, caplog):
    monkeypatch.setattr(train_eval_utils, "cpu_bf16_is_fast", lambda: False)
    train_eval_utils._warn_slow_cpu_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger=train_eval_utils.__name__):
        assert _forward_dtype(True) == torch.float32
        assert _forward_dtype(True) == torch.float32
    warnings = [r for r in caplog.records if "no native bf16" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not per step
