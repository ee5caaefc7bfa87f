"""Optimizer and learning-rate schedule of the training loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from build_utils.errors import ConfigError

# --optimizer values as stored in a run's config (case-insensitive on the command line; runs
# of older versions stored "sgd"/"adam" in these spellings, so they resume unchanged).
OPTIMIZER_CHOICES = ("sgd", "adam", "adamw")
# --cos-lr / --linear-lr: the per-epoch learning-rate curve (cosine: the lineage's default).
LR_SCHEDULES = ("cosine", "linear")


def build_optimizer(
    model: nn.Module, hyp: Mapping[str, Any], lr0: float, kind: str = "sgd", fused: bool = False
) -> torch.optim.Optimizer:
    """Nesterov SGD, Adam or AdamW with three named groups; BN weights and biases get no weight
    decay, conv weights ``hyp["weight_decay"]``: added to the gradient (L2) for SGD and Adam,
    decoupled from it (``torch.optim.AdamW``, Loshchilov & Hutter) for AdamW.

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
    if kind in ("adam", "adamw"):
        # The group's weight_decay is explicit, so AdamW's own default (0.01) plays no part.
        adam = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return adam(groups, lr=lr0, betas=(hyp["momentum"], 0.999), fused=True if fused else None)
    if kind != "sgd":
        raise ConfigError(f"unknown --optimizer {kind!r}; use {', '.join(OPTIMIZER_CHOICES)}")
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


def linear_lambda(epochs: int | Callable[[], int], lrf: float) -> Callable[[int], float]:
    """YOLOv5's ``--linear-lr`` multiplier ``(1 - x / epochs) * (1 - lrf) + lrf``: straight from
    1 to ``lrf`` over ``epochs`` (read at every step, as :func:`cosine_lambda`), then ``lrf``."""
    total = epochs if callable(epochs) else (lambda: epochs)

    def f(epoch: int) -> float:
        return (1 - min(epoch, total()) / total()) * (1 - lrf) + lrf

    return f


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    epochs: int | Callable[[], int],
    lrf: float,
    schedule: str = "cosine",
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-epoch schedule, cosine (the lineage's) or linear (warm-up is applied per
    iteration on top).

    The multiplier is a closure, not an object, so LambdaLR's ``state_dict`` does not save it:
    a resumed run's schedule follows its own ``--epochs``/plan and its own ``lr_schedule``.
    """
    if schedule not in LR_SCHEDULES:
        raise ConfigError(f"unknown LR schedule {schedule!r}; use {' or '.join(LR_SCHEDULES)}")
    curve = cosine_lambda if schedule == "cosine" else linear_lambda
    return torch.optim.lr_scheduler.LambdaLR(optimizer, curve(epochs, lrf))
