"""Distributed training: one process per GPU (NCCL), or per CPU slot (gloo).

    torchrun --nproc_per_node=4 train_multi_GPU.py --cfg cfg/yolov3-spp.cfg --data data/x.data
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
             --nproc_per_node=8 train_multi_GPU.py ...          # on each node, node_rank 0 and 1
    torchrun --nproc_per_node=2 --max-restarts=3 train_multi_GPU.py --name run1 ...
    srun python train_multi_GPU.py ...                          # SLURM: one task per GPU
    python train_multi_GPU.py --nproc-per-node 4 ...            # spawns 4 processes itself
    python train_multi_GPU.py --device 0,1 ...                  # one spawned process per GPU
    python train_multi_GPU.py --device cpu --nproc-per-node 2 ...   # 2 CPU processes (gloo)

The flags are those of ``train.py``; ``--batch-size`` is per process. Gradients accumulate until
batch x world size x accumulation reaches ``--nbs`` (64), and the learning rate grows linearly
when the global batch exceeds it. Under ``--max-restarts`` a restarted job resumes from
``last.pt`` in its output folder (give ``--name`` or ``--output-dir`` so it is the same folder).
``--nproc-per-node`` > 1 under torchrun or SLURM is an error: the launcher chose the processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from build_utils.checks import check_real
from train_utils.cli import HelpFormatter, add_local_rank_flag, check_environment, run_script
from train_utils.config import get_args_parser
from train_utils.distributed.launch import processes_to_spawn, spawn_training, train_distributed


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "YOLOv3-SPP distributed training",
        parents=[get_args_parser(add_help=False)],
        formatter_class=HelpFormatter,
    )
    add_local_rank_flag(parser)
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait before the job fails",
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=int,
        default=None,
        help="without torchrun/SLURM: spawn this many DDP processes on this node "
        "(default: one per GPU of a --device list such as 0,1, else a single process)",
    )
    return parser


def train(args: argparse.Namespace) -> None:
    check_real("--dist-timeout", args.dist_timeout, positive=True, unit="seconds")
    # Checked here too: a spawning parent would report it only after starting every rank.
    check_environment()
    nprocs = processes_to_spawn(args.nproc_per_node, args.device, os.environ)
    if nprocs:
        spawn_training(args, nprocs, timeout_s=args.dist_timeout)
    else:
        train_distributed(args, timeout_s=args.dist_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), train, argv)


if __name__ == "__main__":
    sys.exit(main())
