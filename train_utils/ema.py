"""Exponential moving average of model weights, as the YOLOv3 lineage keeps it.

The decay ramps up with the number of updates (``decay * (1 - exp(-updates / tau))``) so that
the average follows the fast-changing weights of early training and smooths late training.
Buffers (BatchNorm running statistics) are averaged too. ``torch.optim.swa_utils.AveragedModel``
has no ramped decay and renames every key, which would break checkpoint compatibility.
"""

from __future__ import annotations

import math
from copy import deepcopy

import torch
from torch import nn

EMA_DECAY = 0.9999
EMA_TAU = 2000.0


class ModelEMA:
    """EMA of an (unwrapped) model; ``self.ema`` is an eval-mode copy used for evaluation."""

    def __init__(
        self, model: nn.Module, decay: float = EMA_DECAY, tau: float = EMA_TAU, updates: int = 0
    ):
        self.ema = deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.tau = tau
        self.updates = updates

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
