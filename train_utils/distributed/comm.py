"""Collectives, each of which degrades to a no-op without a process group.

Every function here also works in a single process (``get_rank() == 0``,
``get_world_size() == 1``, ``all_gather(x) == [x]``, ...), so the training loop calls them
unconditionally and one code path serves ``train.py`` and ``train_multi_GPU.py``.

Every function whose docstring starts with "Collective." must be entered by all ranks of the
group, in the same order; a rank that skips one (e.g. only rank 0 evaluates) makes the others
wait until the timeout. Call them where a reader of the caller can see them, never inside a
helper whose name reads as a pure function.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from build_utils.errors import CheckpointError, ConfigError, DatasetError, OutputError, YoloError

logger = logging.getLogger(__name__)


def is_dist_avail_and_initialized() -> bool:
    """True when torch.distributed is built in and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank; 0 without a process group."""
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def get_world_size() -> int:
    """Number of processes; 1 without a process group."""
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def _collective_device() -> torch.device:
    """Device for tensors passed to collectives: NCCL only moves CUDA tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Collective. Wait until every rank arrives; no-op without a process group."""
    if not is_dist_avail_and_initialized():
        return
    if dist.get_backend() == "nccl":
        # Without device_ids NCCL guesses the GPU from the rank, wrong when a group was set up
        # without device_id.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@contextlib.contextmanager
def torch_distributed_zero_first(rank: int) -> Iterator[None]:
    """Collective. Run the block on rank 0 first; the others enter it once rank 0 has left it.

    Typical use: rank 0 builds a dataset cache, the others then read it instead of building it
    concurrently. Every rank of the group must enter the context. Pass the local rank when the
    work is per node (a node-local disk), the global rank when it is per job. Without a process
    group this is a no-op.
    """
    first = rank == 0
    if not is_dist_avail_and_initialized():
        yield
        return
    if not first:
        barrier()
    try:
        yield
    finally:
        # Also on an exception in rank 0's block: release the others so the job fails at once
        # instead of hanging until the collective timeout.
        if first:
            barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Collective. The mean of ``t`` over all ranks, on every rank; ``t`` itself without a
    process group.

    Args:
        t: the same shape and dtype on every rank (e.g. an epoch's mean losses), on the
            collective device (CUDA under NCCL); an integer tensor's mean is float64.
    """
    world_size = get_world_size()
    if world_size < 2:
        return t
    with torch.no_grad():
        total = t.detach().clone() if t.is_floating_point() else t.detach().double()
        dist.all_reduce(total)
        return total / world_size


def all_gather(obj: Any) -> list[Any]:
    """Collective. Every rank's picklable ``obj``, indexed by rank; ``[obj]`` without a process
    group."""
    world_size = get_world_size()
    if world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_rows_to_main(rows: torch.Tensor) -> torch.Tensor | None:
    """Collective. Rank 0 gets every rank's ``rows`` concatenated in rank order; other ranks
    get None.

    Args:
        rows: (n, k) tensor; n may differ by rank, k and dtype may not.

    Tensors, not pickled objects, and only rank 0 receives: evaluation detections for COCO at
    conf 0.001 are millions of rows, ~1 GB as Python objects on every rank with
    ``all_gather_object``, tens of MB as a float tensor on one.
    """
    world_size = get_world_size()
    if world_size == 1:
        return rows
    device = _collective_device()
    local = rows.to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([local.shape[0]], dtype=torch.int64, device=device))
    sizes = [int(c.item()) for c in counts]
    # gather needs equal shapes: pad every rank's block to the longest.
    longest = max(sizes)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]] = local
    main = get_rank() == 0
    blocks = [torch.empty_like(padded) for _ in range(world_size)] if main else None
    dist.gather(padded, blocks, dst=0)
    if not main:
        return None
    assert blocks is not None
    return torch.cat([b[:n] for b, n in zip(blocks, sizes, strict=True)]).to(rows.device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Collective. Rank ``src``'s picklable ``obj`` on every rank; ``obj`` itself without a
    process group."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_tensors_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Collective. Overwrite ``tensors`` in place with rank ``src``'s; no-op without a process
    group.

    Args:
        tensors: the same shapes and dtypes in the same order on every rank (e.g. the values of
            one model's ``state_dict()``, which alias its parameters and buffers), any memory
            format.

    One broadcast per dtype (the tensors flattened into one buffer), not one per tensor: a
    model's state is hundreds of small tensors, and each collective has a fixed latency.
    """
    if get_world_size() == 1 or not tensors:
        return
    device = _collective_device()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        # Sorted by name so that every rank broadcasts the groups in the same order.
        for dtype in sorted(by_dtype, key=str):
            group = by_dtype[dtype]
            flat = torch.cat([t.reshape(-1).to(device) for t in group])
            dist.broadcast(flat, src=src)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view(t.shape))
                offset += n


def raise_if_any_rank_failed(error: YoloError | None, what: str) -> None:
    """Collective. Raise the same error on every rank when ``error`` is set on any rank.

    For per-rank work whose failure must stop the whole job at once (reading a checkpoint that
    one node lacks): without it the failing rank exits and the others hang in the next
    collective until the timeout. The message names the first failing rank and its host.

    Raises:
        YoloError: of the first failing rank's type, on every rank.
    """
    if get_world_size() == 1:
        if error is not None:
            raise error
        return
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    failure = None if error is None else (type(error).__name__, host, str(error))
    for rank, failed in enumerate(all_gather(failure)):
        if failed is not None:
            kind, host, message = failed
            cls = ERROR_TYPES.get(kind, YoloError)
            raise cls(f"{what} failed on rank {rank} ({host}): {message}") from error


# The user errors a process re-raises by the type name another process sent (any other name:
# YoloError): here, and launch.spawn_training for its spawned children.
ERROR_TYPES = {c.__name__: c for c in (ConfigError, CheckpointError, DatasetError, OutputError)}


def all_reduce_flag(flag: bool) -> bool:
    """Collective. True on every rank when ``flag`` is True on any rank.

    Lets one rank's non-finite loss (or a stop request) end the loop on all ranks at the same
    step, instead of the others waiting forever in the next gradient all-reduce.
    """
    if get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
