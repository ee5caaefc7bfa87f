"""models/darknet_loss.py computes Darknet's [yolo] layer: ``l.delta`` and ``*l.cost`` of
``forward_yolo_layer`` equal those of the built AlexeyAB/darknet (tests/darknet_ref/) on real
cfgs and on every training key, to 1e-4.

Each case also checks that it exercises what it names (the key changes the delta on this input,
the scenario's anchor is trained), so that a loss ignoring the key could not pass."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import host_syncs

from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg
from models.budget import estimate_model
from models.darknet import Darknet
from models.darknet_loss import (
    DarknetLoss,
    YoloLossSpec,
    darknet_loss,
    darknet_yolo_loss,
    head_input,
    targets_to_truths,
    yolo_delta,
    yolo_specs,
)
from tests.darknet_ref.runs import rewrite_cfg, yolo_deltas

REPO = Path(__file__).resolve().parents[2]
DARKNET_CFGS = REPO / "cfg" / "darknet"
SIZE = 128  # small inputs: grids of 4 to 16 cells
BATCH = 2
DELTA_TOL = 1e-4
COST_RTOL = 1e-5
# Raw inputs ~ N(0, 1.5): probabilities spread over (0, 1), boxes from tiny to large.
INPUT_STD = 1.5


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x))).astype(np.float32)


def _f32(values) -> list[float]:
    return [float(np.float32(v)) for v in values]


def random_truths(rng: np.random.Generator, per_image: int, classes: int) -> list[list[float]]:
    """``per_image`` boxes per image of the batch, float32 values (as Darknet reads them)."""
    rows = []
    for b in range(BATCH):
        for _ in range(per_image):
            x, y = rng.uniform(0.02, 0.98, 2)
            w, h = rng.uniform(0.01, 0.7, 2)
            rows.append([b, *_f32((x, y, w, h)), int(rng.integers(0, classes))])
    return rows


def layer_inputs(
    cfg: Path, rng: np.random.Generator, class_offset: float = 0.0
) -> dict[int, np.ndarray]:
    """A random float32 input for every [yolo] layer of ``cfg`` at its size (new_coords layers:
    in (0, 1), after the logistic of the conv below, as Darknet feeds them), the class logits
    shifted by ``class_offset``."""
    blocks = parse_model_cfg(cfg)
    est = estimate_model(blocks, (blocks[0]["height"], blocks[0]["width"]))
    out = {}
    for layer, spec in yolo_specs(blocks).items():
        c, h, w = est.layers[layer - 1].shape
        x = rng.normal(0, INPUT_STD, (BATCH, c, h, w)).astype(np.float32)
        per_anchor = x.reshape(BATCH, spec.na, 5 + spec.classes, h, w)
        per_anchor[:, :, 5:] += class_offset
        out[layer] = _sigmoid(x) if spec.new_coords else x
    return out


def truths_tensor(rows: list[list[float]], batch: int = BATCH) -> torch.Tensor:
    targets = torch.tensor([[r[0], r[5], *r[1:5]] for r in rows], dtype=torch.float32)
    return targets_to_truths(targets, batch, max_boxes=1000)


def our_deltas(cfg: Path, rows, inputs) -> dict[int, tuple[np.ndarray, float, int]]:
    blocks = parse_model_cfg(cfg)
    specs = yolo_specs(blocks)
    net = (blocks[0]["height"], blocks[0]["width"])
    out = {}
    for layer, x in inputs.items():
        r = yolo_delta(torch.from_numpy(x), truths_tensor(rows), specs[layer], net)
        out[layer] = (r.delta.numpy(), float(r.cost), int(r.count))
    return out


def assert_same_as_darknet(ours, theirs) -> None:
    for layer, (delta, cost, _) in ours.items():
        ref, ref_cost = theirs[layer]
        err = float(np.abs(delta - ref).max())
        assert err <= DELTA_TOL, f"layer {layer}: delta differs by {err:.3g}"
        assert math.isclose(cost, ref_cost, rel_tol=COST_RTOL, abs_tol=1e-5), (
            layer,
            cost,
            ref_cost,
        )


def compare(harness, tmp_path, src, yolo=None, seed=0, per_image=8, rows=None, class_offset=0.0):
    """Our and Darknet's deltas of every [yolo] layer of ``src`` (at SIZE, with ``yolo`` keys),
    after checking they agree; ours are returned."""
    cfg = rewrite_cfg(src, tmp_path / f"{src.stem}.cfg", SIZE, yolo)
    rng = np.random.default_rng(seed)
    inputs = layer_inputs(cfg, rng, class_offset)
    if rows is None:
        classes = next(iter(yolo_specs(parse_model_cfg(cfg)).values())).classes
        rows = random_truths(rng, per_image, classes)
    ours = our_deltas(cfg, rows, inputs)
    assert_same_as_darknet(ours, yolo_deltas(harness, cfg, rows, inputs, tmp_path))
    return ours


@pytest.mark.parametrize(
    "name", ["yolov3.cfg", "yolov3-tiny.cfg", "yolov4.cfg", "yolov4-tiny.cfg", "yolov4-csp.cfg"]
)
def test_real_cfgs_match_darknet(darknet_harness, tmp_path, name):
    """Each cfg's own [yolo] keys (yolov4: ciou, iou_thresh, scale_x_y, max_delta;
    yolov4-csp: new_coords, objectness_smooth off, scale_x_y 2)."""
    ours = compare(darknet_harness, tmp_path, DARKNET_CFGS / name)
    assert sum(count for _, _, count in ours.values()) > 0


TINY = DARKNET_CFGS / "yolov3-tiny.cfg"
KEY_CASES = {
    "iou_loss=giou": {"iou_loss": "giou"},
    "iou_loss=diou": {"iou_loss": "diou"},
    "iou_loss=ciou": {"iou_loss": "ciou"},
    "iou_loss=iou": {"iou_loss": "iou"},
    "iou_thresh iou": {"iou_thresh": 0.2},
    "iou_thresh giou": {"iou_thresh": 0.1, "iou_thresh_kind": "giou"},
    "iou_thresh diou": {"iou_thresh": 0.1, "iou_thresh_kind": "diou"},
    "iou_thresh ciou": {"iou_thresh": 0.2, "iou_thresh_kind": "ciou", "iou_loss": "ciou"},
    "ignore_thresh": {"ignore_thresh": 0.1},
    "truth_thresh": {"truth_thresh": 0.3},
    "objectness_smooth": {"objectness_smooth": 1, "ignore_thresh": 0.1, "truth_thresh": 0.3},
    "label_smooth_eps": {"label_smooth_eps": 0.1},
    "focal_loss": {"focal_loss": 1},
    "max_delta": {"max_delta": 0.3, "iou_loss": "ciou"},
    "scale_x_y": {"scale_x_y": 1.05},
    "normalizers": {"iou_normalizer": 0.07, "obj_normalizer": 1.5, "cls_normalizer": 2.0},
    "counters_per_class": {
        "counters_per_class": ",".join(str(7 * k + 1) for k in range(80)),
        "cls_normalizer": 2.0,
        "max_delta": 20,
    },
    "max": {"max": 3},
    "show_details=0": {"show_details": 0, "iou_loss": "giou"},
}
# Class logits lowered so that only some predictions have a class probability above 0.25, the
# condition Darknet adds to ignore_thresh.
CLASS_OFFSETS = {"ignore_thresh": -5.0, "objectness_smooth": -5.0}


@pytest.mark.parametrize("case", KEY_CASES)
def test_yolo_keys_match_darknet(darknet_harness, tmp_path, case):
    """yolov3-tiny with one key changed, 10 truths an image (some share a cell and an anchor)."""
    keys, offset = KEY_CASES[case], CLASS_OFFSETS.get(case, 0.0)
    ours = compare(darknet_harness, tmp_path, TINY, keys, 1, 10, class_offset=offset)
    (tmp_path / "default").mkdir()
    default = compare(darknet_harness, tmp_path / "default", TINY, {}, 1, 10, class_offset=offset)
    changed = any(
        not np.array_equal(ours[k][0], default[k][0]) or ours[k][1] != default[k][1] for k in ours
    )
    assert changed, f"{case} changes nothing on this input: the case proves nothing"


# yolov3-tiny: anchors 10,14 23,27 37,58 81,82 135,169 344,319; layer 16 masks 3,4,5, layer 23
# masks 0,1,2 (Darknet's layer indices).
COARSE, FINE = 16, 23


def _anchor_box(k: int, x: float, y: float) -> list[float]:
    anchors = [(10, 14), (23, 27), (37, 58), (81, 82), (135, 169), (344, 319)]
    w, h = anchors[k]
    return _f32((x, y, w / SIZE, h / SIZE))


def _trained(delta: np.ndarray, image: int, anchor: int, row: int, col: int) -> np.ndarray:
    """The (4 box, objectness, classes) deltas of one prediction of a tiny head (85 channels an
    anchor)."""
    return delta[image, anchor * 85 : (anchor + 1) * 85, row, col]


def test_two_truths_in_one_cell_match_darknet(darknet_harness, tmp_path):
    """Two truths of different classes on one anchor and cell: box deltas accumulate, then are
    averaged over the two trained classes (iou_thresh < 1); two of one class add up."""
    cell = (0.40, 0.40)  # cell (3, 3) of the 8x8 head
    rows = [
        [0, *_anchor_box(1, *cell), 2],
        [0, *_f32((0.41, 0.42, 24 / SIZE, 25 / SIZE)), 5],
        [1, *_anchor_box(1, *cell), 4],
        [1, *_f32((0.43, 0.39, 22 / SIZE, 29 / SIZE)), 4],
    ]
    ours = compare(darknet_harness, tmp_path, TINY, {"iou_thresh": 0.9}, rows=rows)
    delta = ours[FINE][0]
    two_classes = _trained(delta, 0, 1, 3, 3)
    assert (two_classes[5:] > 0).sum() == 2  # classes 2 and 5 both trained there
    assert (_trained(delta, 1, 1, 3, 3)[5:] > 0).sum() == 1


def test_best_anchor_in_another_layer_matches_darknet(darknet_harness, tmp_path):
    """A truth shaped like anchor 3 (its best, in the coarse head) also trains anchor 2 of the
    fine head (centred IoU 0.32) and anchor 4 of the coarse one (0.29) with iou_thresh=0.2;
    without iou_thresh only anchor 3 trains."""
    rows = [[0, *_anchor_box(3, 0.55, 0.30), 1]]  # fine head cell (row 2, col 4)
    ours = compare(darknet_harness, tmp_path, TINY, {"iou_thresh": 0.2}, rows=rows)
    assert np.abs(_trained(ours[FINE][0], 0, 2, 2, 4)[:4]).min() > 0
    assert (ours[COARSE][2], ours[FINE][2]) == (2, 1)
    (tmp_path / "alone").mkdir()
    alone = compare(darknet_harness, tmp_path / "alone", TINY, {}, rows=rows)
    assert (alone[COARSE][2], alone[FINE][2]) == (1, 0)


def test_truth_lists_end_at_x_zero_and_skip_other_classes(darknet_harness, tmp_path):
    """Darknet reads an image's truths up to the first with x == 0 and skips a class the layer
    does not have: of these five, only the first and the fourth train anything."""
    rows = [
        [0, *_anchor_box(1, 0.3, 0.3), 1],
        [0, *_anchor_box(1, 0.7, 0.7), 80],  # classes are 0..79
        [1, *_f32((0.0, 0.5, 0.2, 0.2)), 1],  # ends image 1's list
        [0, *_anchor_box(2, 0.6, 0.2), 3],
        [1, *_anchor_box(1, 0.6, 0.6), 2],  # after the end
    ]
    ours = compare(darknet_harness, tmp_path, TINY, {}, rows=rows)
    assert ours[FINE][2] == 2 and ours[COARSE][2] == 0


def test_gradient_is_minus_darknets_delta(darknet_harness, tmp_path):
    """loss.backward() hands -l.delta to the layer's input; for a new_coords head, our model's
    logits get it through the logistic that the model moved into the head."""
    src = REPO / "cfg" / "yolov3-spp-nano-newcoords.cfg"
    cfg = rewrite_cfg(src, tmp_path / "nc.cfg", SIZE)
    blocks = parse_model_cfg(cfg)
    specs = yolo_specs(blocks)
    layer, spec = next(iter(specs.items()))
    rng = np.random.default_rng(3)
    logits = rng.normal(0, INPUT_STD, layer_inputs(cfg, rng)[layer].shape).astype(np.float32)
    x = _sigmoid(logits)
    rows = random_truths(rng, 6, spec.classes)
    ref, _ = yolo_deltas(darknet_harness, cfg, rows, {layer: x}, tmp_path)[layer]
    bs, _, ny, nx = x.shape
    p = torch.from_numpy(logits).view(bs, spec.na, 5 + spec.classes, ny, nx).permute(0, 1, 3, 4, 2)
    p.requires_grad_(True)
    loss = darknet_yolo_loss(head_input(p, spec), truths_tensor(rows), spec, (SIZE, SIZE))
    loss.backward()
    grad = p.grad.permute(0, 1, 4, 2, 3).reshape(x.shape).numpy()
    expected = -ref * x * (1 - x)  # Darknet's logistic backward in the conv below
    assert np.abs(grad - expected).max() <= DELTA_TOL
    assert np.abs(expected).max() > 0.01


def test_targets_to_truths_keeps_each_images_order_and_max():
    targets = torch.tensor(
        [
            [1, 3, 0.1, 0.2, 0.3, 0.4],
            [0, 1, 0.5, 0.5, 0.1, 0.1],
            [1, 0, 0.6, 0.7, 0.2, 0.2],
            [1, 2, 0.9, 0.9, 0.1, 0.1],
        ]
    )
    truths = targets_to_truths(targets, batch_size=3, max_boxes=2)
    expected = torch.tensor(
        [
            [[0.5, 0.5, 0.1, 0.1, 1], [0, 0, 0, 0, 0]],
            [[0.1, 0.2, 0.3, 0.4, 3], [0.6, 0.7, 0.2, 0.2, 0]],
            [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]],
        ]
    )
    assert torch.equal(truths, expected)
    assert targets_to_truths(torch.zeros(0, 6), 2, 5).shape == (2, 0, 5)


def test_unknown_iou_loss_is_refused(tmp_path):
    cfg = rewrite_cfg(TINY, tmp_path / "t.cfg", SIZE, {"iou_loss": "cioux"})
    blocks = parse_model_cfg(cfg)
    with pytest.raises(ConfigError, match=r"t\.cfg:\d+: \[yolo\]: iou_loss=cioux is not one of"):
        yolo_specs(blocks)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("max_delta", -1, r"max_delta=-1.0 must be above 0"),
        ("max_delta", 0, r"max_delta=0.0 must be above 0"),
        ("obj_normalizer", -1, r"obj_normalizer=-1.0 must be at least 0"),
        ("iou_normalizer", "1e39", r"iou_normalizer=1e\+39 is beyond float32's range"),
    ],
)
def test_gains_and_max_delta_out_of_range_are_refused(tmp_path, key, value, message):
    cfg = rewrite_cfg(TINY, tmp_path / "t.cfg", SIZE, {key: value})
    blocks = parse_model_cfg(cfg)
    with pytest.raises(ConfigError, match=r"t\.cfg:\d+: \[yolo\]: " + message):
        yolo_specs(blocks)


@pytest.mark.cuda
def test_cuda_equals_cpu():
    spec = YoloLossSpec.from_block(
        [b for b in parse_model_cfg(TINY) if b["type"] == "yolo"][1]
        | {"iou_thresh": 0.2, "iou_loss": "ciou"}
    )
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.normal(0, INPUT_STD, (BATCH, 255, 8, 8)).astype(np.float32))
    truths = truths_tensor(random_truths(rng, 10, 80))
    cpu = yolo_delta(x, truths, spec, (SIZE, SIZE))
    gpu = yolo_delta(x.cuda(), truths.cuda(), spec, (SIZE, SIZE))
    assert torch.allclose(gpu.delta.cpu(), cpu.delta, atol=1e-5)
    assert math.isclose(float(gpu.cost), float(cpu.cost), rel_tol=1e-5)


def test_darknet_loss_of_a_model_is_the_sum_of_its_heads():
    """DarknetLoss takes the model's training output and the loader's targets; its loss is the
    sum of the heads' yolo_delta costs, ``reported`` their mean per image."""
    model = Darknet(TINY, img_size=SIZE).train()
    criterion = DarknetLoss([model.hyperparams, *model.module_defs], model.yolo_layers)
    torch.manual_seed(0)
    with torch.no_grad():
        preds = model(torch.rand(BATCH, 3, SIZE, SIZE))
    rows = random_truths(np.random.default_rng(0), 5, 80)
    targets = torch.tensor([[r[0], r[5], *r[1:5]] for r in rows])
    loss, reported = criterion(preds, targets, (SIZE, SIZE))
    costs = [
        yolo_delta(head_input(p, s), truths_tensor(rows), s, (SIZE, SIZE)).cost
        for p, s in zip(preds, criterion.specs)
    ]
    assert torch.allclose(loss, sum(costs))
    assert torch.allclose(reported, loss / len(costs) / BATCH)


def test_the_loss_on_the_device_never_waits_for_it():
    """What would make the host wait for a GPU, counted on the CPU (conftest.host_syncs): none
    in the loss and its backward once the truths are built; those are built on the host from
    the loader's targets (DarknetLoss.__call__), since their shape depends on the boxes."""
    model = Darknet(TINY, img_size=SIZE).train()
    criterion = DarknetLoss([model.hyperparams, *model.module_defs], model.yolo_layers)
    torch.manual_seed(0)
    preds = model(torch.rand(BATCH, 3, SIZE, SIZE))
    rows = random_truths(np.random.default_rng(0), 5, 80)
    truths = targets_to_truths(
        torch.tensor([[r[0], r[5], *r[1:5]] for r in rows]), BATCH, criterion.max_boxes
    )

    def loss_and_backward():
        darknet_loss(preds, truths, criterion.specs, (SIZE, SIZE))[0].backward()

    assert host_syncs(loss_and_backward) == []
