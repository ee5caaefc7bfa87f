"""Which device a process computes on: one policy for ``train.py``, ``validation.py``,
``predict.py`` and every rank started by torchrun or SLURM.

:func:`choose_device` is the policy as a pure function of what the user asked for, how many CUDA
devices this process sees and (under a launcher) its local rank, so it is tested without a GPU;
:func:`select_device` applies it to this machine.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from build_utils.errors import ConfigError

logger = logging.getLogger(__name__)

_DEVICE_HELP = "use cpu, cuda, cuda:N, N or a GPU list such as 0,1"


def parse_device_list(spec: str) -> list[int] | None:
    """GPU indices of a comma-separated ``--device`` list (``'0,1'`` -> ``[0, 1]``).

    A list is how users of YOLOv3 repositories ask for several GPUs on one node: one DDP process per
    listed GPU, local rank ``i`` on the ``i``-th index. Returns None when ``spec`` is not a list
    (no comma), so the single-device forms keep their meaning.

    Raises:
        ConfigError: an entry that is not a GPU index, or an index listed twice.
    """
    if "," not in spec:
        return None
    entries = [e.strip() for e in spec.split(",")]
    if not all(e.isdigit() for e in entries):
        raise ConfigError(
            f"--device {spec!r}: a device list holds GPU indices only, e.g. 0,1 "
            f"(for several CPU processes use train_multi_GPU.py --device cpu --nproc-per-node N)"
        )
    ids = [int(e) for e in entries]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--device {spec!r} lists a GPU twice; give each GPU once")
    return ids


class DeviceChoice(NamedTuple):
    """The device to use and, when the request was overridden, why (to log as a warning)."""

    device: torch.device
    note: str | None = None


def _parse_request(spec: str) -> torch.device | None:
    """``''`` -> None (automatic); ``'0'`` -> cuda:0; otherwise what ``torch.device`` makes."""
    spec = spec.strip().lower()
    if not spec:
        return None
    if spec.isdigit():
        return torch.device("cuda", int(spec))
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ConfigError(f"--device {spec!r} is not a device; {_DEVICE_HELP}") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"--device {spec!r}: only CPU and CUDA devices are supported; {_DEVICE_HELP}"
        )
    return device


def choose_device(
    spec: str, cuda_count: int, local_rank: int | None = None, node_processes: int | None = None
) -> DeviceChoice:
    """The device policy.

    Args:
        spec: the ``--device`` value: ``''`` (CUDA when there is one, else CPU), ``cpu``,
            ``cuda``, ``cuda:N`` or ``N``.
        cuda_count: CUDA devices visible to this process (after ``CUDA_VISIBLE_DEVICES``).
        local_rank: this process's rank on its node when a launcher (torchrun, SLURM) started
            several; None for a single process.
        node_processes: the processes on this node when they all see the same GPUs (torchrun's
            ``LOCAL_WORLD_SIZE``: its workers share the agent's ``CUDA_VISIBLE_DEVICES``); None
            when unknown or when each process may see GPUs of its own (SLURM).

    Returns:
        The device, plus a note when a request was overridden. Under a launcher every rank uses
        the GPU of its local rank, except that a process which sees exactly one GPU uses that one
        (SLURM ``--gpus-per-task=1``, ``--gpu-bind``, or wrappers that set
        ``CUDA_VISIBLE_DEVICES`` per rank); a ``--device cuda:N`` is then ignored with a note,
        since ``CUDA_VISIBLE_DEVICES`` is what chooses GPUs for a job.

    A GPU list (``0,1``, see :func:`parse_device_list`) puts local rank ``i`` on the ``i``-th
    listed GPU, without ``CUDA_VISIBLE_DEVICES``; one process may use a one-entry list only.

    Raises:
        ConfigError: CUDA asked for where there is none, an index beyond the visible devices,
            or more processes on a node than the GPUs they can see (every rank says so, in the
            words of the spawn path: ``launch.spawn_devices``).
    """
    listed = parse_device_list(spec)
    if listed is not None:
        return DeviceChoice(_choose_listed(spec, listed, cuda_count, local_rank))
    requested = _parse_request(spec)
    if requested is not None and requested.type == "cpu":
        return DeviceChoice(torch.device("cpu"))
    if cuda_count < 1:
        if requested is not None:
            raise ConfigError(
                f"--device {spec} asks for CUDA but no CUDA device is visible; use --device cpu"
            )
        return DeviceChoice(torch.device("cpu"))
    if local_rank is None:
        index = requested.index if requested is not None and requested.index is not None else 0
        if index >= cuda_count:
            raise ConfigError(
                f"--device {spec}: only {cuda_count} CUDA device(s) are visible "
                f"(cuda:0..cuda:{cuda_count - 1})"
            )
        return DeviceChoice(torch.device("cuda", index))
    if node_processes is not None and node_processes > cuda_count:
        # Without this each rank would take cuda:0 and NCCL fail with "Duplicate GPU detected".
        raise ConfigError(
            f"{node_processes} processes on this node (torchrun --nproc_per_node) but only "
            f"{cuda_count} CUDA device(s) are visible: start at most one process per GPU, or "
            f"use --device cpu for CPU processes"
        )
    if cuda_count == 1:
        index = 0
    elif local_rank < cuda_count:
        index = local_rank
    else:
        raise ConfigError(
            f"local rank {local_rank} but {cuda_count} CUDA devices are visible on "
            f"this node: start at most {cuda_count} processes per node "
            f"(--nproc_per_node), or give each process its own GPU"
        )
    note = None
    if requested is not None and requested.index is not None and requested.index != index:
        note = (
            f"--device {spec} is ignored under a launcher: each process uses the GPU of its "
            f"local rank (cuda:{index} here); choose GPUs with CUDA_VISIBLE_DEVICES"
        )
    return DeviceChoice(torch.device("cuda", index), note)


def _choose_listed(
    spec: str, listed: list[int], cuda_count: int, local_rank: int | None
) -> torch.device:
    """The GPU of ``local_rank`` in a ``--device`` list (see :func:`choose_device`)."""
    if cuda_count < 1:
        raise ConfigError(
            f"--device {spec} asks for CUDA but no CUDA device is visible; use --device cpu "
            f"(train_multi_GPU.py --device cpu --nproc-per-node N for several CPU processes)"
        )
    beyond = [i for i in listed if i >= cuda_count]
    if beyond:
        raise ConfigError(
            f"--device {spec}: GPU {beyond[0]} does not exist; only {cuda_count} CUDA "
            f"device(s) are visible (0..{cuda_count - 1})"
        )
    if local_rank is None:
        if len(listed) > 1:
            raise ConfigError(
                f"--device {spec} lists {len(listed)} GPUs, one process each: give it to "
                f"train.py or train_multi_GPU.py without a launcher (they spawn the processes), "
                f"or to train_multi_GPU.py under torchrun"
            )
        local_rank = 0
    if local_rank >= len(listed):
        raise ConfigError(
            f"local rank {local_rank} but --device {spec} lists {len(listed)} GPU(s): start "
            f"at most {len(listed)} processes per node, or list more GPUs"
        )
    return torch.device("cuda", listed[local_rank])


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without a CUDA build or driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(
    spec: str = "", local_rank: int | None = None, node_processes: int | None = None
) -> torch.device:
    """Apply :func:`choose_device` here and make the chosen GPU the current one.

    ``torch.cuda.set_device`` matters for ``cuda:1`` and above: without it pinned memory, the
    CUDA context and NCCL's communicators land on GPU 0.
    """
    device, note = choose_device(spec, cuda_device_count(), local_rank, node_processes)
    if note:
        logger.warning(note)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
