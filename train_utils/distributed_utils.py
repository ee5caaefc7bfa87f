"""Distributed (DDP) helpers: process-group set-up and collectives that degrade to no-ops.

Every helper here also works in a single process without a process group (``get_rank() == 0``,
``get_world_size() == 1``, ``all_gather(x) == [x]``, ...), so the training loop calls them
unconditionally and one code path serves ``train.py`` and ``train_multi_GPU.py``.

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

Every collective must be entered by all ranks of the group, in the same order; a rank that skips
one (e.g. only rank 0 evaluates) makes the others wait until the timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from build_utils.errors import CheckpointError, ConfigError, DatasetError, YoloError
from train_utils.devices import cuda_device_count, select_device
from train_utils.slurm import expand_nodelist, tasks_on_this_node

logger = logging.getLogger(__name__)

# Long enough for rank 0 to build a label cache or run COCO evaluation on a large validation set
# while the other ranks wait at a barrier (ultralytics/yolov5#4409 hung on the 10-minute default).
DEFAULT_TIMEOUT_S = 1800.0

# SLURM gives no rendezvous port: derive one from the job id so that two jobs sharing a node do
# not collide; the range stays clear of the usual ephemeral ports (32768+ on Linux).
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000
_DEFAULT_MASTER_ADDR = "127.0.0.1"

# Default DataLoader workers per process: its share of the node's CPUs, at most this many (more
# rarely helps a detector's loader and each one holds its own copy of the dataset's Python state).
MAX_DEFAULT_WORKERS = 8


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
    def single(cls, device: torch.device | str | None = None) -> DistInfo:
        """One process, no process group; ``device`` defaults to ``cuda`` when available."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
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
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
                # Read by the RAM-cache memory check (build_utils.datasets).
                os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
        if "MASTER_PORT" not in os.environ:
            job_id = os.environ.get("SLURM_JOB_ID", "0")
            offset = int(job_id) % _SLURM_PORT_SPAN if job_id.isdigit() else 0
            os.environ["MASTER_PORT"] = str(_SLURM_PORT_BASE + offset)
        return rank, world_size, local_rank, "SLURM"
    return None


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
            request, applied by :func:`train_utils.devices.choose_device`: ``cpu`` forces CPU and
            gloo) and ``local_rank`` (legacy ``--local_rank``/``--local-rank``).
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
    device = select_device(_requested_device(args), local_rank)
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
    """Wait until every rank arrives; no-op without a process group."""
    if not is_dist_avail_and_initialized():
        return
    if dist.get_backend() == "nccl":
        # Without device_ids NCCL guesses the GPU from the rank, wrong when a group was set up
        # without device_id.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


@contextlib.contextmanager
def torch_distributed_zero_first(rank: int | None = None) -> Iterator[None]:
    """Run the block on rank 0 first; the other ranks enter it once rank 0 has left it.

    Typical use: rank 0 builds a dataset cache, the others then read it instead of building it
    concurrently. Every rank of the group must enter the context. Pass the local rank when the
    work is per node (a node-local disk), the global rank when it is per job; ``-1`` (no DDP)
    behaves like 0. Without a process group this is a no-op.
    """
    if rank is None:
        rank = get_rank()
    first = rank in (-1, 0)
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


def reduce_dict(
    input_dict: Mapping[str, torch.Tensor], average: bool = True
) -> dict[str, torch.Tensor]:
    """Sum (or average) each tensor over all ranks; every rank gets the result.

    Args:
        input_dict: name -> tensor, the same names and shapes on every rank (e.g. 0-dim losses),
            on the collective device (CUDA under NCCL).
        average: divide by the world size (integer tensors become float).

    Returns:
        A new dict with the same keys; the input unchanged without a process group.
    """
    world_size = get_world_size()
    if world_size < 2 or not input_dict:
        return dict(input_dict)
    # Sorted so that every rank reduces the same tensor in the same slot, whatever order the
    # dicts were built in.
    names = sorted(input_dict)
    with torch.no_grad():
        values = [input_dict[k].detach() for k in names]
        if average:
            values = [v if v.is_floating_point() else v.double() for v in values]
        if all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values):
            stacked = torch.stack(values)  # one collective instead of one per key
            dist.all_reduce(stacked)
            reduced = list(stacked.unbind(0))
        else:
            reduced = [v.clone() for v in values]
            for v in reduced:
                dist.all_reduce(v)
        if average:
            reduced = [v / world_size for v in reduced]
    by_name = dict(zip(names, reduced, strict=True))
    return {k: by_name[k] for k in input_dict}


def all_gather(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, indexed by rank; ``[obj]`` without a process group."""
    world_size = get_world_size()
    if world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_rows_to_main(rows: torch.Tensor) -> torch.Tensor | None:
    """Rank 0 gets every rank's ``rows`` concatenated in rank order; other ranks get None.

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
    """Rank ``src``'s picklable ``obj`` on every rank; ``obj`` itself without a process group."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def raise_if_any_rank_failed(error: YoloError | None, what: str) -> None:
    """Raise the same error on every rank when ``error`` is set on any rank.

    For per-rank work whose failure must stop the whole job at once (reading a checkpoint that
    one node lacks): without it the failing rank exits and the others hang in the next
    collective until the timeout. The message names the first failing rank and its host.
    Every rank must call this.

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
            cls = _ERROR_TYPES.get(kind, YoloError)
            raise cls(f"{what} failed on rank {rank} ({host}): {message}") from error


_ERROR_TYPES = {c.__name__: c for c in (ConfigError, CheckpointError, DatasetError)}


def all_reduce_flag(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank.

    Lets one rank's non-finite loss (or a stop request) end the loop on all ranks at the same
    step, instead of the others waiting forever in the next gradient all-reduce.
    """
    if get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def cleanup() -> None:
    """Destroy the process group if there is one; safe to call more than once."""
    if is_dist_avail_and_initialized():
        dist.destroy_process_group()


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
    """``--workers``: the explicit value, or :func:`default_workers` of this process's CPUs
    (logged): ``SLURM_CPUS_PER_TASK`` under SLURM, else its usable CPUs shared among the node's
    :func:`processes_per_node`.

    The choice changes no result: a training sample is a pure function of (seed, epoch, index),
    whichever worker loads it (see :mod:`build_utils.datasets`)."""
    if requested is not None:
        return requested
    cpus, per_task = usable_cpus(), slurm_cpus_per_task()
    if per_task is not None:
        workers = default_workers(min(per_task, cpus), 1)
        why = f"SLURM_CPUS_PER_TASK={per_task}"
    else:
        procs = processes_per_node()
        workers = default_workers(cpus, procs)
        why = f"{cpus} usable CPU(s) / {procs} process(es) on this node"
    logger.info("--workers %d (default: %s, at most %d)", workers, why, MAX_DEFAULT_WORKERS)
    return workers
