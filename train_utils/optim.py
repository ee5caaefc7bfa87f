"""Optimizer and learning-rate schedule of the training loop, and their saved state: what a
checkpoint holds of them is checked here before it is loaded (``--resume``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from build_utils.checks import is_int, is_real
from build_utils.errors import CheckpointError, ConfigError
from train_utils.checkpoint import MAX_EPOCH, bad_value, damaged, state_loading

# --optimizer values as stored in a run's config (case-insensitive on the command line; runs
# of older versions stored "sgd"/"adam" in these spellings, so they resume unchanged).
OPTIMIZER_CHOICES = ("sgd", "adam", "adamw")
# --cos-lr / --linear-lr: the per-epoch learning-rate curve (cosine: ultralytics/yolov3's default).
LR_SCHEDULES = ("cosine", "linear")


def accumulate_steps(nbs: int, batch_size: int, world_size: int, override: int | None) -> int:
    """Batches per optimizer step so that one step sees about ``nbs`` images across all ranks."""
    if override is not None:
        return override
    return max(round(nbs / (batch_size * world_size)), 1)


def scaled_lr0(lr0: float, global_batch: int, nbs: int) -> float:
    """The learning rate scaled up linearly once the global batch exceeds ``nbs`` (as
    ultralytics/yolov3 does)."""
    return lr0 * max(1.0, global_batch / nbs)


def uses_fused_optimizer(device: torch.device) -> bool:
    """Whether training on ``device`` uses the fused optimizer implementation.

    CUDA: one kernel for all parameters, and a GradScaler hands it the inf check on the device
    instead of reading it on the host (a sync) every step. The CPU keeps torch's default
    implementation, and with it its numbers.
    """
    return device.type == "cuda"


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


def lr_lambda(
    epochs: int | Callable[[], int], lrf: float, schedule: str = "cosine"
) -> Callable[[int], float]:
    """The LambdaLR multiplier of ``schedule``: from 1 to ``lrf`` over ``epochs``, then ``lrf``;
    a cosine (ultralytics/yolov3's default) or straight (YOLOv5's ``--linear-lr``,
    ``(1 - x / epochs) * (1 - lrf) + lrf``).

    ``epochs`` may be a callable read at every step: a ``--time-budget`` run re-plans its epoch
    count as it goes, and the rest of the curve stretches or shrinks to end at the new count.
    """
    total = epochs if callable(epochs) else (lambda: epochs)

    def f(epoch: int) -> float:
        if schedule == "cosine":
            return ((1 + math.cos(min(epoch, total()) * math.pi / total())) / 2) * (1 - lrf) + lrf
        return (1 - min(epoch, total()) / total()) * (1 - lrf) + lrf

    return f


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    epochs: int | Callable[[], int],
    lrf: float,
    schedule: str = "cosine",
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-epoch schedule, cosine (ultralytics/yolov3's) or linear (warm-up is applied per
    iteration on top).

    The multiplier is a closure, not an object, so LambdaLR's ``state_dict`` does not save it:
    a resumed run's schedule follows its own ``--epochs``/plan and its own ``lr_schedule``
    (one of :data:`LR_SCHEDULES`, checked by :func:`train_utils.config.build_config`).
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(epochs, lrf, schedule))


# ---- saved state (--resume) ------------------------------------------------------------

_OPTIMIZER_TENSORS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# What an optimizer's saved groups hold besides its parameters tells its kind. AdamW is an Adam
# (a subclass, the same moments) whose groups say ``decoupled_weight_decay: True``; it comes
# first so that the subclass is named. Adam and AdamW are told apart because their weight decay
# means different things: AdamW's state continued as Adam's would change the run silently.
_OPTIMIZER_KINDS = (
    (torch.optim.AdamW, "adamw", "decoupled_weight_decay"),
    (torch.optim.Adam, "adam", "betas"),
    (torch.optim.SGD, "sgd", "nesterov"),
)


def optimizer_kind(optimizer: torch.optim.Optimizer | Mapping[str, Any]) -> str | None:
    """``"sgd"``/``"adam"``/``"adamw"`` for an optimizer or its ``state_dict()`` (by the
    settings its groups carry: AdamW's ``decoupled_weight_decay`` true, Adam's ``betas``, SGD's
    ``nesterov``); None for anything else."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return next((kind for cls, kind, _ in _OPTIMIZER_KINDS if isinstance(optimizer, cls)), None)
    group = (optimizer.get("param_groups") or [{}])[0]
    if group.get("decoupled_weight_decay") is True:  # Adam's groups carry it too, as False
        return "adamw"
    return next((kind for _, kind, key in _OPTIMIZER_KINDS[1:] if key in group), None)


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], path: str | Path | None = None
) -> None:
    """Load a checkpoint's optimizer state into this run's ``optimizer``, or say in one line why
    it cannot continue it.

    The optimizer holds every parameter of the model, frozen or not (:func:`build_optimizer`),
    so its state fits whatever ``--freeze-layers`` the resumed run uses. Checkpoints of older
    versions held only the trainable parameters: their state is put back at the positions of
    this run's trainable parameters when the counts agree (the same freeze as then). ``saved``
    has passed :func:`check_optimizer_state` (``--resume`` checks it before restoring).

    Raises:
        CheckpointError: the state is another kind of optimizer's (SGD momentum cannot become
            Adam moments), or it does not fit this model's parameters.
    """
    weights_hint = f"or start a new run from these weights with --weights {path or 'last.pt'}"
    saved_kind, kind = optimizer_kind(saved), optimizer_kind(optimizer)
    if saved_kind is not None and kind is not None and saved_kind != kind:
        raise CheckpointError(
            f"the checkpoint holds {saved_kind} optimizer state, which --optimizer {kind} cannot "
            f"continue: resume with --optimizer {saved_kind}, {weights_hint}",
            path,
        )
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    saved_groups = saved.get("param_groups") or []
    if [len(g["params"]) for g in saved_groups] != sizes:
        remapped = _state_of_trainable_only(optimizer, saved)
        if remapped is None:
            raise CheckpointError(
                f"the optimizer state holds {sum(len(g['params']) for g in saved_groups)} "
                f"parameters, this model's optimizer {sum(sizes)} (a checkpoint of an older "
                f"version saved with another --freeze-layers): resume with the checkpoint's "
                f"--freeze-layers, {weights_hint}",
                path,
            )
        saved = remapped
    _check_optimizer_fits(optimizer, saved, path)
    # The saved groups carry the saved run's implementation (fused on a GPU); this run's device
    # decides, and the state is laid out as that implementation needs it.
    impl = [
        {k: g.get(k) for k in ("fused", "foreach", "capturable")} for g in optimizer.param_groups
    ]
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"the optimizer state does not fit this model ({e}); {weights_hint}", path
        ) from e
    for group, flags in zip(optimizer.param_groups, impl, strict=True):
        group.update(flags)
    place_state_like_params(optimizer)


def check_optimizer_state(saved: Any, path: str | Path | None = None) -> None:
    """An optimizer ``state_dict`` as ``torch.optim`` writes it: ``state`` (parameter id ->
    dict of tensors and numbers) and ``param_groups`` (dicts with a ``params`` list of ids and
    finite hyperparameters, ``lr >= 0``); every id of ``state`` in some group.

    Raises:
        CheckpointError: one line on the first thing that is not so.
    """
    bad = "the checkpoint's optimizer state is damaged: "
    if not isinstance(saved, Mapping):
        raise CheckpointError(bad + f"a {type(saved).__name__}, not a dict", path)
    for key in ("state", "param_groups"):
        if key not in saved:
            raise CheckpointError(bad + f"no '{key}'", path)
    groups, state = saved["param_groups"], saved["state"]
    if not isinstance(groups, (list, tuple)) or not groups:
        raise CheckpointError(bad + "'param_groups' is not a list of groups", path)
    if not isinstance(state, Mapping):
        raise CheckpointError(bad + f"'state' is a {type(state).__name__}, not a dict", path)
    ids: set[int] = set()
    for n, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
            raise CheckpointError(bad + f"param group {n} has no 'params' list", path)
        if not all(is_int(i) for i in group["params"]):
            raise CheckpointError(bad + f"param group {n} lists parameters by non-integers", path)
        ids.update(group["params"])
        for key, value in group.items():
            if key == "params" or value is None or isinstance(value, (bool, str)):
                continue
            numbers = value if isinstance(value, (list, tuple)) else [value]
            if not all(is_real(v) for v in numbers):
                raise CheckpointError(bad + f"param group {n}: " + bad_value(key, value), path)
        if not (is_real(group.get("lr", 0.0)) and group.get("lr", 0.0) >= 0):
            raise CheckpointError(
                bad + f"param group {n}: " + bad_value("lr", group.get("lr")), path
            )
    for pid, entry in state.items():
        if pid not in ids:
            raise CheckpointError(bad + f"state of parameter {pid!r}, which no group holds", path)
        if not isinstance(entry, Mapping):
            raise CheckpointError(bad + f"parameter {pid}: " + bad_value("state", entry), path)
        for key, value in entry.items():
            ok = (isinstance(value, torch.Tensor) and value.is_floating_point()) or is_real(value)
            if not ok:
                raise CheckpointError(bad + f"parameter {pid}: " + bad_value(key, value), path)


def _check_optimizer_fits(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], path: str | Path | None
) -> None:
    """Each saved state tensor has the shape of the parameter it belongs to (in this run's
    optimizer, by position) and finite values."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    order = [i for g in saved["param_groups"] for i in g["params"]]
    position = {pid: k for k, pid in enumerate(order)}
    bad = "the checkpoint's optimizer state does not fit this model: "
    # A setting this run's optimizer holds as a number must be one there too (and a switch a
    # switch): "momentum: 'fast'" would fail only at the first step.
    for n, (own, old) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        for key, value in old.items():
            mine = own.get(key)
            if key == "params" or mine is None or value is None:
                continue
            if isinstance(mine, bool) != isinstance(value, bool) or (
                is_real(mine) and not is_real(value)
            ):
                raise CheckpointError(bad + f"param group {n}: " + bad_value(key, value), path)
    for pid, entry in saved["state"].items():
        k = position.get(pid)
        if k is None or k >= len(params):
            raise CheckpointError(bad + f"state of parameter {pid}, which it lacks", path)
        shape = tuple(params[k].shape)
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue
            if key in _OPTIMIZER_TENSORS and tuple(value.shape) != shape:
                raise CheckpointError(
                    bad + f"parameter {pid} {key} {tuple(value.shape)} vs the parameter's {shape}",
                    path,
                )
            if not torch.isfinite(value).all():
                raise CheckpointError(bad + f"parameter {pid} {key} holds NaN or inf", path)


def _state_of_trainable_only(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any] | None:
    """An older checkpoint's optimizer state (trainable parameters only) laid out for
    ``optimizer`` (every parameter): saved parameter k of a group goes to the group's k-th
    parameter with ``requires_grad``. None when the groups or their counts disagree."""
    saved_groups = saved.get("param_groups") or []
    if len(saved_groups) != len(optimizer.param_groups):
        return None
    saved_state = saved.get("state") or {}
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    offset = 0
    for own, old in zip(optimizer.param_groups, saved_groups, strict=True):
        if own.get("name") != old.get("name"):
            return None
        trainable = [offset + j for j, p in enumerate(own["params"]) if p.requires_grad]
        if len(trainable) != len(old["params"]):
            return None
        for old_id, new_id in zip(old["params"], trainable, strict=True):
            if old_id in saved_state:
                state[new_id] = saved_state[old_id]
        groups.append({**old, "params": list(range(offset, offset + len(own["params"])))})
        offset += len(own["params"])
    return {"state": state, "param_groups": groups}


def load_scheduler_state(
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    saved: Any,
    optimizer: torch.optim.Optimizer,
    path: str | Path | None = None,
) -> None:
    """Load a checkpoint's scheduler state (its epoch count and base rates: the curve itself is
    this run's, see :func:`build_scheduler`), or say in one line why it cannot be.

    Raises:
        CheckpointError: the state is not a dict, or holds no sane epoch and base rates.
    """
    if not isinstance(saved, Mapping):
        raise damaged(f"'scheduler' is a {type(saved).__name__}, not a Mapping", path)
    with state_loading("scheduler", path):
        scheduler.load_state_dict(saved)
        _check_scheduler(scheduler, optimizer, path)


def load_scaler_state(
    scaler: torch.amp.GradScaler | None, saved: Any, path: str | Path | None = None
) -> None:
    """Continue a checkpoint's fp16 loss scale checked by :func:`check_scaler_state` (``saved``
    None or empty: the run had none)."""
    if saved and scaler is not None:
        with state_loading("AMP scaler", path):
            scaler.load_state_dict(saved)


def check_scaler_state(saved: Any, path: str | Path | None = None) -> None:
    """A saved GradScaler state is a dict whose scale is a positive finite number."""
    if not saved:
        return
    if not isinstance(saved, Mapping):
        raise damaged(f"'scaler' is a {type(saved).__name__}", path)
    scale = saved.get("scale")
    if scale is not None and not (is_real(scale) and scale > 0):
        raise damaged(bad_value("the AMP scale", scale), path)


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, path: Any) -> None:
    """The restored scheduler's epoch and base learning rates are sane numbers, one per group."""
    bad = "the checkpoint's scheduler state is damaged: "
    last = getattr(scheduler, "last_epoch", -1)
    if not is_int(last) or not -1 <= last <= MAX_EPOCH:
        raise CheckpointError(bad + bad_value("last_epoch", last), path)
    base = getattr(scheduler, "base_lrs", None)
    if base is not None and (
        len(base) != len(optimizer.param_groups) or not all(is_real(v) and v >= 0 for v in base)
    ):
        raise CheckpointError(bad + bad_value("base_lrs", base), path)


# ``step`` of a fused or capturable group: a float32 tensor on the parameter's device (torch's
# own choice in Optimizer._process_value_according_to_param_policy).
DEVICE_STEP_DTYPE = torch.float32


def place_state_like_params(optimizer: torch.optim.Optimizer) -> int:
    """Give every per-element state tensor (momentum, Adam's moments) its parameter's device,
    dtype and strides, and every ``step`` the place the group's current implementation keeps it:
    on the parameter's device in float32 when the group is fused or capturable, on the CPU
    otherwise. Values are unchanged; tensors already in place are kept as they are.

    Call after ``load_state_dict`` and after the groups' implementation flags (``fused``,
    ``foreach``, ``capturable``) are this run's. Returns how many tensors were moved.
    """
    moved = 0
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    placed = _placed(key, value, p, step_on_device)
                    if placed is not value:
                        state[key] = placed
                        moved += 1
    return moved


def _placed(key: str, value: torch.Tensor, p: torch.Tensor, step_on_device: bool) -> torch.Tensor:
    """State tensor ``value`` of parameter ``p`` where it belongs: ``value`` itself when it is
    there already (``Tensor.to`` returns itself then), else a copy."""
    if key == "step":
        if step_on_device:
            return value.to(device=p.device, dtype=DEVICE_STEP_DTYPE)
        return value.to(device="cpu")
    if value.shape != p.shape:
        # Not a per-element state: only its device follows the parameter.
        return value.to(device=p.device)
    dtype = p.dtype if value.is_floating_point() else value.dtype
    if value.device == p.device and value.dtype == dtype and value.stride() == p.stride():
        return value
    # empty_like keeps a dense parameter's strides (channels_last included); copy_ converts.
    return torch.empty_like(p, dtype=dtype).copy_(value)
