"""Test-time augmentation (models/tta.py): each pass's boxes land back on the input's pixels,
the flipped pass is de-flipped, scaled inputs are padded with the letterbox grey to the stride,
and validation.py --augment scores a trained model sanely."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_training, train_argv, validation_argv
from torch import nn

import validation
from build_utils.augmentations import PAD_VALUE
from models.tta import TTA_PASSES, detect, forward_augmented, scale_img

NC = 2
BOX = (37.0, 50.0, 141.0, 117.0)  # x1, y1, x2, y2: off-centre, so a missed de-flip shows
H, W = 160, 256
STRIDE = 32


class BrightBoxFinder(nn.Module):
    """A stand-in detector: one detection per image, the bounding box (cx, cy, w, h, in this
    input's pixels, pixel edges) of the pixels brighter than 0.75 (the letterbox grey, 0.447,
    is not); records every input it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.inputs.append(x.clone())
        rows = []
        for img in x:
            ys, xs = torch.nonzero(img[0] > 0.75, as_tuple=True)
            x1, x2 = xs.min().item(), xs.max().item() + 1
            y1, y2 = ys.min().item(), ys.max().item() + 1
            rows.append([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1, 1.0] + [0.5] * NC)
        return torch.tensor(rows, dtype=x.dtype).unsqueeze(1), None


def _image() -> torch.Tensor:
    x = torch.zeros(1, 3, H, W)
    x1, y1, x2, y2 = (int(v) for v in BOX)
    x[:, :, y1:y2, x1:x2] = 1.0
    return x


def _xyxy(det: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = det[..., :4].unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def test_each_pass_maps_back_onto_the_input_within_a_pixel():
    model = BrightBoxFinder()
    det = forward_augmented(model, _image(), STRIDE)
    assert det.shape == (1, len(TTA_PASSES), 5 + NC)
    boxes = _xyxy(det[0])
    for k, box in enumerate(boxes):
        err = (box - torch.tensor(BOX)).abs().max().item()
        assert err <= 1.0, f"pass {k} ({TTA_PASSES[k]}): {box.tolist()} vs {BOX}, {err:.2f} px"
    # The passes really were scaled and flipped: each input's sides are the stride's
    # multiples above the scaled sides, the flipped pass saw the box on the right, and the
    # padding is the letterbox grey.
    # 160 x 256 -> 132 x 212 -> 160 x 224; -> 107 x 171 -> 128 x 192.
    assert [tuple(seen.shape[2:]) for seen in model.inputs] == [(160, 256), (160, 224), (128, 192)]
    for (ratio, flipped), seen in zip(TTA_PASSES, model.inputs):
        nh, nw = int(H * ratio), int(W * ratio)
        cols = torch.nonzero(seen[0, 0].amax(0) > 0.75).flatten().float()
        assert (cols.mean() > nw / 2) == flipped
        if ratio != 1.0:
            pad = torch.cat([seen[0, :, nh:, :].flatten(), seen[0, :, :, nw:].flatten()])
            assert torch.allclose(pad, torch.full_like(pad, PAD_VALUE / 255))


def test_flipped_detections_are_flipped_back_exactly():
    """A box found at x in the flipped, scaled input is at W - x / r in the input."""
    x = _image()
    scaled, rh, rw = scale_img(x.flip(3), 0.83, STRIDE)
    assert scaled.shape[2:] == (160, 224)  # 132 x 212 padded up to the stride
    assert (rh, rw) == (int(H * 0.83) / H, int(W * 0.83) / W)
    found = torch.tensor([[[100.0, 40.0, 30.0, 20.0, 1.0, 0.5, 0.5]]])

    class Fixed(nn.Module):
        def forward(self, xi):
            return found.clone(), None

    det = forward_augmented(Fixed(), x, STRIDE, passes=[(0.83, True)])
    expected = [W - 100.0 / rw, 40.0 / rh, 30.0 / rw, 20.0 / rh]
    assert torch.allclose(det[0, 0, :4], torch.tensor(expected))
    assert torch.equal(det[0, 0, 4:], found[0, 0, 4:])


def test_without_augment_detect_is_one_forward():
    model = BrightBoxFinder()
    assert torch.equal(detect(model, _image()), model(_image())[0])
    assert len(model.inputs) == 2


@pytest.mark.slow
def test_validation_augment_scores_a_trained_model(make_shapes_data, tmp_path):
    data = make_shapes_data(8, 4, img_size_range=(64, 96), obj_size_range=(16.0, 0.6))
    out = tmp_path / "run"
    run_training(train_argv(data, out, epochs=3, img=64))
    stats = {}
    for name, extra in (("plain", []), ("augment", ["--augment"])):
        json_out = tmp_path / f"{name}.json"
        argv = validation_argv(out / "model.cfg", data, out / "last.pt", img=64)
        argv += ["--save-dir", str(tmp_path / name), "--json-out", str(json_out), "--no-plots"]
        assert validation.main([*argv, *extra]) == 0
        stats[name] = json.loads(json_out.read_text())
    plain, augmented = stats["plain"], stats["augment"]
    assert augmented.keys() == plain.keys()
    for name, value in augmented.items():
        # -1 is COCO's "no objects of this size", which the augmentation does not change.
        assert (value == -1) == (plain[name] == -1), name
        assert value == -1 or 0.0 <= value <= 1.0, name
    # The three passes ran (other detections, so other numbers), and a 3-epoch model's few
    # right boxes are found again (its plain mAP@0.5 is about 0.002).
    assert augmented != plain
    assert augmented["mAP50"] > 0
    # --task speed times the same augmented inference.
    argv = validation_argv(out / "model.cfg", data, out / "last.pt", img=64)
    assert validation.main([*argv, "--task", "speed", "--augment"]) == 0
