"""Exponential moving average of model weights, as ultralytics/yolov3 keeps it.

The decay ramps up with the number of updates (``decay * (1 - exp(-updates / tau))``) so that
the average follows the fast-changing weights of early training and smooths late training.
Buffers (BatchNorm running statistics) are averaged too. ``torch.optim.swa_utils.AveragedModel``
has no ramped decay and renames every key, which would break checkpoint compatibility.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from train_utils.checkpoint import damaged, is_state_dict, record_int, state_loading, strip_prefixes

EMA_DECAY = 0.9999
EMA_TAU = 2000.0
MAX_UPDATES = 1 << 62


class ModelEMA:
    """EMA of an (unwrapped) model; ``self.ema`` is an eval-mode copy used for evaluation."""

    def __init__(self, model: nn.Module, decay: float = EMA_DECAY, tau: float = EMA_TAU):
        self.ema = deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.tau = tau
        self.updates = 0

    def decay_at(self, updates: int) -> float:
        return self.decay * (1 - math.exp(-updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay_at(self.updates)
        msd = model.state_dict()
        ema_float, model_float = [], []
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                ema_float.append(v)
                model_float.append(msd[k].detach())
        # One fused kernel per dtype group instead of hundreds of small ones.
        torch._foreach_lerp_(ema_float, model_float, 1.0 - d)
        for k, v in self.ema.state_dict().items():
            if not v.dtype.is_floating_point:
                v.copy_(msd[k])

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the average: ``ema`` (its weights) and ``ema_updates``."""
        return {"ema": self.ema.state_dict(), "ema_updates": self.updates}

    @staticmethod
    def check_state(
        ckpt: Mapping[str, Any], model_state: Mapping[str, torch.Tensor], path: str | Path | None
    ) -> None:
        """A checkpoint's EMA (None: the run kept none) has the model's names and shapes."""
        record_int(ckpt, "ema_updates", 0, MAX_UPDATES, path)
        ema = ckpt.get("ema")
        if ema is None:
            return
        if not is_state_dict(ema):
            raise damaged("'ema' is not a state_dict of tensors", path)
        ema = strip_prefixes(ema)
        wrong = [k for k, t in model_state.items() if k not in ema or ema[k].shape != t.shape]
        if wrong or len(ema) != len(model_state):
            name = wrong[0] if wrong else "its keys"
            raise damaged(f"the EMA weights do not fit the model ({name})", path)

    def load_state_dict(
        self, ckpt: Mapping[str, Any], model: nn.Module, path: str | Path | None = None
    ) -> None:
        """Continue a checkpoint's average; without one (a run trained without an EMA) the
        average restarts from ``model``'s (restored) weights."""
        self.check_state(ckpt, model.state_dict(), path)
        if ckpt.get("ema") is None:
            self.ema.load_state_dict(model.state_dict())
            return
        with state_loading("EMA", path):
            self.ema.load_state_dict(strip_prefixes(ckpt["ema"]))
        self.updates = int(ckpt.get("ema_updates") or 0)
