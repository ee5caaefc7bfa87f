"""What DDP costs per training step, in a real 2-process gloo group: every rank trains at the
same multi-scale size at each step, and gradient accumulation all-reduces once per optimizer
step (``no_sync`` on the other micro-batches) with the same result as all-reducing each one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from train_utils.engine import multi_scale_size

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

WORKER = textwrap.dedent(
    """
    import json
    import random
    import sys
    from contextlib import nullcontext
    from pathlib import Path

    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from models.darknet import Darknet
    from models.loss import scale_loss_gains
    from train_utils.distributed import process_group
    from train_utils import engine
    from models.darknet import model_blocks_for
    from train_utils.config import load_hyp
    from train_utils.optim import build_optimizer, build_scheduler

    out = Path(sys.argv[1])
    info = process_group.init_distributed_mode(None, timeout_s=120)
    r = info.rank
    NB, ACCUMULATE, SIZE = 6, 3, 64
    hyp = scale_loss_gains(load_hyp("cfg/hyp.yaml"), 1, SIZE)

    def batches():
        g = torch.Generator().manual_seed(100 + r)  # each rank its own data
        for i in range(NB):
            imgs = torch.randint(0, 255, (2, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
            targets = torch.tensor([[0, 0, 0.5, 0.5, 0.3, 0.4], [1, 0, 0.3, 0.6, 0.2, 0.2]])
            yield imgs, targets, [f"r{r}_{i}_a", f"r{r}_{i}_b"], None, None

    def train(no_sync: bool, multi_scale):
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
        opts = engine.TrainOptions(torch.device("cpu"), hyp, accumulate=ACCUMULATE,
                                multi_scale=multi_scale, seed=7, log_interval=NB)
        random.seed(r)  # the old per-rank stream: sizes would differ by rank
        saved = engine._no_sync
        if not no_sync:
            engine._no_sync = lambda model: nullcontext()
        try:
            engine.train_one_epoch(state, list(batches()), 1, opts)
        finally:
            engine._no_sync = saved
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        return params, len(synced), sizes

    p_sync, n_sync, sizes = train(True, (64, 128))
    p_all, n_all, _ = train(False, None)
    p_sync2, _, _ = train(True, None)
    res = {
        "sizes": sizes,
        "allreduces_no_sync": n_sync,
        "allreduces_every_batch": n_all,
        "max_param_diff": float((p_sync2 - p_all).abs().max()),
        "param_scale": float(p_all.abs().max()),
    }
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_scale_size_depends_on_seed_epoch_and_step_only() -> None:
    sizes = [multi_scale_size((64, 192), 0, 1, step) for step in range(200)]
    assert sizes == [multi_scale_size((64, 192), 0, 1, step) for step in range(200)]
    assert set(sizes) == {64, 96, 128, 160, 192}
    assert sizes != [multi_scale_size((64, 192), 0, 2, step) for step in range(200)]
    assert sizes != [multi_scale_size((64, 192), 1, 1, step) for step in range(200)]


@pytest.mark.slow
def test_ranks_share_sizes_and_all_reduce_once_per_optimizer_step(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_"))}
        env.update(
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # 9: the same size on both ranks at every step, constant within an accumulation window.
    assert res[0]["sizes"] == res[1]["sizes"]
    assert res[0]["sizes"] == [multi_scale_size((64, 128), 7, 1, i // 3) for i in range(6)]
    # 10: 6 micro-batches, accumulate 3: 2 gradient all-reduces instead of 6, same weights.
    for got in res:
        assert got["allreduces_no_sync"] == 2
        assert got["allreduces_every_batch"] == 6
        assert got["max_param_diff"] <= 1e-6 * max(1.0, got["param_scale"])
