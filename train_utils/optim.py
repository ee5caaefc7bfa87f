"""Optimizer and learning-rate schedule of the training loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from build_utils.errors import ConfigError

OPTIMIZER_CHOICES = ("sgd", "adam")


def build_optimizer(
    model: nn.Module, hyp: Mapping[str, Any], lr0: float, kind: str = "sgd", fused: bool = False
) -> torch.optim.Optimizer:
    """Nesterov SGD (or Adam) with three named groups; BN weights and biases get no weight decay.

    Every parameter is included, frozen ones too: they never get a gradient, so the optimizer
    skips them (no update, no weight decay, no state), and the optimizer's layout (its
    ``state_dict``) is the model's whatever ``--freeze-layers`` says, so a run resumed with
    another freeze restores the state of every parameter. The group names let the warm-up treat
    biases apart (``warmup_bias_lr``). ``fused`` (CUDA parameters only) selects the fused
    implementation, whose step GradScaler drives without a host sync.
    """
    bn_weights, conv_weights, biases = [], [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "bias":
                biases.append(p)
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                bn_weights.append(p)
            else:
                conv_weights.append(p)
    groups = [
        {"params": bn_weights, "weight_decay": 0.0, "name": "bn"},
        {"params": conv_weights, "weight_decay": hyp["weight_decay"], "name": "weights"},
        {"params": biases, "weight_decay": 0.0, "name": "bias"},
    ]
    groups = [g for g in groups if g["params"]]
    if kind == "adam":
        return torch.optim.Adam(
            groups, lr=lr0, betas=(hyp["momentum"], 0.999), fused=True if fused else None
        )
    if kind != "sgd":
        raise ConfigError(f"unknown --optimizer {kind!r}; use {' or '.join(OPTIMIZER_CHOICES)}")
    return torch.optim.SGD(
        groups, lr=lr0, momentum=hyp["momentum"], nesterov=True, fused=True if fused else None
    )


def cosine_lambda(epochs: int | Callable[[], int], lrf: float) -> Callable[[int], float]:
    """Cosine decay from 1 to ``lrf`` over ``epochs``, as a LambdaLR multiplier.

    ``epochs`` may be a callable read at every step: a ``--time-budget`` run re-plans its epoch
    count as it goes, and the rest of the curve stretches or shrinks to end at the new count.
    """
    total = epochs if callable(epochs) else (lambda: epochs)

    def f(epoch: int) -> float:
        return ((1 + math.cos(min(epoch, total()) * math.pi / total())) / 2) * (1 - lrf) + lrf

    return f


def build_scheduler(
    optimizer: torch.optim.Optimizer, epochs: int | Callable[[], int], lrf: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lineage's per-epoch cosine schedule (warm-up is applied per iteration on top).

    The multiplier is a closure, not an object, so LambdaLR's ``state_dict`` does not save it:
    a resumed run's schedule follows its own ``--epochs``/plan.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(epochs, lrf))
