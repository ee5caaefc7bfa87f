"""train_utils/darknet_schedule.py trains as Darknet: the learning rate of every policy equals
``get_current_rate`` of the built AlexeyAB/darknet bit for bit over 1,500 iterations, and three
iterations of forward, backward (models/darknet_loss.py), DarknetSGD and DarknetEMA leave the
weights Darknet's ``train_network`` leaves (tests/darknet_ref/)."""

from __future__ import annotations

import warnings
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg, parse_model_cfg_text
from models.darknet import Darknet
from models.darknet_bn import use_darknet_batchnorm
from models.darknet_loss import darknet_loss, targets_to_truths, yolo_specs
from models.weights import load_darknet_weights, save_weights
from tests.darknet_ref.runs import learning_rates, train_iterations
from train_utils.darknet_schedule import (
    DarknetEMA,
    DarknetSettings,
    DarknetSGD,
    GlibcRandom,
    current_rate,
)

ITERATIONS = 1500
NET = """[net]
batch=64
subdivisions=16
width=32
height=32
channels=3
learning_rate=0.00261
momentum=0.949
decay=0.0005
max_batches=1200
"""
LAYER = """
[convolutional]
filters=4
size=1
activation=linear
"""
POLICIES = {
    "constant": "policy=constant\nburn_in=100\n",
    "step": "policy=step\nstep=97\nscale=0.7\nburn_in=50\npower=2\n",
    "steps": "policy=steps\nsteps=400,800,1100\nscales=.1,.1,3\nburn_in=300\n",
    "exp": "policy=exp\ngamma=0.997\n",
    "poly": "policy=poly\npower=3.3\nburn_in=20\n",  # NaN past max_batches, as Darknet's
    "sigmoid": "policy=sigmoid\ngamma=0.013\nstep=600\n",
    "sgdr": "policy=sgdr\nsgdr_cycle=100\nsgdr_mult=2\nlearning_rate_min=0.0001\nburn_in=30\n",
    "sgdr default cycle": "policy=sgdr\nburn_in=30\n",
    "random": "policy=random\npower=1.5\n",
}
SEED = 7


@pytest.mark.parametrize("policy", POLICIES)
def test_rates_equal_darknets(darknet_harness, tmp_path, policy):
    cfg = tmp_path / "lr.cfg"
    cfg.write_text(NET + POLICIES[policy] + LAYER)
    theirs = learning_rates(darknet_harness, cfg, ITERATIONS, seed=SEED)
    settings = DarknetSettings.from_block(parse_model_cfg(cfg)[0])
    rand = GlibcRandom(SEED).rand
    ours = np.array([current_rate(settings, k, rand) for k in range(ITERATIONS)], np.float32)
    assert len(theirs) == ITERATIONS
    np.testing.assert_array_equal(ours, theirs)
    assert len(np.unique(theirs[np.isfinite(theirs)])) > 3  # the rate does change


def test_glibc_random_is_glibcs():
    """srand(1) and srand(42): the first rand() values glibc gives (man 3 rand's generator)."""
    assert [GlibcRandom(1).rand() for _ in range(1)] == [1804289383]
    g = GlibcRandom(42)
    assert [g.rand() for _ in range(3)] == [71876166, 708592740, 1483128881]


UPDATE_CFG = """[net]
batch=4
subdivisions=2
width=32
height=32
channels=3
learning_rate=0.01
momentum=0.9
decay=0.0005
burn_in=2
policy=steps
steps=3
scales=0.5
max_batches={max_batches}
{ema}

[convolutional]
batch_normalize={bn}
filters=8
size=3
stride=2
pad=1
activation=leaky

[convolutional]
batch_normalize={bn}
filters=8
size=3
stride=1
pad=1
activation=mish

[maxpool]
size=2
stride=2

[convolutional]
size=1
filters=21
activation=linear

[yolo]
mask=0,1,2
anchors=4,6, 8,12, 14,10, 20,24, 28,30, 30,16
classes=2
num=6
iou_loss=ciou
iou_normalizer=0.5
iou_thresh=0.3
"""
UPDATES = 3
SIZE = 32
WEIGHT_TOL = 1e-5
INIT_GAIN = 3.0  # larger initial weights than PyTorch's: larger deltas, weights that move


def _train_case(harness, tmp_path, cfg_text: str, start_iteration: int):
    """(our weights, Darknet's weights, the initial weights) after UPDATES iterations of batch 4
    in 2 subdivisions, from a random model whose .weights header says ``start_iteration``
    (BatchNorm as Darknet's CPU build trains it)."""
    cfg = tmp_path / "u.cfg"
    cfg.write_text(cfg_text)
    torch.manual_seed(0)
    model = Darknet(cfg, img_size=SIZE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "Conv2d" in name:
                p.mul_(INIT_GAIN)
            elif "BatchNorm2d.bias" in name:
                p.add_(0.1)  # Darknet's CPU build never trains it: any value stays
        for name, b in model.named_buffers():
            if "running" in name:
                b.uniform_(0.5, 1.5)
    use_darknet_batchnorm(model, train_shift=False)
    blocks = parse_model_cfg(cfg)
    settings = DarknetSettings.from_block(blocks[0])
    model.seen = start_iteration * settings.update_batch
    save_weights(model, tmp_path / "init.weights")
    rng = np.random.default_rng(1)
    images = rng.uniform(0, 1, (settings.batch, 3, SIZE, SIZE)).astype(np.float32)
    rows = []
    for b in range(settings.batch):
        for _ in range(3):
            x, y, w, h = (float(np.float32(v)) for v in rng.uniform((0.05, 0.05, 0.1, 0.1), 0.9))
            rows.append([b, x, y, w, h, int(rng.integers(0, 2))])
    theirs = train_iterations(
        harness, cfg, tmp_path / "init.weights", images, rows, UPDATES, tmp_path / "out.weights"
    )

    specs = list(yolo_specs(blocks).values())
    targets = torch.tensor([[r[0], r[5], *r[1:5]] for r in rows])
    truths = targets_to_truths(targets, settings.batch, specs[0].max_boxes)
    x = torch.from_numpy(images)
    model.train()
    optimizer = DarknetSGD.for_model(model, settings)
    ema = DarknetEMA(settings.ema_alpha, settings.max_batches)
    mini = settings.mini_batch
    for iteration in range(start_iteration + 1, start_iteration + UPDATES + 1):
        for s in range(settings.subdivisions):
            part = slice(s * mini, (s + 1) * mini)
            loss, _ = darknet_loss(model(x[part]), truths[part], specs, (SIZE, SIZE))
            loss.backward()
        optimizer.set_rate(current_rate(settings, iteration))
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model, iteration)

    darknet = Darknet(cfg, img_size=SIZE)
    load_darknet_weights(darknet, theirs)
    initial = Darknet(cfg, img_size=SIZE)
    load_darknet_weights(initial, tmp_path / "init.weights")
    return model.state_dict(), darknet.state_dict(), initial.state_dict()


@pytest.mark.parametrize("batch_normalize", [0, 1])
def test_three_updates_equal_darknets(darknet_harness, tmp_path, batch_normalize):
    """burn_in then a step of the rate, momentum, decay, subdivisions 2, ciou with iou_thresh,
    leaky and mish, with and without BatchNorm: every weight, bias, BatchNorm scale and running
    statistic as Darknet's after three iterations (BatchNorm shifts stay: Darknet's CPU build
    does not train them)."""
    text = UPDATE_CFG.format(max_batches=10, ema="", bn=batch_normalize)
    ours, theirs, initial = _train_case(darknet_harness, tmp_path, text, 0)
    for name, value in theirs.items():
        if not value.dtype.is_floating_point:
            continue
        err = float((ours[name] - value).abs().max())
        assert err <= WEIGHT_TOL, f"{name} differs by {err:.3g}"
        moved = float((value - initial[name]).abs().max())
        if "BatchNorm2d.bias" in name:
            assert moved == 0, f"{name} trained"
        else:
            assert moved > 1e-3, f"{name} did not train"


ROUTE_LAYERS = """
[convolutional]
batch_normalize=1
filters=8
size=3
stride=2
pad=1
activation=leaky

[convolutional]
batch_normalize=1
filters=8
size=3
stride=1
pad=1
activation=leaky

[convolutional]
batch_normalize=1
filters=8
size=3
stride=1
pad=1
activation=leaky

[route]
layers=-1,-2

[convolutional]
batch_normalize=1
filters=16
size=1
stride=1
pad=1
activation=leaky

[route]
layers=-1
groups=2
group_id=1

[convolutional]
batch_normalize=1
filters=8
size=3
stride=1
pad=1
activation=leaky

[route]
layers=-1,-3

[convolutional]
size=1
filters=21
activation=linear

[yolo]
mask=0,1,2
anchors=4,6, 8,12, 14,10, 20,24, 28,30, 30,16
classes=2
num=6
"""


def _route_case(harness, tmp_path):
    """UPDATE_CFG's [net] with yolov4-tiny's routes: layer 1 feeds both a convolution and a
    concatenating [route], a grouped [route] halves a layer, and a [route] joins two."""
    net = UPDATE_CFG.format(max_batches=10, ema="", bn=1)
    text = net[: net.index("[convolutional]")] + ROUTE_LAYERS
    return _train_case(harness, tmp_path, text, 0)


def test_updates_through_routes_equal_darknets_with_7320_fixed(darknet_harness_fixed, tmp_path):
    """Three updates of a network with [route]s equal Darknet's once AlexeyAB/darknet#7320 is
    fixed: the gradient a [route] passes back is added to what the next convolution passes."""
    ours, theirs, _ = _route_case(darknet_harness_fixed, tmp_path)
    for name, value in theirs.items():
        if value.dtype.is_floating_point:
            err = float((ours[name] - value).abs().max())
            assert err <= WEIGHT_TOL, f"{name} differs by {err:.3g}"


def test_darknets_cpu_build_as_released_drops_the_gradient_of_routes(darknet_harness, tmp_path):
    """Why the fix: as released, Darknet's CPU col2im zeroes layer 1's delta before adding
    conv 2's gradient, so the concatenating [route]'s share is lost and layer 0 and 1 train on a
    different gradient. When this fails, Darknet has fixed #7320 and tests/darknet_ref/build.py
    can stop patching."""
    ours, theirs, initial = _route_case(darknet_harness, tmp_path)
    name = "module_list.1.Conv2d.weight"
    moved = float((theirs[name] - initial[name]).abs().max())
    assert float((ours[name] - theirs[name]).abs().max()) > 0.1 * moved


def test_ema_equals_darknets(darknet_harness, tmp_path):
    """ema_alpha: averaging starts at max_batches / 2 (iteration 1002 here) and is written into
    the weights at max_batches - 1000 (1004): the weights after iteration 1004 are the average
    of 1002..1004, not the last ones."""
    text = UPDATE_CFG.format(max_batches=2004, ema="ema_alpha=0.5", bn=1)
    ours, theirs, _ = _train_case(darknet_harness, tmp_path, text, 1001)
    for name, value in theirs.items():
        if value.dtype.is_floating_point:
            err = float((ours[name] - value).abs().max())
            assert err <= WEIGHT_TOL, f"{name} differs by {err:.3g}"
    (tmp_path / "plain").mkdir()
    plain = UPDATE_CFG.format(max_batches=2004, ema="", bn=1)
    last, _, _ = _train_case(darknet_harness, tmp_path / "plain", plain, 1001)
    moved = max(float((last[k] - v).abs().max()) for k, v in theirs.items() if "weight" in k)
    assert moved > 1e-3, "the EMA changed nothing: the test proves nothing"


def test_update_rule_by_hand():
    """One step: u = -g - decay * batch * w; w += rate / batch * u; then u *= momentum."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = DarknetSGD([{"params": [w], "decay": True}], rate=0.1, momentum=0.9, decay=0.01, batch=4)
    w.grad = torch.tensor([0.5, 0.25])
    opt.step()
    u = -w.grad - 0.01 * 4 * torch.tensor([1.0, -2.0])
    assert torch.allclose(w.detach(), torch.tensor([1.0, -2.0]) + 0.1 / 4 * u)
    assert torch.allclose(opt.state[w]["weight_updates"], 0.9 * u)


@pytest.mark.parametrize(
    "net, message",
    [
        ("policy=cosine", r"policy=cosine is not one of"),
        ("policy=steps\nsteps=10,20\nscales=.1", r"scales lists 1 values for 2 steps"),
        ("policy=steps", r"policy=steps needs steps= and scales="),
        ("policy=steps\nsteps=30,20\nscales=.1,.1", r"steps must not decrease: 20 comes after"),
        ("batch=2\nsubdivisions=4", r"batch=2 must be at least subdivisions=4 \(each pass"),
        ("batch=8\nsubdivisions=0", r"subdivisions=0 must be at least 1$"),
        ("burn_in=-5", r"burn_in=-5 must be at least 0$"),
        ("policy=sgdr", r"policy=sgdr needs sgdr_cycle >= 1"),
        ("policy=step\nstep=0", r"n.cfg:\d+: \[net\]: policy=step needs step >= 1 .*got 0"),
        ("learning_rate=1e39", r"learning_rate=1e\+39 is beyond float32's range"),
        ("learning_rate=-0.01", r"learning_rate=-0.01 must be at least 0 \(a negative rate"),
        ("policy=steps\nsteps=10,20\nscales=.1,-1", r"scales=-1 must be at least 0"),
        ("momentum=1.5", r"momentum=1.5 must be in \[0, 1\]"),
        ("decay=-0.0005", r"decay=-0.0005 must be in \[0, 1\]"),
        ("batches_per_cycle=100", r"'batches_per_cycle' .* not Darknet's .* write sgdr_cycle=100"),
    ],
)
def test_bad_net_keys_are_refused(net, message):
    text = "[net]\nwidth=32\nheight=32\n" + net + "\n" + LAYER
    # The one line only: no numpy overflow warning before it (learning_rate=1e39).
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=message):
        warnings.simplefilter("error")
        DarknetSettings.from_block(parse_model_cfg_text(text, Path("n.cfg"))[0])


def test_sigmoid_rate_falls_to_zero_where_exp_overflows():
    """Darknet's exp() gives inf far past the sigmoid's step (rate 0); Python's raises."""
    text = NET + "policy=sigmoid\ngamma=1\nstep=10\n" + LAYER
    settings = DarknetSettings.from_block(parse_model_cfg_text(text, Path("n.cfg"))[0])
    assert current_rate(settings, 1000) == 0.0
    assert current_rate(settings, 10) == float(np.float32(0.00261) * np.float32(0.5))


def test_for_gpus_multiplies_the_rate_as_train_detector():
    settings = DarknetSettings.from_block(parse_model_cfg_text(NET + LAYER, Path("n.cfg"))[0])
    assert settings.for_gpus(4).learning_rate == float(np.float32(0.00261) * np.float32(4))
    assert settings.for_gpus(1) == settings


def test_honoured_keys_are_keys_parse_config_reads():
    """The key lists a recipe warns against are spelled as the cfg spells them."""
    from build_utils.parse_config import KEYS
    from models.darknet_loss import YOLO_KEYS_HONOURED

    # DarknetSettings' fields are each named as the [net] key it reads.
    assert {f.name for f in fields(DarknetSettings)} <= set(KEYS["net"])
    assert set(YOLO_KEYS_HONOURED) <= set(KEYS["yolo"])
