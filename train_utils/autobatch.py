"""``--batch-size -1`` (YOLOv5's ``--batch -1``): the largest batch per process that fits a share
of the GPU's memory, measured on the model itself.

On CUDA a few real train steps (forward in the run's autocast, backward) are run at small
batches, their peak allocated memory fitted by a line (memory = fixed + per image x batch), and
the batch whose fitted need is :data:`MEMORY_FRACTION` of the GPU's total memory is taken, as
YOLOv5's autobatch does. On a CPU there is no such limit worth measuring (training is bounded
by time, not memory): the batch is YOLOv5's CPU default, said in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from train_utils.precision import autocast_context

logger = logging.getLogger(__name__)

AUTO_BATCH = -1  # the --batch-size value that asks for it
MEMORY_FRACTION = 0.6  # YOLOv5's: leaves room for the optimizer's buffers and fragmentation
PROBE_BATCHES = (1, 2, 4, 8)
CPU_BATCH = 16  # YOLOv5's batch on a machine without CUDA
MAX_BATCH = 1024


def fit_batch(
    batches: Sequence[int], peak_bytes: Sequence[float], total_bytes: float, fraction: float
) -> int:
    """The largest batch whose memory, on the line through the measured ``(batch, peak)``
    points, is at most ``fraction`` of ``total_bytes``; between 1 and :data:`MAX_BATCH`."""
    n = len(batches)
    mean_b, mean_m = sum(batches) / n, sum(peak_bytes) / n
    var = sum((b - mean_b) ** 2 for b in batches)
    slope = sum((b - mean_b) * (m - mean_m) for b, m in zip(batches, peak_bytes)) / var
    fixed = mean_m - slope * mean_b
    if slope <= 0:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, int((fraction * total_bytes - fixed) / slope)))


def autobatch(
    model: nn.Module, img_size: int, device: torch.device, amp: torch.dtype | None
) -> int:
    """The batch per process for ``--batch-size -1`` (see the module docstring); logs it."""
    if device.type != "cuda":
        logger.info(
            "--batch-size -1: autobatch measures GPU memory; on the CPU batch %d (YOLOv5's)",
            CPU_BATCH,
        )
        return CPU_BATCH
    total = torch.cuda.get_device_properties(device).total_memory
    # The probe's forward passes move BatchNorm's running statistics: the run starts as built.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    peaks = [_peak_bytes(model, b, img_size, device, amp) for b in PROBE_BATCHES]
    model.load_state_dict(saved)
    batch = fit_batch(PROBE_BATCHES, peaks, total, MEMORY_FRACTION)
    logger.info(
        "--batch-size -1: batch %d per GPU (%.0f%% of %.1f GiB; measured at batches %s)",
        batch,
        100 * MEMORY_FRACTION,
        total / 2**30,
        ", ".join(map(str, PROBE_BATCHES)),
    )
    return batch


def _peak_bytes(
    model: nn.Module, batch: int, img_size: int, device: torch.device, amp: torch.dtype | None
) -> float:
    """Peak allocated CUDA memory of one forward (in ``amp``) and backward at ``batch``."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    x = torch.rand(batch, 3, img_size, img_size, device=device)
    with torch.random.fork_rng(devices=[device]), autocast_context(device, amp):
        outputs = model(x)
        loss = sum(o.float().sum() for o in outputs)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(torch.cuda.max_memory_allocated(device))
