"""train_utils/evaluation/speed.py: ``validation.py --task speed`` times the three steps per
image over the timed batches, the warm-up batch left out."""

from __future__ import annotations

import pytest
import torch

from models.darknet import Darknet
from train_utils.evaluation import speed
from train_utils.evaluation.options import EvalOptions

CPU = torch.device("cpu")


def test_each_step_is_timed_per_image_without_the_warm_up(repo_root, monkeypatch):
    model = Darknet(repo_root / "cfg" / "yolov3-spp-nano.cfg", img_size=64)
    batches = [(torch.zeros(n, 3, 64, 64, dtype=torch.uint8),) for n in (4, 2, 3)]
    clock = iter(range(1000))
    # A clock that moves by 1 s per reading: every step of every batch takes exactly 1 s.
    monkeypatch.setattr(speed, "_sync", lambda device: float(next(clock)))
    result = speed.measure_speed(model, batches, EvalOptions(device=CPU))
    assert result.images == 5 and result.shape == (3, 3, 64, 64)  # batches 2 and 3 timed
    # Two timed batches, 1 s per step each, over 5 images: 400 ms per image per step.
    assert (result.preprocess_ms, result.inference_ms, result.nms_ms) == pytest.approx(
        (400.0, 400.0, 400.0)
    )
    assert result.format().startswith("speed: 400.0 ms pre-process, 400.0 ms inference")


def test_a_single_batch_is_timed_although_it_is_the_warm_up(repo_root):
    model = Darknet(repo_root / "cfg" / "yolov3-spp-nano.cfg", img_size=64)
    result = speed.measure_speed(model, [(torch.zeros(2, 3, 64, 64, dtype=torch.uint8),)],
                                 EvalOptions(device=CPU))  # fmt: skip
    assert result.images == 2 and result.inference_ms > 0


def test_speed_times_the_nms_the_evaluation_runs(repo_root, monkeypatch):
    # Was: --task speed ran class-aware NMS under --single-cls, where the evaluation runs it
    # class-agnostic (both now call EvalOptions.nms).
    seen = []
    monkeypatch.setattr(
        speed.EvalOptions, "nms", lambda self, det: seen.append(self.single_cls) or []
    )
    model = Darknet(repo_root / "cfg" / "yolov3-spp-nano.cfg", img_size=64)
    batch = [(torch.zeros(1, 3, 64, 64, dtype=torch.uint8),)]
    speed.measure_speed(model, batch, EvalOptions(device=CPU, single_cls=True))
    assert seen == [True]


def test_single_cls_nms_keeps_one_box_found_as_two_classes():
    # One box, scored 0.9 as class 0 and 0.8 as class 1 (x, y, w, h, objectness, classes).
    det = torch.tensor([[[32.0, 32.0, 20.0, 20.0, 1.0, 0.9, 0.8]]])
    per_class = EvalOptions(device=CPU).nms(det)[0]
    agnostic = EvalOptions(device=CPU, single_cls=True).nms(det)[0]
    assert sorted(per_class[:, 5].tolist()) == [0.0, 1.0]
    assert agnostic[:, 5].tolist() == [0.0] and agnostic[:, 4].tolist() == pytest.approx([0.9])
