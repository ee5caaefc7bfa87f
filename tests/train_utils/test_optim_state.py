"""train_utils/optim.py, the optimizer state of a resumed run: a run trained on the CPU
(contiguous, default optimizer) and resumed where training is fused and channels_last gets every
optimizer state tensor laid out like its parameter and ``step`` where the fused kernel wants it;
the values and the next step are those of the run it continues.

The CPU's fused kernels accept mismatched strides, so the CPU tests assert the precondition the
CUDA kernels need; the ``cuda`` twins take the step on the GPU.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

from train_utils.optim import (
    build_optimizer,
    load_optimizer_state,
    place_state_like_params,
    uses_fused_optimizer,
)

HYP = {"weight_decay": 5e-4, "momentum": 0.9}
LR = 0.01
KINDS = ("sgd", "adam", "adamw")


def make_model() -> nn.Module:
    # An (8, 8, 3, 3) conv weight: contiguous strides (72, 9, 3, 1), channels_last (72, 1, 24, 8).
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3), nn.LeakyReLU(0.1)
    )


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    device = next(model.parameters()).device
    fmt = torch.channels_last if model[0].weight.stride()[1] == 1 else torch.contiguous_format
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.rand(2, 3, 12, 12, generator=gen).to(device).contiguous(memory_format=fmt)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def plain_continuation(kind: str, saved: tuple[dict[str, Any], dict[str, Any]]) -> nn.Module:
    """One more step of the CPU run in its own layout and implementation."""
    model = make_model()
    model.load_state_dict(saved[0])
    optimizer = build_optimizer(model, HYP, LR, kind, fused=False)
    optimizer.load_state_dict(copy.deepcopy(saved[1]))
    train_steps(model, optimizer, 1)
    return model


def cpu_run(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two steps on the CPU as training runs there; the model and optimizer state as a
    checkpoint holds them (saved and loaded back, weights_only)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = build_optimizer(model, HYP, LR, kind, fused=False)
    train_steps(model, optimizer, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, map_location="cpu", weights_only=True)
    return ckpt["model"], ckpt["optimizer"]


def resume(
    kind: str, saved: tuple[dict[str, Any], dict[str, Any]], device: torch.device, fused: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The trainer's resume, as train_utils/trainer.py does it: the model on ``device`` in
    channels_last, this run's optimizer, the saved state loaded, this run's implementation
    flags put back (the saved groups carry the saved run's)."""
    model = make_model()
    model.load_state_dict(saved[0])
    model.to(device=device, memory_format=torch.channels_last)
    optimizer = build_optimizer(model, HYP, LR, kind, fused=fused)
    flags = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
    # A copy, as a checkpoint read gives: load_state_dict keeps tensors already in place.
    optimizer.load_state_dict(copy.deepcopy(saved[1]))
    for group, own in zip(optimizer.param_groups, flags, strict=True):
        group.update(own)
    return model, optimizer


def state_out_of_place(optimizer: torch.optim.Optimizer) -> list[str]:
    """The state tensors not where the fused kernels need them, one line each; the precondition
    of those kernels, checked without the module's own logic."""
    lines = []
    for group in optimizer.param_groups:
        fused = bool(group.get("fused"))
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if key == "step":
                    want = (p.device, torch.float32) if fused else (torch.device("cpu"),)
                    if (value.device, value.dtype)[: len(want)] != want:
                        lines.append(f"step: {value.device} {value.dtype}; wanted {want}")
                    continue
                have = f"{value.device} {value.dtype} strides {tuple(value.stride())}"
                wanted = f"{p.device} {p.dtype} strides {tuple(p.stride())}"
                if have != wanted:
                    lines.append(f"{key}: {have}; wanted {wanted}")
    return lines


def assert_state_like_params(optimizer: torch.optim.Optimizer) -> None:
    out_of_place = state_out_of_place(optimizer)
    assert out_of_place == [], out_of_place


@pytest.mark.parametrize("kind", KINDS)
def test_a_cpu_run_resumed_fused_and_channels_last_gets_its_state_like_its_params(kind):
    saved = cpu_run(kind)
    _, optimizer = resume(kind, saved, torch.device("cpu"), fused=True)
    # What torch's load_state_dict leaves: the saved (contiguous) strides.
    out_of_place = state_out_of_place(optimizer)
    assert any("strides (72, 9, 3, 1); wanted cpu torch.float32 strides (72, 1, 24, 8)" in line
               for line in out_of_place), out_of_place  # fmt: skip
    assert place_state_like_params(optimizer) == len(out_of_place)
    assert_state_like_params(optimizer)
    assert state_out_of_place(optimizer) == [] and place_state_like_params(optimizer) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_placed_state_continues_the_run_it_was_saved_from(kind):
    saved = cpu_run(kind)
    model, optimizer = resume(kind, saved, torch.device("cpu"), fused=True)
    place_state_like_params(optimizer)
    train_steps(model, optimizer, 1)
    plain = plain_continuation(kind, saved)
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_only_on_cuda():
    assert uses_fused_optimizer(torch.device("cuda", 1))
    assert not uses_fused_optimizer(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_a_cpu_run_resumes_fused_on_cuda(kind, monkeypatch):
    # fp32 convolutions proper: with TF32 (cuDNN's default) the CUDA gradients differ from the
    # CPU's by ~1e-3, which is not the optimizer's doing (seen on an H200: adamw 1.4e-5 off).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    saved = cpu_run(kind)
    cuda = torch.device("cuda")
    model, optimizer = resume(kind, saved, cuda, fused=uses_fused_optimizer(cuda))
    place_state_like_params(optimizer)
    assert_state_like_params(optimizer)
    train_steps(model, optimizer, 1)  # the fused CUDA kernel takes the step
    plain = plain_continuation(kind, saved)
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ("adam", "adamw"))
def test_a_fused_cuda_run_resumes_on_the_cpu_with_its_step_on_the_cpu(kind):
    torch.manual_seed(0)
    model = make_model().cuda().to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, HYP, LR, kind, fused=True)
    train_steps(model, optimizer, 2)
    saved = ({k: v.cpu() for k, v in model.state_dict().items()}, optimizer.state_dict())
    cpu_model, cpu_opt = resume(kind, saved, torch.device("cpu"), fused=False)
    place_state_like_params(cpu_opt)
    assert_state_like_params(cpu_opt)
    train_steps(cpu_model, cpu_opt, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_resume_path_lays_the_state_out_like_its_params(kind):
    """optim.load_optimizer_state, what --resume calls: this run's implementation (fused) is
    kept, not the saved groups' (not fused), and every state tensor ends where it wants it."""
    saved = cpu_run(kind)
    model = make_model()
    model.load_state_dict(saved[0])
    model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, HYP, LR, kind, fused=True)
    load_optimizer_state(optimizer, copy.deepcopy(saved[1]))
    assert all(group["fused"] for group in optimizer.param_groups)
    assert_state_like_params(optimizer)
