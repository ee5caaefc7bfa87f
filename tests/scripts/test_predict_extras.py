"""predict.py's YOLOv5 extras, each tested by its effect: --save-crop (the crop is the slice of
the original picture, names never collide), --hide-labels/--hide-conf/--line-thickness (pixels
drawn or not), --vid-stride (which frames are predicted, the output's frame rate),
--agnostic-nms (suppression across classes) and --augment (three passes)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import NANO_CFG
from torch import nn

import predict
from build_utils.parse_config import format_model_cfg, parse_model_cfg, rewrite_cfg_classes
from models.darknet import Darknet
from train_utils.checkpoint import save_checkpoint
from train_utils.evaluation.plots import class_colour
from train_utils.precision import inference_precision

NAMES = ["circle", "square"]
# Fixed detections (xyxy original pixels, conf, class) that a patched Predictor returns.
DETS = torch.tensor(
    [
        [10.2, 20.7, 50.5, 60.1, 0.9, 0.0],
        [60.0, 10.0, 90.0, 40.0, 0.8, 0.0],
        [0.0, 0.0, 20.0, 20.0, 0.7, 1.0],  # at the corner: the grown box is clipped
    ]
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 2-class nano checkpoint carrying its cfg and class names."""
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), len(NAMES))
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(64, 64))
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    cfg = format_model_cfg(blocks)
    save_checkpoint({"model": model.state_dict(), "epoch": -1, "names": NAMES, "cfg": cfg}, path)
    return path


def _main(checkpoint: Path, out: Path, *extra: str) -> int:
    argv = ["--weights", str(checkpoint), "--output", str(out), "--img-size", "64"]
    return predict.main([*argv, "--device", "cpu", *extra])


def _gradient(h: int = 100, w: int = 120) -> np.ndarray:
    """A smooth BGR picture (JPEG keeps it within a few levels) where every pixel differs."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 2, y * 2, (x + y)], -1).astype(np.uint8)


def _patch_predictor(monkeypatch, dets: torch.Tensor = DETS) -> list[np.ndarray]:
    """Predictor returns ``dets`` for every picture; returns the list of pictures it saw."""
    seen: list[np.ndarray] = []

    def call(self, img):
        seen.append(img.copy())
        return dets.clone()

    monkeypatch.setattr(predict.Predictor, "__call__", call)
    return seen


def test_crop_bounds_grow_round_outward_and_clip():
    # Golden values: w = 40.3 * 1.02 + 10 = 51.106 around cx 30.35; h = 39.4 * 1.02 + 10 =
    # 50.188 around cy 40.4.
    assert predict.crop_bounds([10.2, 20.7, 50.5, 60.1], (100, 120, 3)) == (15, 66, 4, 56)
    assert predict.crop_bounds([0, 0, 20, 20], (100, 120, 3)) == (0, 26, 0, 26)
    assert predict.crop_bounds([10, 10, 20, 20], (100, 120), gain=1, pad=0) == (10, 20, 10, 20)
    top, bottom, left, right = predict.crop_bounds([200, 200, 250, 250], (100, 120))
    assert bottom <= top or right <= left  # outside the picture: nothing to cut


def test_save_crop_cuts_the_original_picture_and_never_reuses_a_name(
    checkpoint, tmp_path, monkeypatch
):
    img = _gradient()
    # x.png and x.jpg are both planned (stems x and x_2), so a crop named x_2 would collide.
    cv2.imwrite(str(tmp_path / "x.png"), img)
    cv2.imwrite(str(tmp_path / "x.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 100])
    _patch_predictor(monkeypatch)
    out = tmp_path / "out"
    code = _main(
        checkpoint, out, "--source", str(tmp_path / "x.png"), str(tmp_path / "x.jpg"), "--save-crop"
    )
    assert code == 0
    crops = out / "crops"
    found = sorted(p.relative_to(crops).as_posix() for p in crops.rglob("*.jpg"))
    # Each picture's two circles and one square; x.png's second circle is x_2, so the second
    # picture (stem x_2) gets x_2_2 and x_2_3: six files, no name used twice.
    assert found == [
        "circle/x.jpg",
        "circle/x_2.jpg",
        "circle/x_2_2.jpg",
        "circle/x_2_3.jpg",
        "square/x.jpg",
        "square/x_2.jpg",
    ]
    # The crop of x.png's first circle: the slice of the ORIGINAL picture (no drawing on it),
    # computed here from the golden bounds above.
    crop = cv2.imread(str(crops / "circle" / "x.jpg"))
    expected = img[15:66, 4:56]
    assert crop.shape == expected.shape
    assert np.abs(crop.astype(int) - expected).mean() < 2.0  # JPEG's loss only
    corner = cv2.imread(str(crops / "square" / "x.jpg"))
    assert corner.shape == img[0:26, 0:26].shape


def test_a_crop_never_takes_the_name_of_a_drawn_picture(checkpoint, tmp_path, monkeypatch):
    # Two source folders: crops/circle/other/y.jpg is drawn to OUTPUT/crops/circle/other/y.jpg,
    # which is also where other/y.jpg's first circle crop would go.
    img = _gradient()
    for rel in ("crops/circle/other/y.jpg", "other/y.jpg"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(tmp_path / rel), img)
    _patch_predictor(monkeypatch, DETS[:1])
    out = tmp_path / "out"
    sources = (str(tmp_path / "crops"), str(tmp_path / "other"))
    assert _main(checkpoint, out, "--source", *sources, "--save-crop") == 0
    drawn = cv2.imread(str(out / "crops" / "circle" / "other" / "y.jpg"))
    assert drawn.shape == img.shape  # the drawn picture, not a 51 x 52 crop written over it
    crop = cv2.imread(str(out / "crops" / "circle" / "other" / "y_2.jpg"))
    assert crop.shape == img[15:66, 4:56].shape


def test_class_folder_names_are_one_safe_component():
    assert predict._folder_name("traffic/light") == "traffic_light"
    assert predict._folder_name("..") == "_.."
    assert predict._folder_name("feu rouge") == "feu rouge"
    saver = predict.Saver(Path("o"), ["a/b", "a_b"], save_crop=True)
    assert [saver._class_folder(0), saver._class_folder(1), saver._class_folder(7)] == [
        "a_b",
        "a_b_2",
        "7",
    ]


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a != b).any(-1)


def test_hide_labels_hide_conf_and_line_thickness_change_the_pixels_drawn():
    img = np.zeros((100, 120, 3), np.uint8)
    det = torch.tensor([[20.0, 40.0, 80.0, 90.0, 0.87, 1.0]])
    box_only = img.copy()
    cv2.rectangle(box_only, (20, 40), (80, 90), class_colour(1), 2, cv2.LINE_AA)
    hidden = predict.draw_detections(img, det, NAMES, predict.DrawStyle(hide_labels=True))
    assert np.array_equal(hidden, box_only)  # the box and nothing else
    full = predict.draw_detections(img, det, NAMES)
    name_only = predict.draw_detections(img, det, NAMES, predict.DrawStyle(hide_conf=True))
    above = slice(0, 37)  # the label sits above the box's top edge (row 40, 2 px wide)
    assert _changed(full, img)[above].sum() > _changed(name_only, img)[above].sum() > 0
    # The label's filled background is as wide as the class name alone.
    scale = max(0.4, 100 / 800)
    (tw, _), _ = cv2.getTextSize("square", cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    cols = np.nonzero(_changed(name_only, img)[above].any(0))[0]
    assert cols.min() == 20 and cols.max() in (20 + tw - 1, 20 + tw)
    # --line-thickness: OpenCV's line of that width, so the band a vertical line through the
    # top edge crosses widens with it (anti-aliased: 3, 5 and 11 pixels touched).
    crossed = []
    for t in (1, 2, 7):
        drawn = predict.draw_detections(img, det, NAMES, predict.DrawStyle(t, hide_labels=True))
        expected = cv2.rectangle(img.copy(), (20, 40), (80, 90), class_colour(1), t, cv2.LINE_AA)
        assert np.array_equal(drawn, expected)
        crossed.append(int(_changed(drawn, img)[30:60, 50].sum()))
    assert crossed == [3, 5, 11]


def test_drawing_flags_reach_the_saved_picture(checkpoint, tmp_path, monkeypatch):
    img = _gradient()
    cv2.imwrite(str(tmp_path / "x.png"), img)  # PNG: the drawn picture comes back exactly
    _patch_predictor(monkeypatch)
    out = tmp_path / "out"
    flags = ("--hide-labels", "--line-thickness", "5")
    assert _main(checkpoint, out, "--source", str(tmp_path / "x.png"), *flags) == 0
    expected = predict.draw_detections(img, DETS, NAMES, predict.DrawStyle(5, hide_labels=True))
    assert np.array_equal(cv2.imread(str(out / "x.png")), expected)
    assert not (out / "crops").exists()  # no --save-crop, no crops


def test_vid_stride_predicts_every_nth_frame(checkpoint, tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(logging.INFO)
    video = tmp_path / "clip.mp4"
    fps, n = 6.0, 7
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
    for k in range(n):
        writer.write(np.full((48, 64, 3), 30 * k, np.uint8))
    writer.release()
    seen = _patch_predictor(monkeypatch, DETS[:0])
    out = tmp_path / "out"
    code = _main(checkpoint, out, "--source", str(video), "--vid-stride", "3", "--save-txt")
    assert code == 0
    # Frames 1, 4 and 7 (brightness 0, 90, 180), each predicted once.
    assert [round(float(f.mean()) / 30) for f in seen] == [0, 3, 6]
    assert sorted(p.name for p in (out / "labels").iterdir()) == [
        "clip_1.txt",
        "clip_4.txt",
        "clip_7.txt",
    ]
    printed = capsys.readouterr().out
    assert "frame 4: 0 detections" in printed and "frame 2:" not in printed
    assert f"0 images and 3 video frames drawn in {out}" in caplog.messages
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
    assert math.isclose(cap.get(cv2.CAP_PROP_FPS), fps / 3, rel_tol=0.01)
    cap.release()


def test_a_huge_vid_stride_still_writes_the_video(checkpoint, tmp_path, monkeypatch):
    """30 fps / --vid-stride 100000 is below what the mp4 writer opens: the video is written at
    its lowest rate (it was refused as "cannot write ... check the place is writable")."""
    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (64, 48))
    for k in range(3):
        writer.write(np.full((48, 64, 3), 60 * k, np.uint8))
    writer.release()
    _patch_predictor(monkeypatch, DETS[:0])
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(video), "--vid-stride", "100000") == 0
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 1
    assert math.isclose(cap.get(cv2.CAP_PROP_FPS), 0.01, rel_tol=0.01)
    cap.release()
    assert predict.output_fps(30.0, 3) == 10.0
    assert predict.output_fps(30.0, 100000) == predict.MIN_VIDEO_FPS
    assert predict.output_fps(90000.0) == predict.MAX_VIDEO_FPS  # an RTSP clock as the rate
    assert predict.output_fps(float("nan"), 5) == predict.DEFAULT_FPS / 5


def test_a_failed_video_leaves_the_old_one_whole(checkpoint, tmp_path, monkeypatch):
    """--exist-ok over an earlier run whose clip.mp4 is there: a failure in frame 2 leaves the
    old video as it was (it was truncated when the writer opened it) and no temporary file;
    the finished run then replaces it."""
    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 5, (64, 48))
    for _ in range(3):
        writer.write(np.full((48, 64, 3), 90, np.uint8))
    writer.release()
    out = tmp_path / "out"
    out.mkdir()
    old = b"an earlier run's video"
    (out / "clip.mp4").write_bytes(old)
    calls = []

    def fail_on_frame_2(self, img):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return DETS[:0].clone()

    monkeypatch.setattr(predict.Predictor, "__call__", fail_on_frame_2)
    with pytest.raises(RuntimeError, match="out of memory"):
        _main(checkpoint, out, "--source", str(video), "--exist-ok")
    assert (out / "clip.mp4").read_bytes() == old
    assert sorted(p.name for p in out.iterdir()) == ["clip.mp4"]
    _patch_predictor(monkeypatch, DETS[:0])
    assert _main(checkpoint, out, "--source", str(video), "--exist-ok") == 0
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
    cap.release()
    assert sorted(p.name for p in out.iterdir()) == ["clip.mp4"]


def test_a_video_frames_labels_never_replace_an_images(checkpoint, tmp_path, monkeypatch):
    """clip.mp4's frame 1 and the image clip_1.jpg both name their labels clip_1: the image
    keeps clip_1.txt, the frame's go to clip_1_2.txt."""
    src = tmp_path / "src"
    src.mkdir()
    writer = cv2.VideoWriter(str(src / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 5, (64, 48))
    for _ in range(2):
        writer.write(np.full((48, 64, 3), 90, np.uint8))
    writer.release()
    cv2.imwrite(str(src / "clip_1.jpg"), _gradient())

    def call(self, img):  # frames see circles, the image a square
        return (DETS[:1] if img.shape[:2] == (48, 64) else DETS[2:]).clone()

    monkeypatch.setattr(predict.Predictor, "__call__", call)
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(src), "--save-txt") == 0
    labels = {p.name: p.read_text().split()[0] for p in (out / "labels").iterdir()}
    assert labels == {"clip_1.txt": "1", "clip_1_2.txt": "0", "clip_2.txt": "0"}


def test_flag_values_are_checked(checkpoint, tmp_path, capsys):
    image = tmp_path / "x.png"
    cv2.imwrite(str(image), np.zeros((64, 64, 3), np.uint8))
    for flag, value in (("--line-thickness", "0"), ("--vid-stride", "0")):
        assert _main(checkpoint, tmp_path / "o", "--source", str(image), flag, value) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
    code = _main(checkpoint, tmp_path / "o", "--source", str(image), "--line-thickness", "99999")
    assert code == 2 and "at most 32767" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


class FixedModel(nn.Module):
    """Eval-mode output of fixed candidate boxes (cx, cy, w, h, obj, 2 class scores), in the
    input's pixels; counts its forward passes."""

    def __init__(self, rows: list[list[float]]):
        super().__init__()
        self.rows, self.calls = torch.tensor([rows]), 0

    def forward(self, x):
        self.calls += 1
        return self.rows.clone(), None


def _predictor(model: nn.Module, agnostic: bool = False, augment: bool = False):
    cpu = torch.device("cpu")
    extra = {"augment": True} if augment else {}  # so the NMS test also runs on older code
    return predict.Predictor(model, cpu, 64, 0.25, 0.5, 300, agnostic, None, **extra)


def test_agnostic_nms_suppresses_across_classes():
    # Two nearly identical boxes, one scored as class 0, the other as class 1.
    rows = [[32, 32, 20, 20, 0.9, 0.9, 0.1], [33, 32, 20, 20, 0.8, 0.1, 0.9]]
    img = np.zeros((64, 64, 3), np.uint8)
    per_class = _predictor(FixedModel(rows))(img)
    assert sorted(per_class[:, 5].tolist()) == [0.0, 1.0]
    agnostic = _predictor(FixedModel(rows), agnostic=True)(img)
    assert len(agnostic) == 1 and agnostic[0, 5] == 0  # the more confident one stays


def test_augment_runs_three_passes_into_one_nms():
    model = FixedModel([[32, 32, 20, 20, 0.9, 0.9, 0.1]])
    det = _predictor(model, augment=True)(np.zeros((64, 64, 3), np.uint8))
    assert model.calls == 3
    assert len(det) >= 1  # the three passes' boxes went through one NMS
    plain = FixedModel([[32, 32, 20, 20, 0.9, 0.9, 0.1]])
    _predictor(plain)(np.zeros((64, 64, 3), np.uint8))
    assert plain.calls == 1


def test_augment_on_a_real_model(checkpoint, tmp_path):
    cv2.imwrite(str(tmp_path / "x.png"), _gradient())
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(tmp_path / "x.png"), "--augment") == 0
    assert (out / "x.png").is_file()


def test_half_weights_under_a_bf16_autocast_fail_and_the_decision_runs_on_the_cpu():
    """predict.py --half after a bf16 run: the mechanism on the CPU (whose kernels refuse the
    mix as CUDA's do), and the predictor built with --half's decision predicting on the CPU
    (fp16 weights and inputs, no autocast). The CUDA twin: tests/scenarios/test_cuda.py."""
    model = Darknet(NANO_CFG, img_size=64).eval()
    x = torch.rand(1, 3, 64, 64)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"), torch.no_grad(), bf16:
        model.half()(x.half())  # what the two precisions together did
    cuda = torch.device("cuda")  # a device object only: the decision needs no GPU
    decided = inference_precision(torch.bfloat16, "the run's bfloat16", True, None, cuda)
    cpu = torch.device("cpu")
    predictor = predict.Predictor(model.float(), cpu, 64, 0.25, 0.5, 300, False, decided)
    assert next(predictor.model.parameters()).dtype == torch.float16
    det = predictor(np.full((64, 64, 3), 127, np.uint8))
    assert det.shape[1] == 6 and det.dtype == torch.float32
