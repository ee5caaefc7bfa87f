"""This node's share of the machine: usable CPUs, training processes per node, and the
DataLoader workers each process gets by default. The one reader of "processes per node"."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from train_utils.distributed.slurm import tasks_on_this_node

logger = logging.getLogger(__name__)

# Default DataLoader workers per process: its share of the node's CPUs, at most this many (more
# rarely helps a detector's loader and each one holds its own copy of the dataset's Python state).
MAX_DEFAULT_WORKERS = 8


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (taskset, cgroups,
    SLURM binding), else every CPU of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def processes_per_node(env: Mapping[str, str] | None = None) -> int:
    """Training processes on this node: ``LOCAL_WORLD_SIZE`` (torchrun;
    :func:`init_distributed_mode` exports it under SLURM), else SLURM's task count on this node
    when SLURM started this process, else 1."""
    env = os.environ if env is None else env
    value = env.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    if "SLURM_PROCID" in env:
        tasks = tasks_on_this_node(dict(env))
        if tasks:
            return tasks
    return 1


def default_workers(cpus: int, procs_per_node: int, cap: int = MAX_DEFAULT_WORKERS) -> int:
    """DataLoader workers per process when ``--workers`` is not given: the process's share of
    ``cpus`` usable CPUs among ``procs_per_node`` processes, at most ``cap``, at least 0."""
    return max(0, min(cap, cpus // max(1, procs_per_node)))


def slurm_cpus_per_task(env: Mapping[str, str] | None = None) -> int | None:
    """``SLURM_CPUS_PER_TASK`` when SLURM started this process: SLURM's CPUs for this one process
    (often already its affinity mask, so it must not be divided among the node's tasks again)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_CPUS_PER_TASK", "")
    if "SLURM_PROCID" in env and value.isdigit() and int(value) > 0:
        return int(value)
    return None


def resolve_workers(requested: int | None) -> int:
    """``--workers``: the explicit value (at most this process's usable CPUs), or
    :func:`default_workers` of its CPUs (logged): ``SLURM_CPUS_PER_TASK`` under SLURM, else its
    usable CPUs shared among the node's :func:`processes_per_node`.

    The choice changes no result: a training sample is a pure function of (seed, epoch, index),
    whichever worker loads it (see :mod:`build_utils.datasets`)."""
    cpus, per_task = usable_cpus(), slurm_cpus_per_task()
    if requested is not None:
        # More loader processes than CPUs only queue for them, and a huge count starts until
        # memory runs out: capped at the CPUs, as YOLOv5 caps its --workers.
        if requested > cpus:
            logger.warning(
                "--workers %d: this process has %d usable CPU(s); using %d", requested, cpus, cpus
            )
        return min(requested, cpus)
    if per_task is not None:
        workers = default_workers(min(per_task, cpus), 1)
        why = f"SLURM_CPUS_PER_TASK={per_task}"
    else:
        procs = processes_per_node()
        workers = default_workers(cpus, procs)
        why = f"{cpus} usable CPU(s) / {procs} process(es) on this node"
    logger.info("--workers %d (default: %s, at most %d)", workers, why, MAX_DEFAULT_WORKERS)
    return workers
