"""Where the optimizer's state lives: the implementation training uses on a device (fused on
CUDA), and the state of a resumed run placed as that implementation needs it.

A run trained on the CPU and resumed on a GPU loads state that was saved contiguous, with the
saved groups' flags (``fused=False``), into an optimizer that this run makes fused and whose
parameters are channels_last. ``Optimizer.load_state_dict`` moves each state tensor to its
parameter's device and dtype but keeps the saved strides (``Tensor.to`` preserves them), and it
leaves ``step`` where the *saved* flags want it (on the CPU when they were not fused). The fused
kernels need every state tensor laid out like its parameter and ``step`` on the parameter's
device (pytorch/pytorch#104767, #124133): :func:`place_state_like_params` puts them there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# ``step`` of a fused or capturable group: a float32 tensor on the parameter's device (torch's
# own choice in Optimizer._process_value_according_to_param_policy).
DEVICE_STEP_DTYPE = torch.float32


def uses_fused_optimizer(device: torch.device) -> bool:
    """Whether training on ``device`` uses the fused optimizer implementation.

    CUDA: one kernel for all parameters, and a GradScaler hands it the inf check on the device
    instead of reading it on the host (a sync) every step. The CPU keeps torch's default
    implementation, and with it its numbers.
    """
    return device.type == "cuda"


def place_state_like_params(optimizer: torch.optim.Optimizer) -> int:
    """Give every per-element state tensor (momentum, Adam's moments) its parameter's device,
    dtype and strides, and every ``step`` the place the group's current implementation keeps it:
    on the parameter's device in float32 when the group is fused or capturable, on the CPU
    otherwise. Values are unchanged; tensors already in place are kept as they are.

    Call after ``load_state_dict`` and after the groups' implementation flags (``fused``,
    ``foreach``, ``capturable``) are this run's. Returns how many tensors were moved.
    """
    moved = 0
    for _, _, state, key, value, want in _state_tensors(optimizer):
        if not _is_in_place(value, want):
            state[key] = _place(value, want)
            moved += 1
    return moved


def state_out_of_place(optimizer: torch.optim.Optimizer) -> list[str]:
    """The state tensors :func:`place_state_like_params` would move, one line each (empty when
    every tensor is where this implementation needs it)."""
    return [
        f"group {g} parameter {k} {key}: {value.device} {value.dtype} strides "
        f"{tuple(value.stride())}; wanted {want.device} {want.dtype} strides {want.strides}"
        for g, k, _, key, value, want in _state_tensors(optimizer)
        if not _is_in_place(value, want)
    ]


@dataclass(frozen=True)
class _Placement:
    device: torch.device
    dtype: torch.dtype
    strides: tuple[int, ...] | None  # None: any layout
    like: torch.Tensor | None  # the parameter to copy the layout of


def _state_tensors(
    optimizer: torch.optim.Optimizer,
) -> Iterator[tuple[int, int, dict[str, Any], str, torch.Tensor, _Placement]]:
    """(group index, parameter index, its state, key, tensor, where it belongs) of every state
    tensor."""
    for g, group in enumerate(optimizer.param_groups):
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for k, p in enumerate(group["params"]):
            state = optimizer.state.get(p) or {}
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    yield g, k, state, key, value, _placement(key, value, p, step_on_device)


def _placement(key: str, value: torch.Tensor, p: torch.Tensor, step_on_device: bool) -> _Placement:
    if key == "step":
        if step_on_device:
            return _Placement(p.device, DEVICE_STEP_DTYPE, None, None)
        return _Placement(torch.device("cpu"), value.dtype, None, None)
    if value.shape != p.shape:
        # Not a per-element state: only its device follows the parameter.
        return _Placement(p.device, value.dtype, None, None)
    dtype = p.dtype if value.is_floating_point() else value.dtype
    return _Placement(p.device, dtype, tuple(p.stride()), p)


def _is_in_place(value: torch.Tensor, want: _Placement) -> bool:
    return (
        value.device == want.device
        and value.dtype == want.dtype
        and (want.strides is None or tuple(value.stride()) == want.strides)
    )


def _place(value: torch.Tensor, want: _Placement) -> torch.Tensor:
    if want.like is None:
        return value.to(device=want.device, dtype=want.dtype)
    # empty_like keeps a dense parameter's strides (channels_last included); copy_ converts.
    placed = torch.empty_like(want.like, dtype=want.dtype)
    placed.copy_(value)
    return placed
