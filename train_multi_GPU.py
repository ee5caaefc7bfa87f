"""Distributed training under torchrun: one process per GPU (NCCL), or per CPU slot (gloo).

    torchrun --nproc_per_node=4 train_multi_GPU.py --cfg cfg/yolov3-spp.cfg --data data/x.data
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \\
             --nproc_per_node=8 train_multi_GPU.py ...          # on each node, node_rank 0 and 1
    torchrun --nproc_per_node=2 --max-restarts=3 train_multi_GPU.py --name run1 ...
    srun python train_multi_GPU.py ...                          # SLURM: one task per GPU

The flags are those of ``train.py``; ``--batch-size`` is per process. Gradients accumulate until
batch x world size x accumulation reaches ``--nbs`` (64), and the learning rate grows linearly
when the global batch exceeds it. Under ``--max-restarts`` a restarted job resumes from
``last.pt`` in its output folder (give ``--name`` or ``--output-dir`` so it is the same folder).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from train_utils.cli import run_main, setup_console_logging
from train_utils.config import build_config, get_args_parser
from train_utils.distributed_utils import (
    all_reduce_flag,
    broadcast_object,
    cleanup,
    init_distributed_mode,
    launch_hint,
)
from train_utils.trainer import run

logger = logging.getLogger("train_multi_GPU")


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "YOLOv3-SPP distributed training",
        parents=[get_args_parser(add_help=False)],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # torch.distributed.launch passes one of these; torchrun sets LOCAL_RANK instead.
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=-1,
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait before the job fails",
    )
    return parser


def _restarted() -> bool:
    """Whether torchrun restarted this job, the same answer on every rank.

    Collective. Each node's agent counts only its own workers' failures: after a worker of
    node 1 failed, node 1's ranks see TORCHELASTIC_RESTART_COUNT=1 and node 0's still 0.
    """
    return all_reduce_flag(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = get_parser().parse_args(argv)
    setup_console_logging()

    def body() -> None:
        dist = init_distributed_mode(args, timeout_s=args.dist_timeout)
        try:
            if not dist.distributed:
                logger.warning(
                    "not launched by torchrun/SLURM: training in one process. %s", launch_hint()
                )
            config = build_config(args)
            # Every rank must write to the same folder, whatever its clock says.
            config.output_dir = Path(broadcast_object(str(config.output_dir)))
            if config.resume is None and _restarted():
                # Rank 0 decides for everyone: on nodes without a shared output folder the
                # others would otherwise start from epoch 0 while rank 0 resumes.
                last = config.output_dir / "last.pt"
                if broadcast_object(last.is_file() if dist.is_main else None):
                    logger.warning("restarted by torchrun: resuming from %s", last)
                    config.resume = "auto"
            run(config, dist)
        finally:
            cleanup()

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
