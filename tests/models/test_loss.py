"""models/loss.py against hand-computed values and an independent loop-based numpy reference."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import host_syncs

from models.loss import (
    GAIN_REFERENCE_IMG_SIZE,
    GAIN_REFERENCE_NUM_CLASSES,
    build_targets,
    compute_loss,
    objectness_balance,
    scale_loss_gains,
)

LN2 = math.log(2.0)
HYP = {
    "giou": 1.0,
    "obj": 1.0,
    "cls": 1.0,
    "obj_pw": 1.0,
    "cls_pw": 1.0,
    "iou_t": 0.2,
    "fl_gamma": 0.0,
}


def fake_model(
    anchor_vecs: list[list[tuple[float, float]]],
    nc: int,
    new_coords: bool = False,
    strides: list[float] | None = None,
) -> SimpleNamespace:
    """A stand-in for Darknet: heads at module_list[1], [3], ... with ``anchor_vec`` (grid);
    ``new_coords`` heads as in Scaled-YOLOv4/YOLOv7 cfgs (``scale_x_y=2``)."""
    module_list: list[object] = []
    yolo_layers = []
    strides = strides or [8.0] * len(anchor_vecs)
    for anchors, stride in zip(anchor_vecs, strides):
        module_list.append(object())  # a conv in the real network
        yolo_layers.append(len(module_list))
        vec = torch.tensor(anchors, dtype=torch.float64)
        head = SimpleNamespace(anchor_vec=vec, na=vec.shape[0], nc=nc, stride=stride)
        if new_coords:
            head.new_coords, head.scale_x_y = True, 2.0
        module_list.append(head)
    return SimpleNamespace(module_list=module_list, yolo_layers=yolo_layers, nc=nc)


# ------------------------------------------------------------------------- hand-computed cases


def _one_cell_case(wh_logit: float, obj_pw: float):
    """One head, one anchor (1, 1), a 2x2 grid, nc = 2; one class-1 target filling cell (0, 0)."""
    model = fake_model([[(1.0, 1.0)]], nc=2)
    pred = torch.zeros(1, 1, 2, 2, 7, dtype=torch.float64)
    pred[0, 0, 0, 0, 2:4] = wh_logit
    targets = torch.tensor([[0, 1, 0.25, 0.25, 0.5, 0.5]], dtype=torch.float64)
    hyp = dict(HYP, obj_pw=obj_pw)
    return compute_loss([pred], targets, model, hyp)


def test_hand_computed_perfect_box():
    # Target in grid units: centre (0.5, 0.5) in cell (0, 0), wh (1, 1) = the anchor, so the
    # zero-logit prediction (sigmoid 0.5, exp(0) * 1) is exact: GIoU 1, box loss 0.
    # Objectness: 4 cells, all logits 0, BCE = ln 2 per cell, the positive one weighted by
    # obj_pw = 2: (2 + 3) ln 2 / 4. Class: one-hot (0, 1) at logits 0: ln 2 each.
    loss = _one_cell_case(wh_logit=0.0, obj_pw=2.0)
    assert loss["box_loss"].item() == pytest.approx(0.0, abs=1e-6)
    assert loss["obj_loss"].item() == pytest.approx(5 / 4 * LN2, abs=1e-6)
    assert loss["cls_loss"].item() == pytest.approx(LN2, abs=1e-6)
    assert all(v.dim() == 0 for v in loss.values())


def test_hand_computed_box_twice_too_big():
    # exp(ln 2) = 2: predicted box 2x2 around the target's 1x1 centre. IoU = 1/4 and the
    # enclosing box is the prediction itself, so GIoU = 1/4 and the box loss is 3/4.
    # The objectness target there is GIoU = 1/4: BCE(0, 1/4) = ln 2 (pw / 4 + 3 / 4).
    loss = _one_cell_case(wh_logit=LN2, obj_pw=3.0)
    assert loss["box_loss"].item() == pytest.approx(0.75, abs=1e-6)
    positive = LN2 * (3.0 * 0.25 + 0.75)
    assert loss["obj_loss"].item() == pytest.approx((positive + 3 * LN2) / 4, abs=1e-6)


def test_gains_multiply():
    base = _one_cell_case(wh_logit=LN2, obj_pw=1.0)
    model = fake_model([[(1.0, 1.0)]], nc=2)
    pred = torch.zeros(1, 1, 2, 2, 7, dtype=torch.float64)
    pred[0, 0, 0, 0, 2:4] = LN2
    targets = torch.tensor([[0, 1, 0.25, 0.25, 0.5, 0.5]], dtype=torch.float64)
    scaled = compute_loss([pred], targets, model, dict(HYP, giou=3.0, obj=5.0, cls=7.0))
    for key, g in (("box_loss", 3.0), ("obj_loss", 5.0), ("cls_loss", 7.0)):
        assert scaled[key].item() == pytest.approx(g * base[key].item(), rel=1e-9)


def test_single_class_has_no_cls_loss():
    model = fake_model([[(1.0, 1.0)]], nc=1)
    pred = torch.randn(1, 1, 2, 2, 6, dtype=torch.float64)
    targets = torch.tensor([[0, 0, 0.25, 0.25, 0.5, 0.5]], dtype=torch.float64)
    assert compute_loss([pred], targets, model, HYP)["cls_loss"].item() == 0.0


# ------------------------------------------------------------------- independent numpy reference


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _bce(logit, y, pw, gamma=0.0, alpha=0.25):
    p = _sigmoid(logit)
    loss = -(pw * y * np.log(p) + (1 - y) * np.log(1 - p))
    if gamma > 0:
        p_t = y * p + (1 - y) * (1 - p)
        loss = loss * (y * alpha + (1 - y) * (1 - alpha)) * (1 - p_t) ** gamma
    return loss


def _giou_cxcywh(b1, b2):
    def corners(b):
        return b[0] - b[2] / 2, b[1] - b[3] / 2, b[0] + b[2] / 2, b[1] + b[3] / 2

    ax1, ay1, ax2, ay2 = corners(b1)
    bx1, by1, bx2, by2 = corners(b2)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    hull = (max(ax2, bx2) - min(ax1, bx1)) * (max(ay2, by2) - min(ay1, by1))
    iou = inter / union
    return iou - (hull - union) / hull


# new_coords: candidate cells (x, y offsets of the cell), each with the test that selects it:
# the centre's cell always; a neighbour when the centre is within 0.5 of that border and the
# neighbour is inside the grid (YOLOv5 / Scaled-YOLOv4 build_targets).
NEW_COORDS_CELLS = [
    ((0, 0), lambda gx, gy, nx, ny: True),
    ((-1, 0), lambda gx, gy, nx, ny: gx % 1 < 0.5 and gx > 1),
    ((0, -1), lambda gx, gy, nx, ny: gy % 1 < 0.5 and gy > 1),
    ((1, 0), lambda gx, gy, nx, ny: (nx - gx) % 1 < 0.5 and nx - gx > 1),
    ((0, 1), lambda gx, gy, nx, ny: (ny - gy) % 1 < 0.5 and ny - gy > 1),
]


def reference_loss(preds, targets, anchor_vecs, nc, hyp, new_coords=False, obj_weights=None):
    """Loop-based re-implementation of the lineage's compute_loss/build_targets in numpy, and
    with ``new_coords`` of the Scaled-YOLOv4/YOLOv7 assignment and Darknet's new_coords decode;
    ``obj_weights`` per head multiply its objectness term (YOLOv5's ``balance``)."""
    lbox = lobj = lcls = 0.0
    gamma = hyp["fl_gamma"]
    cells = NEW_COORDS_CELLS if new_coords else NEW_COORDS_CELLS[:1]
    obj_weights = obj_weights or [1.0] * len(preds)
    for pred, anchors, obj_weight in zip(preds, anchor_vecs, obj_weights):
        bs, na, ny, nx, _ = pred.shape
        tobj = np.zeros((bs, na, ny, nx))
        box_terms, cls_terms = [], []
        # Cell-major, then anchor-major, then target order (later duplicates win objectness).
        for ((dx, dy), selected), (ai, (aw, ah)), row in itertools.product(
            cells, enumerate(anchors), targets
        ):
            b, c = int(row[0]), int(row[1])
            gx, gy, gw, gh = row[2] * nx, row[3] * ny, row[4] * nx, row[5] * ny
            if new_coords:
                if max(gw / aw, aw / gw, gh / ah, ah / gh) >= 4.0:
                    continue
                if not selected(gx, gy, nx, ny):
                    continue
            else:
                inter = min(aw, gw) * min(ah, gh)
                if inter / (aw * ah + gw * gh - inter) <= hyp["iou_t"]:
                    continue
            gi = min(max(math.floor(gx) + dx, 0), nx - 1)
            gj = min(max(math.floor(gy) + dy, 0), ny - 1)
            p = pred[b, ai, gj, gi]
            if new_coords:
                pbox = (
                    _sigmoid(p[0]) * 2 - 0.5,
                    _sigmoid(p[1]) * 2 - 0.5,
                    (2 * _sigmoid(p[2])) ** 2 * aw,
                    (2 * _sigmoid(p[3])) ** 2 * ah,
                )
            else:
                pbox = (
                    _sigmoid(p[0]),
                    _sigmoid(p[1]),
                    min(np.exp(p[2]), 1e3) * aw,
                    min(np.exp(p[3]), 1e3) * ah,
                )
            giou = _giou_cxcywh(pbox, (gx - gi, gy - gj, gw, gh))
            box_terms.append(1 - giou)
            tobj[b, ai, gj, gi] = max(giou, 0.0)  # later duplicates overwrite
            if nc > 1:
                onehot = np.eye(nc)[c]
                cls_terms.append(_bce(p[5:], onehot, hyp["cls_pw"], gamma))
        if box_terms:
            lbox += np.mean(box_terms)
            if nc > 1:
                lcls += np.mean(np.stack(cls_terms))
        lobj += np.mean(_bce(pred[..., 4], tobj, hyp["obj_pw"], gamma)) * obj_weight
    return {
        "box_loss": lbox * hyp["giou"],
        "obj_loss": lobj * hyp["obj"],
        "cls_loss": lcls * hyp["cls"],
    }


def _random_case(seed: int, nt: int, nc: int, duplicates: bool):
    rng = np.random.default_rng(seed)
    anchor_vecs = [[(1.2, 1.6), (2.0, 3.7), (4.1, 2.9)], [(0.9, 1.9), (1.9, 1.4), (1.8, 3.7)]]
    grids = [(4, 5), (8, 10)]  # (ny, nx): a rectangular input
    bs = 2
    preds = [rng.normal(0, 1.5, (bs, 3, ny, nx, 5 + nc)) for ny, nx in grids]
    t = np.zeros((nt, 6))
    t[:, 0] = rng.integers(0, bs, nt)
    t[:, 1] = rng.integers(0, nc, nt)
    t[:, 2:4] = rng.uniform(0.02, 0.98, (nt, 2))
    t[:, 4:6] = rng.uniform(0.05, 0.6, (nt, 2))
    if duplicates and nt >= 3:
        # Same image, same cell at every head, different sizes: exercises last-write-wins.
        t[1, 0] = t[0, 0]
        t[1, 2:4] = t[0, 2:4] + 0.001
        t[2] = t[0]
        t[2, 4:6] *= 1.1
    return preds, t, anchor_vecs


@pytest.mark.parametrize(
    "seed,nt,nc,duplicates,gamma",
    [
        (0, 12, 3, False, 0.0),
        (1, 25, 5, True, 0.0),
        (2, 7, 1, True, 0.0),
        (3, 20, 4, True, 1.5),  # focal loss variant
    ],
)
def test_matches_numpy_reference(seed, nt, nc, duplicates, gamma):
    preds, t, anchor_vecs = _random_case(seed, nt, nc, duplicates)
    hyp = dict(HYP, giou=3.54, obj=64.3, cls=37.4, obj_pw=1.3, cls_pw=0.7, fl_gamma=gamma)
    expected = reference_loss(preds, t, anchor_vecs, nc, hyp)
    model = fake_model(anchor_vecs, nc)
    got = compute_loss([torch.from_numpy(p) for p in preds], torch.from_numpy(t), model, hyp)
    for key in ("box_loss", "obj_loss", "cls_loss"):
        assert got[key].item() == pytest.approx(expected[key], abs=1e-5, rel=1e-6), key


@pytest.mark.parametrize("seed,nt,nc", [(5, 12, 3), (6, 30, 1), (7, 20, 4)])
def test_new_coords_matches_numpy_reference(seed, nt, nc):
    preds, t, anchor_vecs = _random_case(seed, nt, nc, duplicates=True)
    hyp = dict(HYP, giou=3.54, obj=64.3, cls=37.4, obj_pw=1.3, cls_pw=0.7)
    expected = reference_loss(preds, t, anchor_vecs, nc, hyp, new_coords=True)
    model = fake_model(anchor_vecs, nc, new_coords=True)
    got = compute_loss([torch.from_numpy(p) for p in preds], torch.from_numpy(t), model, hyp)
    for key in ("box_loss", "obj_loss", "cls_loss"):
        assert got[key].item() == pytest.approx(expected[key], abs=1e-5, rel=1e-6), key
    # Not the classic loss: the assignment and the decode differ.
    classic = reference_loss(preds, t, anchor_vecs, nc, hyp)
    assert got["box_loss"].item() != pytest.approx(classic["box_loss"], rel=1e-3)


@pytest.mark.parametrize(
    "strides,expected",
    [
        ([32, 16, 8], [0.4, 1.0, 4.0]),  # YOLOv3 cfgs: coarsest head first
        ([8, 16, 32], [4.0, 1.0, 0.4]),  # YOLOv4 cfgs: finest first
        ([32, 16], [1.0, 4.0]),  # the tiny cfgs
        ([8, 16, 32, 64], [4.0, 1.0, 0.25, 0.06]),  # YOLOv7-W6-style, YOLOv5's P3-P6 list
        ([16, 8, 16], [1.0, 4.0, 1.0]),  # equal strides share a weight
        ([8, 16, 32, 64, 128, 256], [4.0, 1.0, 0.25, 0.06, 0.02, 0.02]),
    ],
)
def test_objectness_balance_ranks_heads_by_stride(strides, expected):
    assert objectness_balance([float(s) for s in strides]) == expected


@pytest.mark.parametrize("new_coords", [False, True])
def test_obj_balance_weighs_each_heads_objectness(new_coords):
    preds, t, anchor_vecs = _random_case(8, 15, 3, duplicates=True)
    strides = [16.0, 8.0]  # the 4x5 grid is the coarse head, the 8x10 one the fine head
    model = fake_model(anchor_vecs, 3, new_coords=new_coords, strides=strides)
    args = ([torch.from_numpy(p) for p in preds], torch.from_numpy(t), model)
    hyp = dict(HYP, giou=3.54, obj=64.3, cls=37.4)
    plain = compute_loss(*args, hyp)
    got = compute_loss(*args, dict(hyp, obj_balance=True))
    expected = reference_loss(
        preds, t, anchor_vecs, 3, hyp, new_coords=new_coords, obj_weights=[1.0, 4.0]
    )
    assert got["obj_loss"].item() == pytest.approx(expected["obj_loss"], abs=1e-5, rel=1e-6)
    assert got["obj_loss"].item() > plain["obj_loss"].item() * 1.5
    # Only the objectness term is weighted.
    for key in ("box_loss", "cls_loss"):
        assert torch.equal(got[key], plain[key]), key
    assert torch.equal(
        compute_loss(*args, dict(hyp, obj_balance=False))["obj_loss"], plain["obj_loss"]
    )


def test_new_coords_assignment_uses_neighbour_cells_and_wh_ratios():
    # 10x10 grid, centre (5.3, 2.8), wh (2, 1.5) in grid units. Anchor (1, 1): ratios 2 and 1.5,
    # within 4; anchor (9, 1): 9 / 2 = 4.5, rejected whatever its IoU. Cells: the centre's (5, 2),
    # the left one (0.3 from the left border) and the one below (0.2 from the bottom border).
    model = fake_model([[(1.0, 1.0), (9.0, 1.0)]], nc=2, new_coords=True)
    pred = torch.zeros(1, 2, 10, 10, 7)
    targets = torch.tensor([[0, 1, 0.53, 0.28, 0.2, 0.15]])
    (lt,) = build_targets([pred], targets, model, iou_t=0.2)
    assert lt.valid.shape == (5 * 2,)
    _, a, gj, gi = (x[lt.valid] for x in lt.indices)
    assert a.tolist() == [0, 0, 0]
    assert list(zip(gi.tolist(), gj.tolist())) == [(5, 2), (4, 2), (5, 3)]
    torch.testing.assert_close(
        lt.tbox[lt.valid],
        torch.tensor([[0.3, 0.8, 2.0, 1.5], [1.3, 0.8, 2.0, 1.5], [0.3, -0.2, 2.0, 1.5]]),
    )


def test_new_coords_zero_logits_predict_the_anchor_at_the_cell_centre():
    # sigmoid(0) * 2 - 0.5 = 0.5 and (2 * sigmoid(0)) ** 2 = 1: a centred target of the anchor's
    # size is predicted exactly (GIoU 1), and a centre exactly mid-cell has no neighbour cells.
    model = fake_model([[(1.0, 2.0)]], nc=2, new_coords=True)
    pred = torch.zeros(1, 1, 4, 4, 7, dtype=torch.float64)
    targets = torch.tensor([[0, 1, 0.375, 0.625, 0.25, 0.5]], dtype=torch.float64)
    loss = compute_loss([pred], targets, model, HYP)
    assert loss["box_loss"].item() == pytest.approx(0.0, abs=1e-6)
    # Objectness: 16 cells at logit 0, the assigned one with target GIoU = 1.
    assert loss["obj_loss"].item() == pytest.approx(LN2, abs=1e-6)


def test_float32_close_to_float64():
    preds, t, anchor_vecs = _random_case(4, 15, 3, True)
    model = fake_model(anchor_vecs, 3)
    l64 = compute_loss([torch.from_numpy(p) for p in preds], torch.from_numpy(t), model, HYP)
    l32 = compute_loss(
        [torch.from_numpy(p).float() for p in preds], torch.from_numpy(t).float(), model, HYP
    )
    for key in l64:
        assert l32[key].dtype == torch.float32
        assert l32[key].item() == pytest.approx(l64[key].item(), rel=1e-4, abs=1e-6)


# --------------------------------------------------------------------------- targets and edges


def test_build_targets_assignment():
    # Anchor 0 (1, 1) matches the 1x1 target; anchor 1 (4, 4) has wh-IoU 1/16 <= 0.2: no match.
    model = fake_model([[(1.0, 1.0), (4.0, 4.0)]], nc=2)
    pred = torch.zeros(1, 2, 4, 4, 7)
    targets = torch.tensor([[0, 1, 0.6, 0.3, 0.25, 0.25]])
    (lt,) = build_targets([pred], targets, model, iou_t=0.2)
    assert lt.valid.tolist() == [True, False]
    b, a, gj, gi = (x[lt.valid] for x in lt.indices)
    assert (b.item(), a.item(), gj.item(), gi.item()) == (0, 0, 1, 2)
    assert lt.tbox[lt.valid][0].tolist() == pytest.approx([0.4, 0.2, 1.0, 1.0])
    assert lt.tcls[lt.valid].tolist() == [1]


def test_build_targets_border_centre_goes_to_last_cell():
    model = fake_model([[(1.0, 1.0)]], nc=1)
    pred = torch.zeros(1, 1, 4, 4, 6)
    targets = torch.tensor([[0, 0, 1.0, 1.0, 0.25, 0.25]])
    (lt,) = build_targets([pred], targets, model, iou_t=0.2)
    _, _, gj, gi = lt.indices
    assert (gj.item(), gi.item()) == (3, 3)
    assert lt.tbox[0, :2].tolist() == pytest.approx([1.0, 1.0])


def test_empty_targets():
    model = fake_model([[(1.0, 1.0), (2.0, 2.0)], [(1.0, 1.0)]], nc=3)
    preds = [
        torch.zeros(2, 2, 4, 4, 8, requires_grad=True),
        torch.zeros(2, 1, 8, 8, 8, requires_grad=True),
    ]
    loss = compute_loss(preds, torch.zeros(0, 6), model, HYP)
    assert loss["box_loss"].item() == 0.0
    assert loss["cls_loss"].item() == 0.0
    # Every objectness target is 0 and every logit 0: ln 2 per head.
    assert loss["obj_loss"].item() == pytest.approx(2 * LN2, abs=1e-6)
    sum(loss.values()).backward()
    assert preds[0].grad is not None and torch.isfinite(preds[0].grad).all()


def test_no_assignment_at_all():
    # A target far from every anchor's shape: no pair passes iou_t; losses stay finite.
    model = fake_model([[(10.0, 10.0)]], nc=2)
    pred = torch.zeros(1, 1, 2, 2, 7)
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.01, 0.01]])
    loss = compute_loss([pred], targets, model, HYP)
    assert loss["box_loss"].item() == 0.0 and loss["cls_loss"].item() == 0.0
    assert loss["obj_loss"].item() == pytest.approx(LN2, abs=1e-6)


def test_gradient_flows_to_assigned_cell():
    model = fake_model([[(1.0, 1.0)]], nc=3)
    # Its own generator: drawn from the global one, the result depended on the tests run before
    # (about 1 draw in 20 puts the target's rows inside the prediction's, where d/dy is 0).
    noise = torch.randn(1, 1, 2, 2, 8, generator=torch.Generator().manual_seed(0))
    pred = (noise * 0.1).requires_grad_()
    # Grid units: centre (0.9, 1.2), size (0.6, 0.6); overlaps the ~unit prediction of cell
    # (row 1, column 0) partially on both axes, so GIoU depends on all four box outputs.
    targets = torch.tensor([[0, 2, 0.45, 0.6, 0.3, 0.3]])
    loss = compute_loss([pred], targets, model, HYP)
    sum(loss.values()).backward()
    g = pred.grad
    assert torch.isfinite(g).all()
    cell = g[0, 0, 1, 0]
    assert (cell[:4].abs() > 0).all(), "box loss must reach xy and wh"
    assert cell[4].abs() > 0 and (cell[5:].abs() > 0).all()
    # Other cells only see the objectness loss.
    assert g[0, 0, 0, 0, :4].abs().sum() == 0 and g[0, 0, 0, 0, 4].abs() > 0


def test_preds_heads_mismatch_is_an_error():
    model = fake_model([[(1.0, 1.0)], [(2.0, 2.0)]], nc=2)
    with pytest.raises(ValueError, match="2 YOLO layers"):
        compute_loss([torch.zeros(1, 1, 2, 2, 7)], torch.zeros(0, 6), model, HYP)


def test_scale_loss_gains_returns_new_dict():
    hyp = dict(HYP, cls=37.4, obj=64.3)
    scaled = scale_loss_gains(hyp, nc=20, img_size=512)
    assert scaled is not hyp and hyp["cls"] == 37.4 and hyp["obj"] == 64.3
    assert scaled["cls"] == pytest.approx(37.4 * 20 / GAIN_REFERENCE_NUM_CLASSES)
    assert scaled["obj"] == pytest.approx(64.3 * 512 / GAIN_REFERENCE_IMG_SIZE)
    assert scaled["giou"] == hyp["giou"]
    assert (GAIN_REFERENCE_NUM_CLASSES, GAIN_REFERENCE_IMG_SIZE) == (80, 320)


@pytest.mark.parametrize("order,expected_tobj", [((0, 1), 0.64), ((1, 0), 1.0)])
def test_duplicate_cell_last_target_sets_objectness(order, expected_tobj):
    # Both targets sit in cell (0, 0) of anchor 0 with centre (0.5, 0.5). The zero-logit
    # prediction is the unit box: GIoU 1 with the 1x1 target, 0.64 with the 0.8x0.8 one.
    model = fake_model([[(1.0, 1.0)]], nc=1)
    pred = torch.zeros(1, 1, 2, 2, 6, dtype=torch.float64)
    rows = [[0, 0, 0.25, 0.25, 0.5, 0.5], [0, 0, 0.25, 0.25, 0.4, 0.4]]
    targets = torch.tensor([rows[i] for i in order], dtype=torch.float64)
    loss = compute_loss([pred], targets, model, HYP)
    # BCE at logit 0 is ln 2 whatever the target: use the gradient instead, which is
    # (sigmoid(0) - y) / n_cells at the positive cell.
    pred.requires_grad_()
    compute_loss([pred], targets, model, HYP)["obj_loss"].backward()
    assert pred.grad[0, 0, 0, 0, 4].item() == pytest.approx((0.5 - expected_tobj) / 4, abs=1e-6)
    # Both duplicates count in the box loss: mean(1 - 1, 1 - 0.64).
    assert loss["box_loss"].item() == pytest.approx(0.18, abs=1e-6)


def test_the_loss_never_waits_for_the_device():
    # What test_cuda_twin_matches_cpu_without_host_sync checks on a GPU, checked on the CPU
    # (torchvision's generalized_box_iou_loss wrote through a boolean mask: 3 syncs a step).
    preds, t, anchor_vecs = _random_case(5, 30, 4, True)
    model = fake_model(anchor_vecs, 4)
    preds = [torch.from_numpy(p).requires_grad_() for p in preds]

    def step():
        sum(compute_loss(preds, torch.from_numpy(t), model, HYP).values()).backward()

    assert host_syncs(step) == []
    assert host_syncs(lambda: torch.ones(3)[torch.tensor([True, False, True])]) == ["aten::index"]


@pytest.mark.cuda
def test_cuda_twin_matches_cpu_without_host_sync():
    preds, t, anchor_vecs = _random_case(5, 30, 4, True)
    model = fake_model(anchor_vecs, 4)
    cpu = compute_loss([torch.from_numpy(p) for p in preds], torch.from_numpy(t), model, HYP)
    for head in model.module_list[1::2]:
        head.anchor_vec = head.anchor_vec.cuda()
    cuda_preds = [torch.from_numpy(p).cuda() for p in preds]
    cuda_targets = torch.from_numpy(t).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronisation raises
    try:
        got = compute_loss(cuda_preds, cuda_targets, model, HYP)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for key in cpu:
        assert got[key].item() == pytest.approx(cpu[key].item(), rel=1e-9, abs=1e-12), key


# ------------------------------------------------------------------ with the real Darknet model


def test_with_darknet_matches_reference(repo_root):
    # Imported here so that the tests above stay independent of models/darknet.py.
    from models.darknet import Darknet

    torch.manual_seed(0)
    model = Darknet(str(repo_root / "cfg" / "yolov3-spp-nano.cfg"), img_size=(128, 96))
    model.train()
    preds = model(torch.rand(2, 3, 96, 128))
    targets = torch.tensor(
        [[0, 3, 0.5, 0.5, 0.3, 0.4], [0, 7, 0.2, 0.8, 0.05, 0.1], [1, 79, 0.7, 0.3, 0.9, 0.6]]
    )
    hyp = dict(HYP, giou=3.54, obj=64.3, cls=37.4)
    loss = compute_loss(preds, targets, model, hyp)
    total = sum(loss.values())
    assert torch.isfinite(total)
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)

    anchor_vecs = [model.module_list[i].anchor_vec.tolist() for i in model.yolo_layers]
    expected = reference_loss(
        [p.detach().double().numpy() for p in preds],
        targets.double().numpy(),
        anchor_vecs,
        model.nc,
        hyp,
    )
    for key in expected:
        assert loss[key].item() == pytest.approx(expected[key], rel=1e-4, abs=1e-5), key
