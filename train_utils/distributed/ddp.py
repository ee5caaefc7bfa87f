"""The model as DDP trains it: DistributedDataParallel under a process group (SyncBatchNorm on
CUDA unless ``--no-sync-bn``), then ``torch.compile`` when asked.

SyncBatchNorm is on by default under CUDA DDP, because this project's default batch per GPU is
small (4) and BatchNorm statistics of a few images are noisy; it costs a small all-reduce at
every BatchNorm layer in each forward and backward, so ``--no-sync-bn`` turns it off for large
per-GPU batches (YOLOv5 has it off unless ``--sync-bn``; both flags are accepted). With it every
rank computes the same running statistics, so DDP does not copy rank 0's buffers at each forward
(``broadcast_buffers``); without it, it does, and the saved and evaluated statistics are rank
0's. ``gradient_as_bucket_view`` stays off: with ``zero_grad(set_to_none=True)`` it saves little.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from train_utils.distributed.process_group import DistInfo

logger = logging.getLogger(__name__)


def use_sync_batchnorm(
    device: torch.device, compile_model: bool, wanted: bool = True, off: str = "--no-sync-bn"
) -> tuple[bool, str]:
    """Whether DDP training converts BatchNorm to SyncBatchNorm (``wanted``: ``--sync-bn``; else
    ``off`` says what turned it off), and if not, why.

    SyncBatchNorm supports CUDA only. Under ``torch.compile`` it graph-breaks at every layer or
    fails to compile (pytorch#161302, #107372, #156680), while compile + DDP with plain BatchNorm
    works: with ``--compile`` the safe combination is DDP + compile + per-GPU BatchNorm.
    """
    if not wanted:
        return False, off
    if device.type != "cuda":
        return False, "it supports CUDA modules only (running on CPU)"
    if compile_model:
        return False, (
            "--compile cannot trace SyncBatchNorm (pytorch#161302, #107372): BatchNorm "
            "statistics stay per GPU, so keep --batch-size >= 8 per GPU, or drop --compile "
            "for SyncBatchNorm"
        )
    return True, ""


def wrap_for_training(
    model: nn.Module,
    dist: DistInfo,
    compile_model: bool = False,
    sync_bn: bool = True,
    sync_bn_off: str = "--no-sync-bn",
) -> nn.Module:
    """DDP (with SyncBatchNorm on CUDA when ``sync_bn``; ``sync_bn_off``: what turned it off)
    under a process group, then torch.compile when ``compile_model``."""
    wrapped: nn.Module = model
    if dist.distributed:
        sync_bn, why_not = use_sync_batchnorm(dist.device, compile_model, sync_bn, sync_bn_off)
        if sync_bn:
            # Converts in place: the BatchNorm2d modules inside ``model`` are replaced.
            wrapped = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif dist.is_main:
            log = logger.warning if compile_model else logger.info
            log("SyncBatchNorm skipped: %s", why_not)
        device_ids = [dist.device.index] if dist.device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(wrapped, device_ids=device_ids)
        # Set after construction, so that the buffers are still made equal to rank 0's once at
        # the start: torch 2.14's constructor calls this forward_sync_buffers (broadcast_buffers
        # stays its alias), torch before 2.14 knows only broadcast_buffers, and there False at
        # construction skips that first copy too.
        wrapped.broadcast_buffers = not sync_bn
    return torch.compile(wrapped) if compile_model else wrapped
