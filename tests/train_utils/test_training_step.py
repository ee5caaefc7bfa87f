"""The pieces of a training step: optimizer groups, warm-up, the step at the epoch's end, EMA,
the cosine schedule and freezing, each against values computed independently here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import host_syncs
from torch import nn

from build_utils.errors import ConfigError
from models.darknet import Darknet, backbone_end, frozen_layer_indices, index_ranges
from models.loss import scale_loss_gains
from train_utils.config import load_hyp
from train_utils.ema import ModelEMA
from train_utils.engine import (
    WARMUP_START_FACTOR,
    TrainOptions,
    TrainState,
    train_one_epoch,
    warmup_lr,
)
from train_utils.optim import build_optimizer, build_scheduler, lr_lambda

REPO = Path(__file__).resolve().parents[2]
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
CPU = torch.device("cpu")
SIDE = 64


@pytest.fixture(scope="module")
def hyp() -> dict:
    return scale_loss_gains(load_hyp(REPO / "cfg" / "hyp.yaml"), 80, SIDE)


def _batches(n: int, bs: int = 2) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b in range(n):
        imgs = torch.randint(0, 256, (bs, 3, SIDE, SIDE), dtype=torch.uint8, generator=g)
        targets = torch.tensor([[i, i % 3, 0.5, 0.5, 0.3, 0.4] for i in range(bs)])
        out.append((imgs, targets, [f"img{b}_{i}.jpg" for i in range(bs)], None, None))
    return out


class _Recorder:
    """Wraps ``optimizer.step`` to record every group's learning rate at each step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.lrs: list[dict[str, float]] = []
        real = optimizer.step

        def step(*args, **kwargs):
            self.lrs.append({g["name"]: g["lr"] for g in optimizer.param_groups})
            return real(*args, **kwargs)

        optimizer.step = step


def _state(hyp: dict, lr0: float = 0.01, epochs: int = 3) -> TrainState:
    torch.manual_seed(0)
    model = Darknet(NANO, img_size=SIDE)
    optimizer = build_optimizer(model, hyp, lr0)
    return TrainState(model, model, optimizer, build_scheduler(optimizer, epochs, hyp["lrf"]))


def test_optimizer_groups(hyp) -> None:
    model = Darknet(NANO, img_size=SIDE)
    opt = build_optimizer(model, hyp, 0.01)
    groups = {g["name"]: g for g in opt.param_groups}
    assert list(groups) == ["bn", "weights", "bias"]
    bn = [m.weight for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    for name, expected in (("bn", bn), ("weights", convs), ("bias", biases)):
        assert {id(p) for p in groups[name]["params"]} == {id(p) for p in expected}, name
    assert groups["weights"]["weight_decay"] == hyp["weight_decay"] > 0
    assert groups["bn"]["weight_decay"] == groups["bias"]["weight_decay"] == 0
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"]
    assert opt.defaults["momentum"] == hyp["momentum"]
    n_all = sum(1 for _ in model.parameters())
    assert sum(len(g["params"]) for g in opt.param_groups) == n_all

    adam = build_optimizer(model, hyp, 0.001, "adam")
    assert isinstance(adam, torch.optim.Adam) and adam.defaults["betas"] == (hyp["momentum"], 0.999)
    with pytest.raises(ConfigError, match="unknown --optimizer 'lion'"):
        build_optimizer(model, hyp, 0.01, "lion")


def test_frozen_parameters_are_held_but_never_stepped(hyp) -> None:
    """The optimizer holds every parameter (so its state fits any freeze on resume); frozen ones
    get no gradient, so a step leaves them, and their state, untouched."""
    model = Darknet(NANO, img_size=SIDE)
    frozen = model.freeze("backbone")
    opt = build_optimizer(model, hyp, 0.01)
    sizes = [len(g["params"]) for g in opt.param_groups]
    unfrozen = build_optimizer(Darknet(NANO, img_size=SIDE), hyp, 0.01)
    assert sizes == [len(g["params"]) for g in unfrozen.param_groups]
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model.train()
    out = model(torch.rand(2, 3, SIDE, SIDE))
    sum(o.float().mean() for o in out).backward()
    opt.step()
    for i, m in enumerate(model.module_list):
        for p in m.parameters():
            if i in frozen:
                assert p.grad is None and p not in opt.state and torch.equal(p, before[id(p)]), i


def test_warmup_lr_values() -> None:
    assert warmup_lr(0.01, 0, 100) == pytest.approx(0.01 * WARMUP_START_FACTOR)
    assert warmup_lr(0.01, 50, 100) == pytest.approx((0.01 * WARMUP_START_FACTOR + 0.01) / 2)
    assert warmup_lr(0.01, 100, 100) == warmup_lr(0.01, 500, 100) == 0.01
    # Bias warm-up falls from a high start to the scheduled rate.
    assert warmup_lr(0.01, 0, 100, start=0.1) == 0.1
    assert warmup_lr(0.01, 25, 100, start=0.1) == pytest.approx(0.1 - 0.09 * 0.25)
    assert warmup_lr(0.01, 0, 0) == 0.01  # no warm-up


# _Recorder wraps optimizer.step after the scheduler was made, which torch warns about.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_warm_up_and_bias_warm_up_inside_train_one_epoch(hyp) -> None:
    """nb=3, warm-up over 4 iterations spanning two epochs: every step's group rates equal the
    linear ramp computed here from the scheduled rate of that epoch."""
    hyp = {**hyp, "warmup_bias_lr": 0.1}
    state = _state(hyp)
    rec = _Recorder(state.optimizer)
    opts = TrainOptions(CPU, hyp, accumulate=1, warmup_iters=4, log_interval=1)
    expected = []
    for epoch in range(2):
        base = state.scheduler.get_last_lr()
        for i in range(3):
            ni = i + 3 * epoch
            weights = warmup_lr(base[1], ni, 4)
            expected.append(
                {
                    "bn": warmup_lr(base[0], ni, 4),
                    "weights": weights,
                    "bias": warmup_lr(base[2], ni, 4, start=0.1),
                }
            )
        stats = train_one_epoch(state, _batches(3), epoch, opts)
        state.scheduler.step()
        assert stats.lr == expected[-1]["bn"]
    assert len(rec.lrs) == 6
    for got, want in zip(rec.lrs, expected):
        assert got == pytest.approx(want)
    assert rec.lrs[0]["weights"] == pytest.approx(0.01 * WARMUP_START_FACTOR)
    assert rec.lrs[0]["bias"] == pytest.approx(0.1)
    # After warm-up: the scheduled rate of epoch 1, for every group.
    sched = 0.01 * lr_lambda(3, hyp["lrf"])(1)
    assert rec.lrs[-1] == pytest.approx({"bn": sched, "weights": sched, "bias": sched})


def test_the_optimizer_also_steps_at_the_last_batch_of_the_epoch(hyp) -> None:
    state = _state(hyp)
    rec = _Recorder(state.optimizer)
    opts = TrainOptions(CPU, hyp, accumulate=2, warmup_iters=0, log_interval=1)
    stats = train_one_epoch(state, _batches(5), 0, opts)
    # Steps after batches 2 and 4 (accumulate) and 5 (the epoch's end): nothing left pending.
    assert len(rec.lrs) == 3
    assert all(p.grad is None for p in state.model.parameters())
    assert stats.images == 10 and math.isfinite(stats.loss)


def test_an_epoch_waits_for_the_device_only_to_log_and_at_its_end(hyp) -> None:
    """What would make the host wait for a GPU, counted on the CPU: the loss, backward, the
    optimizer, EMA, warm-up and accumulation never do; the losses are read every log_interval
    iterations and once at the epoch's end."""
    state = _state(hyp)
    state.ema = ModelEMA(state.model)
    quiet = TrainOptions(CPU, hyp, accumulate=2, warmup_iters=3, log_interval=100)
    assert host_syncs(lambda: train_one_epoch(state, _batches(5), 0, quiet)) == [
        "aten::_local_scalar_dense"
    ]
    logging = TrainOptions(CPU, hyp, accumulate=1, log_interval=2)
    assert len(host_syncs(lambda: train_one_epoch(state, _batches(5), 1, logging))) == 2 + 1


def test_cosine_schedule() -> None:
    f = lr_lambda(10, 0.1)
    assert f(0) == 1.0 and f(10) == pytest.approx(0.1) and f(5) == pytest.approx(0.55)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.2)
    sched = build_scheduler(opt, 10, 0.1)
    for _ in range(5):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.2 * 0.55)


def test_ema_follows_the_ramped_decay() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEMA(model, decay=0.9, tau=2.0)
    assert all(not p.requires_grad for p in ema.ema.parameters()) and not ema.ema.training
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
        model[1].num_batches_tracked += 1
        ema.update(model)
        d = 0.9 * (1 - math.exp(-step / 2.0))
        assert ema.decay_at(step) == pytest.approx(d)
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                expected[k] = d * expected[k] + (1 - d) * v
            else:
                expected[k] = v.clone()  # counters are copied, not averaged
    for k, v in ema.ema.state_dict().items():
        assert torch.allclose(v, expected[k], atol=1e-6), k
    assert ema.updates == 3


def test_backbone_end_is_darknet53s_last_shortcut() -> None:
    # Layer 74 of yolov3.cfg: the lineage's magic "cutoff 74" (darknet53.conv.74).
    for cfg in ("yolov3.cfg", "yolov3-spp.cfg"):
        assert backbone_end(Darknet(REPO / "cfg" / cfg)) == 74, cfg
    nano = Darknet(NANO)
    assert nano.module_defs[backbone_end(nano)]["type"] == "shortcut"
    # No residual blocks and no [route] before the first head (yolov3-tiny): everything before
    # the head's convolution, i.e. Darknet's yolov3-tiny.conv.15 (layers 0-14).
    tiny = Darknet(REPO / "cfg" / "yolov3-tiny.cfg")
    assert min(tiny.yolo_layers) == 16 and backbone_end(tiny) == 14
    assert frozen_layer_indices(tiny, "backbone") == list(range(15))
    heads_in = {i - 1 for i in tiny.yolo_layers}
    # The heads' convolutions train, and the [yolo] layers are never frozen (in eval mode they
    # would decode boxes during training).
    assert set(frozen_layer_indices(tiny, "all-but-heads")) == (
        set(range(len(tiny.module_list))) - heads_in - set(tiny.yolo_layers)
    )
    tiny.freeze("all-but-heads")
    tiny.train()
    assert all(tiny.module_list[i].training for i in tiny.yolo_layers)
    assert isinstance(tiny(torch.rand(1, 3, 64, 64)), list)  # raw outputs for the loss
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and index_ranges([]) == ""
    assert frozen_layer_indices(tiny, "none") == []
    with pytest.raises(ConfigError, match="unknown freeze mode 'neck'"):
        tiny.freeze("neck")


def test_a_dropout_before_a_head_leaves_the_heads_convolution_training(tmp_path) -> None:
    """Was: all-but-heads and backbone took the layer just before a [yolo] for its convolution;
    with a [dropout] in between (as head_conv_index allows) the head's convolution was frozen
    and the dropout trained."""
    text = (REPO / "cfg" / "yolov3-tiny.cfg").read_text()
    text = text.replace("[yolo]", "[dropout]\nprobability=0.1\n\n[yolo]")
    cfg = tmp_path / "tiny-dropout.cfg"
    cfg.write_text(text)
    model = Darknet(cfg)
    assert min(model.yolo_layers) == 17 and model.module_defs[16]["type"] == "dropout"
    trained = {j for i in model.yolo_layers for j in (i - 2, i - 1, i)}  # conv, dropout, yolo
    assert set(frozen_layer_indices(model, "all-but-heads")) == (
        set(range(len(model.module_list))) - trained
    )
    assert backbone_end(model) == 14  # as yolov3-tiny's: layers 0-14, not its head conv (15)


def test_frozen_batchnorm_stays_in_eval_and_keeps_its_statistics() -> None:
    torch.manual_seed(0)
    model = Darknet(NANO, img_size=SIDE)
    frozen = model.freeze("backbone")
    assert frozen == list(range(backbone_end(model) + 1))
    model.train()
    first = model.module_list[0]
    assert not first.training and model.module_list[frozen[-1] + 1].training
    before = first.BatchNorm2d.running_mean.clone()
    model(torch.rand(2, 3, SIDE, SIDE))
    assert torch.equal(first.BatchNorm2d.running_mean, before)
    assert all(not p.requires_grad for i in frozen for p in model.module_list[i].parameters())
    # A copy (the EMA's) keeps the frozen set.
    copy = ModelEMA(model).ema
    copy.train()
    assert not copy.module_list[0].training
