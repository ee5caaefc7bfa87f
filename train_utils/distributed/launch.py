"""Distributed training as the scripts start it: in this process, or spawned on one node.

``train_multi_GPU.py`` runs :func:`train_distributed` in each process a launcher (torchrun,
SLURM) started. Without a launcher it can start the processes itself with
``torch.multiprocessing.spawn`` (:func:`spawn_training`): ``--nproc-per-node N``, or a GPU list
``--device 0,1`` (also from ``train.py``), one process per GPU. Each child gets the variables
torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and then runs the same :func:`train_distributed`, so
:func:`~train_utils.distributed.process_group.init_distributed_mode` and the device policy are
those of
torchrun. The children start from a fresh interpreter, never a fork of this one: the
``forkserver`` start method (a server process that imported torch, torchvision and OpenCV once,
so each rank skips those imports; measured in bench/README.md) where the platform has it, else
``spawn`` (Windows); the child entry point is a module-level function either way.

Under a launcher ``--nproc-per-node`` > 1 is refused: the launcher already chose the processes,
and spawning more from each of them would multiply the world size, the global batch and the
learning rate behind the user's back.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.multiprocessing as mp

from build_utils.errors import ConfigError, RankFailed, RunStopped, YoloError
from train_utils.cli import EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_USER_ERROR, setup_console_logging
from train_utils.config import build_config
from train_utils.distributed.comm import ERROR_TYPES, all_reduce_flag, broadcast_object
from train_utils.distributed.devices import choose_device, cuda_device_count, parse_device_list
from train_utils.distributed.node import usable_cpus
from train_utils.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    cleanup,
    init_distributed_mode,
    launch_hint,
    launcher_name,
)
from train_utils.evolve.search import evolve, is_search
from train_utils.run_folder import folder_of_launch, launch_id
from train_utils.threads import MAX_THREADS, thread_count
from train_utils.trainer import run

logger = logging.getLogger(__name__)

SPAWN_MASTER_ADDR = "127.0.0.1"  # spawned processes share one node: rendezvous on loopback


def free_port(host: str = SPAWN_MASTER_ADDR) -> int:
    """A TCP port that is free on ``host`` now, for the spawned job's rendezvous.

    The port is released before the children bind it, so another program could take it in
    between; on one node that window is short, and the children then fail with a clear
    "address in use" instead of hanging.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def processes_to_spawn(nproc: int | None, device: str, env: Mapping[str, str]) -> int:
    """How many processes this command starts itself; 0 to train in this process.

    Args:
        nproc: ``--nproc-per-node`` (None when not given, or for ``train.py``).
        device: the ``--device`` value; a GPU list (``0,1``) means one process per GPU.
        env: the environment, to tell whether a launcher started this process.

    Raises:
        ConfigError: ``--nproc-per-node`` < 1, more than the usable CPUs and the GPUs, > 1
            under a launcher, or other than the length of a ``--device`` list.
    """
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    launcher = launcher_name(env)
    if launcher is not None:
        if nproc is not None and nproc > 1:
            raise ConfigError(
                f"--nproc-per-node {nproc}: this process was started by {launcher}, which "
                f"already chose the processes; drop --nproc-per-node (use torchrun's "
                f"--nproc_per_node, or srun's --ntasks-per-node)"
            )
        # Under a launcher a GPU list maps each local rank to its GPU (choose_device).
        return 0
    listed = parse_device_list(device)
    if listed is not None and len(listed) > 1:
        if nproc is not None and nproc != len(listed):
            raise ConfigError(
                f"--nproc-per-node {nproc} but --device {device} lists {len(listed)} GPUs; "
                f"one process per listed GPU: drop --nproc-per-node or make them agree"
            )
        return len(listed)
    cpus, gpus = usable_cpus(), cuda_device_count()
    if nproc is not None and nproc > max(cpus, gpus):
        raise ConfigError(
            f"--nproc-per-node {nproc} is more than this machine has: {cpus} usable CPU(s), "
            f"{gpus} GPU(s); each process needs one"
        )
    return nproc if nproc is not None and nproc > 1 else 0


def spawn_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for local rank ``rank`` of a one-node job."""
    return {
        "MASTER_ADDR": SPAWN_MASTER_ADDR,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def threads_per_process(nprocs: int, env: Mapping[str, str]) -> int:
    """Intra-op threads of each of ``nprocs`` spawned processes: ``OMP_NUM_THREADS`` when the
    user set it (a count up to MAX_THREADS), else this node's usable CPUs shared among them (at
    least 1)."""
    count = thread_count(env.get("OMP_NUM_THREADS", ""))
    if count is not None and count <= MAX_THREADS:
        return count
    return max(1, usable_cpus() // max(1, nprocs))


def spawn_devices(device: str, nprocs: int, cuda_count: int) -> list[torch.device]:
    """The device of each of ``nprocs`` spawned processes, by local rank (the torchrun policy).

    Raises:
        ConfigError: what :func:`~train_utils.distributed.devices.choose_device` refuses, and two
            processes
            on one GPU: the policy's "a process that sees one GPU uses it" holds for launchers
            that hide the others per rank, but spawned processes all see the same GPUs, and
            NCCL refuses two ranks on one device.
    """
    devices = [choose_device(device, cuda_count, rank).device for rank in range(nprocs)]
    gpus = [d for d in devices if d.type == "cuda"]
    if len(set(gpus)) != len(gpus):
        raise ConfigError(
            f"--nproc-per-node {nprocs} but only {cuda_count} CUDA device(s) are visible: "
            f"start at most one process per GPU, or use --device cpu for CPU processes"
        )
    return devices


def _restarted() -> bool:
    """Whether torchrun restarted this job or SLURM requeued it, the same answer on every rank.

    Collective. Each node's agent counts only its own workers' failures: after a worker of
    node 1 failed, node 1's ranks see TORCHELASTIC_RESTART_COUNT=1 and node 0's still 0.
    """
    counts = (os.environ.get(k, "0") for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    return all_reduce_flag(any(c.isdigit() and int(c) > 0 for c in counts))


def train_distributed(args: argparse.Namespace, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the launcher's process group (one process without one) and train.

    Args:
        args: the training flags (``config.get_args_parser``), plus ``local_rank`` from the
            legacy launcher when present.
        timeout_s: how long a collective may wait for the slowest rank, in seconds.
    """
    dist = init_distributed_mode(args, timeout_s=timeout_s)
    try:
        if not dist.distributed:
            logger.warning(
                "not launched by torchrun/SLURM: training in one process. %s", launch_hint()
            )
        if is_search(args):
            evolve(args, dist)  # each candidate a DDP run of every rank
            return
        config = build_config(args)
        # Every rank must write to the same folder, whatever its clock says.
        config.output_dir = Path(broadcast_object(str(config.output_dir)))
        if config.resume is None and _restarted():
            # Rank 0 decides for everyone: on nodes without a shared output folder the others
            # would otherwise start from epoch 0 while rank 0 resumes. The first attempt may
            # have written runs/x2 (runs/x held a previous run): its args.yaml names this launch.
            found = folder_of_launch(config.output_dir, launch_id()) if dist.is_main else None
            folder = broadcast_object(None if found is None else str(found))
            if folder is not None:
                config.output_dir = Path(folder)
                logger.warning(
                    "restarted (torchrun, or a SLURM requeue): resuming from %s",
                    Path(folder) / "last.pt",
                )
                config.resume = "auto"
        run(config, dist)
    finally:
        cleanup()


def _spawned_worker(
    local_rank: int,
    world_size: int,
    port: int,
    args: argparse.Namespace,
    timeout_s: float,
    errors: mp.SimpleQueue,
) -> None:
    """Entry point of a spawned process (module level, so that it pickles by name).

    A user error is sent to the parent as (type name, message) and ends the process with exit
    status 2; the parent prints it once, as one line. Other exceptions keep their traceback
    (torch.multiprocessing hands it to the parent).
    """
    os.environ.update(spawn_env(local_rank, world_size, port))
    # torch's default (every CPU per process) would put N x CPUs threads on the CPUs: on a CPU
    # run each process then waits for threads the others have descheduled. torchrun sets
    # OMP_NUM_THREADS=1; a share of the CPUs keeps them all busy. An explicit setting wins.
    torch.set_num_threads(threads_per_process(world_size, os.environ))
    setup_console_logging()
    try:
        train_distributed(args, timeout_s)
    except YoloError as e:
        errors.put((type(e).__name__, str(e)))
        raise SystemExit(EXIT_USER_ERROR) from e
    except KeyboardInterrupt as e:
        # torch.multiprocessing treats a KeyboardInterrupt as a clean exit; it is not one.
        raise SystemExit(EXIT_INTERRUPTED) from e
    except RunStopped as e:
        raise SystemExit(EXIT_STOPPED) from e


# What the forkserver imports once for every rank it starts: the imports a rank would otherwise
# repeat (torch, and torchvision's torch._dynamo, are most of a rank's start-up). Nothing here
# touches CUDA, so the ranks may still initialise it.
FORKSERVER_PRELOAD = ["torch", "torchvision", "cv2"]


def _start_method() -> str:
    """``forkserver`` (its server started with :data:`FORKSERVER_PRELOAD`) where the platform has
    it, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    return "forkserver"


def spawn_training(
    args: argparse.Namespace, nprocs: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Train with ``nprocs`` DDP processes spawned on this node (see the module docstring).

    Every rank's device and the configuration (flags, cfg, hyp, .data:
    :func:`~train_utils.config.build_config`) are checked here first, so a missing GPU or a bad
    ``--data`` is one error before anything starts, not one per rank after the spawn.

    Raises:
        YoloError: of the type a child raised, with its message (the first child to fail).
        RankFailed: a child died without one (a signal, a crash); the others were stopped.
        KeyboardInterrupt: after the children stopped, when interrupted (Ctrl-C).
    """
    devices = spawn_devices(args.device, nprocs, cuda_device_count())
    build_config(copy.deepcopy(args))  # a check only: each rank builds its own
    port = free_port()
    logger.info(
        "spawning %d processes on this node (%s), rendezvous %s:%d",
        nprocs,
        ", ".join(str(d) for d in devices),
        SPAWN_MASTER_ADDR,
        port,
    )
    method = _start_method()
    errors = mp.get_context(method).SimpleQueue()
    context = mp.start_processes(
        _spawned_worker,
        args=(nprocs, port, args, timeout_s, errors),
        nprocs=nprocs,
        join=False,
        start_method=method,
    )
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code == EXIT_INTERRUPTED:
            raise KeyboardInterrupt from e
        if e.exit_code == EXIT_STOPPED:
            raise RunStopped("on request (SIGUSR1); continue with --resume") from None
        if errors.empty():  # killed by a signal, or a crash that printed its own traceback
            how = f"was killed by {e.signal_name}" if e.signal_name else f"exited {e.exit_code}"
            raise RankFailed(
                f"rank {e.error_index} (pid {e.error_pid}) {how}; the other ranks were stopped: "
                f"--resume continues from the last saved epoch"
            ) from None
        kind, message = errors.get()
        raise ERROR_TYPES.get(kind, YoloError)(message) from None
    except KeyboardInterrupt:
        # The children got the same Ctrl-C and save what they can: wait for them.
        for process in context.processes:
            process.join()
        raise
