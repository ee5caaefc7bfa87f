"""Train a Darknet-cfg YOLO model in one process, on one GPU or on the CPU.

    python train.py --cfg cfg/yolov3-spp.cfg --data data/my_data.data --weights weights/x.pt
    python train.py --data demo_data/shapes/shapes.data --cfg cfg/yolov3-spp-nano.cfg --device cpu
    python train.py --resume runs/exp/last.pt    # continue that run exactly, with its own flags
    python train.py ... --resume --name exp      # continue runs/exp/last.pt exactly
    python train.py ... --name exp               # runs/exp2 when runs/exp holds a run
    python train.py ... --name exp --exist-ok    # runs/exp, its old run moved to replaced-<time>/
    python train.py --device 0,1 ...             # DDP, one spawned process per listed GPU

A GPU list spawns one DDP process per GPU on this node, as ``train_multi_GPU.py --device 0,1``
does (nn.DataParallel is not offered). Started by torchrun or srun with several processes
(``torchrun --nproc_per_node=N train.py``, YOLOv5's command) it joins their DDP run as
``train_multi_GPU.py`` does; for several nodes, CPU processes or the launcher's time-out flags use
``train_multi_GPU.py`` (``--nproc-per-node N``, ``--dist-timeout``) with the same flags; all run
the same loop (``train_utils/trainer.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from train_utils.cli import run_script
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.devices import select_device
from train_utils.distributed.launch import processes_to_spawn, spawn_training, train_distributed
from train_utils.distributed.process_group import DistInfo, launched_world_size
from train_utils.evolve.search import evolve, is_search
from train_utils.trainer import run


def train(args: argparse.Namespace) -> None:
    if launched_world_size() > 1:
        # `torchrun --nproc_per_node N train.py` (YOLOv5's DDP command): the one DDP run of
        # train_multi_GPU.py, not N separate runs racing for one folder.
        train_distributed(args)
        return
    nprocs = processes_to_spawn(None, args.device, os.environ)
    if nprocs:
        spawn_training(args, nprocs)
        return
    if is_search(args):
        evolve(args, None)  # the device is the search's (its record's, when continued)
        return
    config = build_config(args)
    run(config, DistInfo.single(select_device(config.device)))


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), train, argv)


if __name__ == "__main__":
    sys.exit(main())
