"""One rank of a 2-process gloo group (torchrun's variables) training 6 micro-batches with
accumulation 3 three ways: with ``no_sync`` and multi-scale, all-reducing every micro-batch, and
with ``no_sync`` again at one size. Writes ``OUT/rank<r>.json`` with the input sizes, the number
of gradient all-reduces and the largest weight difference between the last two, for
tests/scenarios/test_ddp_steps.py. Run from the repository root (it reads cfg/).

Usage: python -m tests.workers.ddp_steps_worker OUT
"""

from __future__ import annotations

import json
import random
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from models.darknet import Darknet, model_blocks_for
from models.loss import scale_loss_gains
from train_utils import engine
from train_utils.config import load_hyp
from train_utils.distributed import process_group
from train_utils.optim import build_optimizer, build_scheduler

NB, ACCUMULATE, SIZE = 6, 3, 64


def _batches(r: int):
    g = torch.Generator().manual_seed(100 + r)  # each rank its own data
    for i in range(NB):
        imgs = torch.randint(0, 255, (2, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
        targets = torch.tensor([[0, 0, 0.5, 0.5, 0.3, 0.4], [1, 0, 0.3, 0.6, 0.2, 0.2]])
        yield imgs, targets, [f"r{r}_{i}_a", f"r{r}_{i}_b"], None, None


def _train(r: int, hyp: dict, no_sync: bool, multi_scale):
    torch.manual_seed(0)
    model = Darknet(model_blocks_for("cfg/yolov3-spp-nano.cfg", 1), img_size=(SIZE, SIZE))
    sizes = []
    model.register_forward_pre_hook(lambda m, a: sizes.append(a[0].shape[-1]))
    optimizer = build_optimizer(model, hyp, 0.01)
    state = engine.TrainState(model, model, optimizer, build_scheduler(optimizer, 2, 0.1))
    ddp = nn.parallel.DistributedDataParallel(model)
    synced = []

    def counting_allreduce(state, bucket):
        # One call per bucket; the last bucket ends one gradient all-reduce.
        if bucket.is_last():
            synced.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    state.model = ddp
    opts = engine.TrainOptions(
        torch.device("cpu"),
        hyp,
        accumulate=ACCUMULATE,
        multi_scale=multi_scale,
        seed=7,
        log_interval=NB,
    )
    random.seed(r)  # the old per-rank stream: sizes would differ by rank
    saved = engine._no_sync
    if not no_sync:
        engine._no_sync = lambda model: nullcontext()
    try:
        engine.train_one_epoch(state, list(_batches(r)), 1, opts)
    finally:
        engine._no_sync = saved
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, len(synced), sizes


def main(argv: list[str] | None = None) -> None:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    info = process_group.init_distributed_mode(None, timeout_s=120)
    r = info.rank
    hyp = scale_loss_gains(load_hyp("cfg/hyp.yaml"), 1, SIZE)
    _, n_sync, sizes = _train(r, hyp, True, (64, 128))
    p_all, n_all, _ = _train(r, hyp, False, None)
    p_sync2, _, _ = _train(r, hyp, True, None)
    res = {
        "sizes": sizes,
        "allreduces_no_sync": n_sync,
        "allreduces_every_batch": n_all,
        "max_param_diff": float((p_sync2 - p_all).abs().max()),
        "param_scale": float(p_all.abs().max()),
    }
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
