"""build_utils/boxes.py: conversions, IoU, coordinate mapping and NMS against a brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from build_utils.boxes import (
    MAX_WH,
    MIN_WH,
    clip_coords,
    non_max_suppression,
    paired_giou,
    scale_coords,
    wh_iou,
    xywhn2xyxy,
    xyxy2xywhn,
)

# ------------------------------------------------------------------------------ conversions


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_conversion_round_trips(lib):
    rng = np.random.default_rng(0)
    xyxy = np.sort(rng.uniform(0, 100, (20, 2, 2)), axis=1).transpose(0, 2, 1).reshape(20, 4)
    x = xyxy if lib == "numpy" else torch.from_numpy(xyxy)
    back = xywhn2xyxy(xyxy2xywhn(x, 120, 90), 120, 90)
    np.testing.assert_allclose(np.asarray(back), xyxy, atol=1e-9)


def test_xywhn2xyxy_golden():
    x = np.array([[10.0, 20.0, 4.0, 6.0]])
    assert xywhn2xyxy(x, 1, 1).tolist() == [[8.0, 17.0, 12.0, 23.0]]
    assert xywhn2xyxy(x, 2, 3).tolist() == [[16.0, 51.0, 24.0, 69.0]]


# ---------------------------------------------------------------------------------- IoU


def test_box_iou_golden():
    """The pairwise IoU of xyxy boxes that models/export.py compares outputs with."""
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    b = torch.tensor([[1.0, 1.0, 3.0, 3.0], [0.0, 0.0, 2.0, 2.0], [5.0, 5.0, 6.0, 6.0]])
    assert torchvision.ops.box_iou(a, b).tolist() == [pytest.approx([1 / 7, 1.0, 0.0])]


def test_wh_iou_golden():
    got = wh_iou(torch.tensor([[1.0, 1.0], [4.0, 2.0]]), torch.tensor([[2.0, 2.0]]))
    assert got[:, 0].tolist() == pytest.approx([1 / 4, 4 / 8])


def test_paired_giou_golden():
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 2.0, 2.0]])
    b = torch.tensor([[1.0, 1.0, 3.0, 3.0], [2.0, 0.0, 3.0, 1.0], [0.0, 0.0, 2.0, 2.0]])
    # 1/7 - (9 - 7)/9; disjoint: 0 - (3 - 2)/3; the same box: 1.
    assert paired_giou(a, b).tolist() == pytest.approx([1 / 7 - 2 / 9, -1 / 3, 1.0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_paired_giou_is_one_minus_torchvisions_giou_loss(dtype):
    import torchvision

    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(500, 2, 2, generator=gen, dtype=torch.float64) * 10
    boxes = torch.cat((xy.amin(1), xy.amax(1)), 1)  # xyxy, some nested, disjoint or touching
    boxes[:5, 2:] = boxes[:5, :2]  # points: zero area
    pairs = boxes.to(dtype), boxes.roll(1, 0).to(dtype)
    want = 1.0 - torchvision.ops.generalized_box_iou_loss(*pairs)
    got = paired_giou(*pairs)
    assert got.dtype == want.dtype  # bf16 boxes are computed in float32, as torchvision does
    torch.testing.assert_close(got, want, rtol=0, atol=4 * torch.finfo(want.dtype).eps)


# --------------------------------------------------------------------- coordinates mapping


def test_scale_coords_letterbox_golden():
    # 640x480 letterboxed into 416x416: gain 0.65, 52 px of padding top and bottom.
    original = torch.tensor([[100.0, 50.0, 200.0, 150.0, 0.9, 3.0]])
    letterboxed = torch.tensor([[65.0, 84.5, 130.0, 149.5, 0.9, 3.0]])
    for ratio_pad in (None, ((0.65, 0.65), (0.0, 52.0))):
        got = scale_coords((416, 416), letterboxed, (480, 640), ratio_pad)
        assert got.tolist()[0] == pytest.approx(original.tolist()[0])
    assert letterboxed[0, 1].item() == 84.5, "the input must not be modified"


def test_scale_coords_rect_shape_uses_ratio_pad():
    # A rect batch: 640x480 image at 416x320 (h, w = 320, 416): gain 0.65, padw 0, padh 4.
    boxes = np.array([[13.0, 4.0 + 32.5, 416.0, 4.0 + 97.5]])
    got = scale_coords((320, 416), boxes, (480, 640), ((0.65, 0.65), (0.0, 4.0)))
    np.testing.assert_allclose(got, [[20.0, 50.0, 640.0, 150.0]], atol=1e-9)


def test_clip_coords():
    boxes = torch.tensor([[-5.0, -1.0, 700.0, 300.0], [10.0, 20.0, 30.0, 500.0]])
    got = clip_coords(boxes, (480, 640))
    assert got.tolist() == [[0.0, 0.0, 640.0, 300.0], [10.0, 20.0, 30.0, 480.0]]
    assert boxes[0, 0].item() == -5.0
    assert clip_coords(boxes.numpy(), (480, 640)).tolist() == got.tolist()


# -------------------------------------------------------------------------------------- NMS


def _iou(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def reference_nms(
    rows,
    conf_thres,
    iou_thres,
    multi_label,
    classes=None,
    agnostic=False,
    max_det=300,
    max_nms=30000,
):
    """Brute-force greedy NMS in pure Python on one image's (N, 5 + nc) rows."""
    nc = len(rows[0]) - 5 if rows else 0
    candidates = []
    for cx, cy, w, h, obj, *cls_scores in rows:
        if not obj > conf_thres or not (MIN_WH <= w <= MAX_WH and MIN_WH <= h <= MAX_WH):
            continue
        box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
        confs = [obj * s for s in cls_scores]
        if multi_label and nc > 1:
            pairs = [(c, j) for j, c in enumerate(confs) if c > conf_thres]
            pairs = [(c, j) for c, j in pairs if classes is None or j in classes]
        else:
            j = max(range(nc), key=lambda k: confs[k])
            ok = confs[j] > conf_thres and (classes is None or j in classes)
            pairs = [(confs[j], j)] if ok else []
        candidates += [(c, j, box) for c, j in pairs]
    candidates.sort(key=lambda t: -t[0])
    kept = []
    for c, j, box in candidates[:max_nms]:
        if all((not agnostic and j != kj) or _iou(box, kb) <= iou_thres for _, kj, kb in kept):
            kept.append((c, j, box))
    return kept[:max_det]


def _as_tuples(out):
    return [(r[4], int(r[5]), tuple(r[:4])) for r in out.tolist()]


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for (gc, gj, gb), (ec, ej, eb) in zip(got, expected):
        assert gj == ej and gc == pytest.approx(ec, abs=1e-12)
        assert gb == pytest.approx(eb, abs=1e-9)


def _random_prediction(seed, bs=2, n=150, nc=3, spread=120.0, wh=(1.0, 51.0), dtype=torch.float64):
    """(bs, n, 5 + nc): centres in a ``spread`` square, sizes in ``wh`` (some below MIN_WH)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.empty(bs, n, 5 + nc, dtype=dtype)
    p[..., :2] = torch.rand(bs, n, 2, generator=g, dtype=dtype) * spread
    p[..., 2:4] = torch.rand(bs, n, 2, generator=g, dtype=dtype) * (wh[1] - wh[0]) + wh[0]
    p[..., 4:] = torch.rand(bs, n, 1 + nc, generator=g, dtype=dtype)
    return p


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("multi_label", [True, False])
@pytest.mark.parametrize("agnostic", [False, True])
def test_nms_matches_brute_force(seed, multi_label, agnostic):
    p = _random_prediction(seed)
    out = non_max_suppression(p, 0.05, 0.45, multi_label=multi_label, agnostic=agnostic)
    assert len(out) == p.shape[0]
    for img, o in zip(p, out):
        expected = reference_nms(img.tolist(), 0.05, 0.45, multi_label, agnostic=agnostic)
        assert o.shape[1] == 6 and o.dtype == p.dtype
        assert len(expected) > 5, "the case must not be trivial"
        _assert_same(_as_tuples(o), expected)


@pytest.mark.parametrize("max_det,max_nms", [(1, 30000), (3, 30000), (7, 40), (300, 25), (4, 9)])
def test_nms_limits_match_brute_force(max_det, max_nms):
    # Heavy overlap (300 boxes of 30-60 px centred in a 12 px square) suppresses most
    # candidates, so the first candidate prefix tried (2 * max_det) does not yield max_det
    # detections and has to grow.
    p = _random_prediction(7, bs=1, n=300, nc=2, spread=12.0, wh=(30.0, 60.0))
    (out,) = non_max_suppression(p, 0.01, 0.3, max_det=max_det, max_nms=max_nms)
    expected = reference_nms(p[0].tolist(), 0.01, 0.3, True, max_det=max_det, max_nms=max_nms)
    assert out.shape[0] <= max_det
    _assert_same(_as_tuples(out), expected)


def test_nms_classes_filter():
    p = _random_prediction(3, nc=4)
    for multi_label in (True, False):
        out = non_max_suppression(p, 0.05, 0.5, multi_label=multi_label, classes=[1, 3])
        for img, o in zip(p, out):
            assert set(o[:, 5].tolist()) <= {1.0, 3.0} and len(o)
            expected = reference_nms(img.tolist(), 0.05, 0.5, multi_label, classes=[1, 3])
            _assert_same(_as_tuples(o), expected)


def test_nms_single_class_and_float32():
    p = _random_prediction(5, nc=1, dtype=torch.float32)
    out = non_max_suppression(p, 0.1, 0.5)
    for img, o in zip(p.double(), out):
        assert o.dtype == torch.float32 and (o[:, 5] == 0).all()
        expected = reference_nms(img.tolist(), 0.1, 0.5, True)
        assert len(o) == len(expected)
        np.testing.assert_allclose(o[:, 4].double().numpy(), [e[0] for e in expected], rtol=1e-6)


def test_nms_empty_inputs_keep_every_image():
    p = _random_prediction(1, bs=3)
    p[1, :, 4] = 0.0  # nothing passes the objectness threshold in image 1
    out = non_max_suppression(p, 0.05, 0.5)
    assert [o.shape[0] > 0 for o in out] == [True, False, True]
    assert out[1].shape == (0, 6)
    assert [o.shape for o in non_max_suppression(torch.zeros(2, 0, 8))] == [(0, 6), (0, 6)]
    # Candidates exist by objectness but none by obj * cls.
    q = _random_prediction(2, bs=1)
    q[..., 4] = 0.9
    q[..., 5:] = 0.01
    assert non_max_suppression(q, 0.1, 0.5)[0].shape == (0, 6)


def test_nms_size_filter():
    # One good box; one too small; one too large: only the first survives.
    p = torch.tensor(
        [
            [
                [50.0, 50.0, 20.0, 20.0, 0.9, 0.9],
                [90.0, 90.0, 1.5, 20.0, 0.9, 0.9],
                [50.0, 50.0, 5000.0, 20.0, 0.9, 0.9],
            ]
        ]
    )
    (out,) = non_max_suppression(p, 0.1, 0.5)
    assert out.tolist() == [pytest.approx([40.0, 40.0, 60.0, 60.0, 0.81, 0.0])]


def test_nms_sorted_by_confidence():
    (out,) = non_max_suppression(_random_prediction(4, bs=1), 0.05, 0.5)
    assert (out[1:, 4] <= out[:-1, 4]).all()
