"""The process group: which launcher started this process, and joining its group.

Launchers understood by :func:`init_distributed_mode`, checked in this order:

1. ``torchrun`` (and ``python -m torch.distributed.launch --use_env``): ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment.
2. legacy ``python -m torch.distributed.launch`` without ``--use_env``: ``RANK`` and
   ``WORLD_SIZE`` in the environment and the local rank as ``--local_rank``/``--local-rank``
   (``args.local_rank``).
3. SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; ``MASTER_ADDR``
   defaults to the first host of ``SLURM_JOB_NODELIST`` (rank 0's node; not
   ``SLURM_LAUNCH_NODE_IPADDR``, the host that ran ``srun``, which under ``sbatch``/``salloc``
   from a login node is another machine), else 127.0.0.1; ``MASTER_PORT`` defaults to a port
   derived from the job id; ``LOCAL_WORLD_SIZE`` (which SLURM never sets) to the tasks on this
   node (``SLURM_NTASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``).
4. nothing of the above: one process, no process group (see :func:`launch_hint`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from build_utils.errors import ConfigError
from train_utils.distributed.comm import (
    barrier,
    get_rank,
    get_world_size,
    is_dist_avail_and_initialized,
)
from train_utils.distributed.devices import cuda_device_count, select_device
from train_utils.distributed.slurm import expand_nodelist, tasks_on_this_node

logger = logging.getLogger(__name__)

# Long enough for rank 0 to build a label cache or run COCO evaluation on a large validation set
# while the other ranks wait at a barrier (ultralytics/yolov5#4409 hung on the 10-minute default).
DEFAULT_TIMEOUT_S = 1800.0


# SLURM gives no rendezvous port: derive one from the job id so that two jobs sharing a node do
# not collide; the range stays clear of the usual ephemeral ports (32768+ on Linux).
_SLURM_PORT_BASE = 15000


_SLURM_PORT_SPAN = 15000


_DEFAULT_MASTER_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        world_size: number of processes in the job.
        local_rank: rank on this node; the CUDA device index when on GPU.
        device: the device this process computes on.
        backend: ``"nccl"`` or ``"gloo"`` when :func:`init_distributed_mode` initialised a process
            group, ``None`` in a single process.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None

    @classmethod
    def single(cls, device: torch.device | str) -> DistInfo:
        """One process, no process group, on ``device`` (see :func:`select_device`)."""
        return cls(rank=0, world_size=1, local_rank=0, device=torch.device(device), backend=None)

    @property
    def distributed(self) -> bool:
        """True when the model should be wrapped in DDP (a process group exists)."""
        return self.world_size > 1 or self.backend is not None

    @property
    def is_main(self) -> bool:
        """True on the rank that logs, evaluates with COCO tools and writes files."""
        return self.rank == 0


def launch_hint(script: str = "train_multi_GPU.py") -> str:
    """How to launch ``script`` on several processes, for a message to the user."""
    ngpu = cuda_device_count()
    nproc = str(ngpu) if ngpu > 1 else "<number of GPUs>"
    return (
        f"launch it with torchrun, e.g. `torchrun --nproc_per_node={nproc} {script} ...` "
        f"(or `srun --ntasks-per-node={nproc} python {script} ...` under SLURM), or let it "
        f"spawn the processes: `python {script} --nproc-per-node {nproc} ...`; "
        f"for a single process use train.py"
    )


def _env_int(name: str) -> int:
    """An integer environment variable that is known to be set; ConfigError if malformed."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError as e:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from e


def _arg_local_rank(args: Any) -> int | None:
    """``--local_rank``/``--local-rank`` from the legacy launcher; -1 or None mean unset."""
    value = getattr(args, "local_rank", None) if args is not None else None
    if value is None or int(value) < 0:
        return None
    return int(value)


def _requested_device(args: Any) -> str:
    """``args.device`` as a string ('' when absent: automatic)."""
    device = getattr(args, "device", None) if args is not None else None
    return "" if device is None else str(device).strip()


def launcher_name(env: Mapping[str, str]) -> str | None:
    """The launcher that started this process ('torchrun', 'SLURM'), or None.

    The same variables :func:`init_distributed_mode` reads.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env:
        return "SLURM"
    return None


def launched_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher that started this one started in all (1 when none did),
    from the variables :func:`init_distributed_mode` reads, without joining any group."""
    env = os.environ if env is None else env
    launcher = launcher_name(env)
    if launcher is None:
        return 1
    value = env["WORLD_SIZE"] if launcher == "torchrun" else env.get("SLURM_NTASKS", "1")
    return int(value) if value.isdigit() else 1


def _read_launch_env(args: Any) -> tuple[int, int, int, str] | None:
    """(rank, world_size, local_rank, launcher) from the environment, or None when not launched.

    Under SLURM this also exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT,
    which ``init_method='env://'`` reads.
    """
    ngpu = cuda_device_count()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if "LOCAL_RANK" in os.environ:
            local_rank, launcher = _env_int("LOCAL_RANK"), "torchrun"
        elif (arg_rank := _arg_local_rank(args)) is not None:
            local_rank, launcher = arg_rank, "torch.distributed.launch"
        else:
            # RANK/WORLD_SIZE set by hand: assume ranks are packed onto nodes in order.
            local_rank, launcher = (rank % ngpu if ngpu else 0), "environment"
        return rank, world_size, local_rank, launcher
    if "SLURM_PROCID" in os.environ:
        rank = _env_int("SLURM_PROCID")
        world_size = _env_int("SLURM_NTASKS") if "SLURM_NTASKS" in os.environ else 1
        if "SLURM_LOCALID" in os.environ:
            local_rank = _env_int("SLURM_LOCALID")
        else:
            local_rank = rank % ngpu if ngpu else 0
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(local_rank)
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = _slurm_master_addr(os.environ)
        if "LOCAL_WORLD_SIZE" not in os.environ:
            local_world = tasks_on_this_node(dict(os.environ))
            if local_world is not None:
                # Read by node.processes_per_node (RAM-cache check, default workers).
                os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        if "MASTER_PORT" not in os.environ:
            job_id = os.environ.get("SLURM_JOB_ID", "0")
            offset = int(job_id) % _SLURM_PORT_SPAN if job_id.isdigit() else 0
            os.environ["MASTER_PORT"] = str(_SLURM_PORT_BASE + offset)
        return rank, world_size, local_rank, "SLURM"
    return None


def processes_sharing_gpus(launcher: str, env: Mapping[str, str]) -> int | None:
    """The processes on this node that see the same GPUs as this one: torchrun's (and the
    legacy launcher's, and spawned processes') ``LOCAL_WORLD_SIZE``, since their workers inherit
    one ``CUDA_VISIBLE_DEVICES``. None under SLURM, where each task may see GPUs of its own
    (``--gpus-per-task``), and when the variable is absent."""
    if launcher not in ("torchrun", "torch.distributed.launch"):
        return None
    value = env.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    """Rank 0's host: SLURM places task 0 on the first node of the job's node list."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        return expand_nodelist(nodelist)[0]
    return _DEFAULT_MASTER_ADDR


def init_distributed_mode(args: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join the process group described by the launcher's environment (see module docstring).

    Args:
        args: parsed CLI namespace or None. Read (all optional): ``device`` (the ``--device``
            request, applied by :func:`~train_utils.distributed.devices.choose_device`:
            ``cpu`` forces CPU and gloo) and ``local_rank`` (legacy
            ``--local_rank``/``--local-rank``).
        timeout_s: how long a collective may wait for the slowest rank, in seconds.

    Returns:
        The process's :class:`DistInfo`. Without any launcher variables this is a single-process
        ``DistInfo`` (``distributed`` False) and nothing is initialised.

    Raises:
        ConfigError: malformed launcher variables, or more processes on a node than GPUs.
    """
    if is_dist_avail_and_initialized():
        return _describe_existing_group(args)
    launch = _read_launch_env(args)
    if launch is None:
        logger.info("not launched by torchrun or SLURM: running as a single process")
        return DistInfo.single(select_device(_requested_device(args)))

    rank, world_size, local_rank, launcher = launch
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"{launcher} gave rank {rank} outside world size {world_size}")
    if local_rank < 0:
        raise ConfigError(f"{launcher} gave a negative local rank {local_rank}")
    # Before the process group exists, so that NCCL communicators and default CUDA tensors land
    # on this rank's GPU and not all on GPU 0.
    device = select_device(
        _requested_device(args), local_rank, processes_sharing_gpus(launcher, os.environ)
    )
    # Windows builds have no NCCL; gloo still moves CUDA tensors for the few collectives DDP
    # needs, only slower.
    if device.type == "cuda" and dist.is_nccl_available():
        backend = "nccl"
    else:
        backend = "gloo"
    logger.info(
        "initialising process group: rank %d/%d (local rank %d, %s), backend %s, master %s:%s",
        rank,
        world_size,
        local_rank,
        launcher,
        backend,
        os.environ.get("MASTER_ADDR", "?"),
        os.environ.get("MASTER_PORT", "?"),
    )
    _init_process_group(backend, rank, world_size, device, timedelta(seconds=timeout_s))
    barrier()
    # Rank 0 logs INFO; the others only warnings and errors, so a failure on any rank shows.
    logging.getLogger().setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return DistInfo(rank, world_size, local_rank, device, backend)


def _describe_existing_group(args: Any) -> DistInfo:
    """DistInfo for a group someone else (a notebook, a test harness) already set up."""
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", _arg_local_rank(args) or 0))
    requested = _requested_device(args)
    if backend == "nccl" and requested.lower() == "cpu":
        raise ConfigError("--device cpu, but the existing process group uses NCCL (CUDA only)")
    # select_device also makes the GPU current (torch.cuda.set_device), which whoever created
    # the group may not have done.
    device = select_device(requested or ("cuda" if backend == "nccl" else "cpu"), local_rank)
    return DistInfo(get_rank(), get_world_size(), local_rank, device, backend)


def _init_process_group(
    backend: str, rank: int, world_size: int, device: torch.device, timeout: timedelta
) -> None:
    # torch.distributed.nn binds the default group into its functions' default arguments
    # (``group=group.WORLD``, read at import). Imported after the group exists (torchvision
    # imports it through torch._dynamo; a script that imports torchvision late would do that),
    # it holds the group for the life of the process: destroy_process_group cannot free it and
    # gloo's threads outlive cleanup() into interpreter exit (a likely cause, unproven, of a
    # rank aborting at exit with "terminate called without an active exception"). Imported
    # first, it binds None.
    import torch.distributed.nn  # noqa: F401

    # torch's own env:// rendezvous (it knows when torchrun's agent hosts the store) ...
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    # ... but torchrun's agents keep one store across restarts (static rendezvous, and c10d's
    # shared store): a restarted rank could read its peer's address from the failed attempt
    # and gloo's connect fails with "Connection refused". One key space per attempt keeps every
    # attempt's addresses apart.
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"yolo/attempt_{_attempt_key(store, rank, world_size)}", store),
        world_size=world_size,
        rank=rank,
        timeout=timeout,
        # Binding the device lets NCCL connect eagerly and lets barrier() know its GPU.
        device_id=device if device.type == "cuda" else None,
    )


def _attempt_key(store: dist.Store, rank: int, world_size: int) -> str:
    """A name for this launch attempt that every rank of the attempt agrees on.

    One agent (one node): its restart count. Several agents: their restart counts differ (the
    agent whose worker failed counts a restart, the others only re-rendezvous), so each rank
    counts its own joins in the shared store instead: in every attempt each rank of a world of
    this size joins once, so the counts agree.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return attempt
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    joins = store.add(f"yolo/{run}/joins/w{world_size}/r{rank}", 1)
    return f"w{world_size}_{joins}"


def cleanup() -> None:
    """Destroy the process group if there is one; safe to call more than once."""
    if is_dist_avail_and_initialized():
        dist.destroy_process_group()
