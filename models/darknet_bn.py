"""BatchNorm as Darknet's CPU build trains it (``src/batchnorm_layer.c``, ``src/blas.c``).

Darknet's training differs from ``torch.nn.BatchNorm2d`` in three ways, all kept here:

- it normalizes with the *unbiased* batch variance (``1 / (n - 1)``, ``variance_cpu``), where
  PyTorch uses the biased one (both keep the unbiased one in the running variance);
- its backward is hand-written and not the exact derivative of that forward: the variance term
  divides by ``n`` and the input term by ``sqrt(var) + 1e-5`` (``normalize_delta_cpu``);
- the CPU build never trains the shift (``beta``; no ``backward_bias`` in
  ``backward_batchnorm_layer``), the GPU build does. ``train_shift`` chooses.

Running statistics move by 0.1 of the batch's (PyTorch's ``momentum=0.1``; the cuDNN build uses
0.01). Evaluation is plain BatchNorm with the running statistics. The module is a
``BatchNorm2d`` with the same parameters and buffers, so checkpoints and ``.weights`` are
unchanged; :func:`use_darknet_batchnorm` swaps it into a model for training as Darknet does.
"""

from __future__ import annotations

import torch
from torch import nn

DARKNET_BN_EPS = 1e-5
DARKNET_BN_MOMENTUM = 0.1  # rolling = 0.9 * rolling + 0.1 * batch (forward_batchnorm_layer)


class _DarknetBatchNorm(torch.autograd.Function):
    """y = gamma * (x - mean) / sqrt(var_unbiased + eps) + beta, Darknet's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, train_shift):
        dims = (0, 2, 3)
        n = x.numel() // x.shape[1]
        mean = x.mean(dims)
        centred = x - mean.view(1, -1, 1, 1)
        var = (centred * centred).sum(dims) / (n - 1)
        x_norm = centred / torch.sqrt(var + eps).view(1, -1, 1, 1)
        ctx.save_for_backward(centred, x_norm, var, weight)
        ctx.mark_non_differentiable(mean, var)
        ctx.eps, ctx.n, ctx.train_shift = eps, n, train_shift
        y = x_norm * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
        return y, mean, var

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        centred, x_norm, var, weight = ctx.saved_tensors
        eps, n, dims = ctx.eps, ctx.n, (0, 2, 3)
        grad_weight = (grad_y * x_norm).sum(dims)
        grad_bias = grad_y.sum(dims) if ctx.train_shift else torch.zeros_like(weight)
        d = grad_y * weight.view(1, -1, 1, 1)
        mean_delta = d.sum(dims) * (-1.0 / torch.sqrt(var + eps))
        var_delta = (d * centred).sum(dims) * (-0.5 * (var + eps) ** -1.5)
        grad_x = (
            d / (torch.sqrt(var) + eps).view(1, -1, 1, 1)
            + var_delta.view(1, -1, 1, 1) * 2 * centred / n
            + mean_delta.view(1, -1, 1, 1) / n
        )
        return grad_x, grad_weight, grad_bias, None, None


class DarknetBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that trains as Darknet's CPU build (module docstring).

    Args:
        train_shift: train ``bias`` (beta) as Darknet's GPU build does; False: as its CPU
            build, which leaves it at its initial value (its gradient is zero).
    """

    def __init__(self, num_features: int, eps: float = DARKNET_BN_EPS, train_shift: bool = True):
        super().__init__(num_features, eps=eps, momentum=DARKNET_BN_MOMENTUM)
        self.train_shift = train_shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        y, mean, var = _DarknetBatchNorm.apply(
            x, self.weight, self.bias, self.eps, self.train_shift
        )
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var, alpha=m)
            self.num_batches_tracked += 1
        return y


def use_darknet_batchnorm(model: nn.Module, train_shift: bool = True) -> int:
    """Replace every ``nn.BatchNorm2d`` of ``model`` by a :class:`DarknetBatchNorm2d` holding
    the same parameters and buffers (same names: checkpoints load either way).

    Returns:
        How many were replaced.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.BatchNorm2d:
                continue
            bn = DarknetBatchNorm2d(child.num_features, eps=child.eps, train_shift=train_shift)
            bn.load_state_dict(child.state_dict())
            bn.to(device=child.weight.device, dtype=child.weight.dtype)
            bn.train(child.training)
            bn.weight.requires_grad_(child.weight.requires_grad)
            bn.bias.requires_grad_(child.bias.requires_grad)
            setattr(parent, name, bn)
            replaced += 1
    return replaced
