"""predict.py flags and sources: --classes, --save-txt/--save-conf, videos inside folders, a
camera index, streams that cannot be opened, --half outside CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import predict
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes, write_model_cfg
from models.darknet import Darknet
from train_utils.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
NAMES = ["circle", "square", "triangle", "star", "cross"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 5-class nano model whose head biases make every box a confident class 0."""
    d = tmp_path_factory.mktemp("ckpt")
    blocks = rewrite_cfg_classes(parse_model_cfg(REPO / "cfg" / "yolov3-spp-nano.cfg"), 5)
    write_model_cfg(blocks, d / "model.cfg")
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(128, 128))
    with torch.no_grad():
        for i in model.yolo_layers:
            bias = model.module_list[i - 1].Conv2d.bias.view(3, -1)
            bias[:, 4] = 5.0
            bias[:, 5] = 5.0
    path = d / "model.pt"
    save_checkpoint(
        {
            "model": model.state_dict(),
            "epoch": -1,
            "names": NAMES,
            "cfg": (d / "model.cfg").read_text(),
        },
        path,
    )
    return path


def _video(path: Path, frames: int = 3) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 5, (160, 120))
    for k in range(frames):
        writer.write(np.full((120, 160, 3), 40 * k, np.uint8))
    writer.release()
    return path


def _main(checkpoint: Path, out: Path, *extra: str) -> int:
    argv = ["--weights", str(checkpoint), "--output", str(out), "--img-size", "128"]
    return predict.main([*argv, "--device", "cpu", "--conf-thres", "0.5", *extra])


def test_save_txt_conf_and_classes(checkpoint, shapes_data, tmp_path):
    images = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[:2]
    out = tmp_path / "all"
    assert _main(checkpoint, out, "--source", *map(str, images), "--save-txt", "--save-conf") == 0
    lines = (out / "labels" / f"{images[0].stem}.txt").read_text().splitlines()
    assert lines
    for line in lines:
        c, *box, conf = line.split()
        assert c == "0" and len(box) == 4 and all(0 <= float(v) <= 1 for v in box)
        assert 0.5 <= float(conf) <= 1
    # Only class 1 kept: the class-0 boxes are gone.
    out1 = tmp_path / "only1"
    assert _main(checkpoint, out1, "--source", str(images[0]), "--save-txt", "--classes", "1") == 0
    assert (out1 / "labels" / f"{images[0].stem}.txt").read_text() == ""
    # Without --save-conf: five fields.
    out2 = tmp_path / "noconf"
    assert _main(checkpoint, out2, "--source", str(images[0]), "--save-txt", "--classes", "0") == 0
    first = (out2 / "labels" / f"{images[0].stem}.txt").read_text().splitlines()[0]
    assert len(first.split()) == 5


def test_folder_with_images_and_videos(checkpoint, shapes_data, tmp_path, capsys):
    folder = tmp_path / "mixed"
    (folder / "sub").mkdir(parents=True)
    image = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    shutil.copy(image, folder / image.name)
    _video(folder / "sub" / "clip.avi")
    (folder / "notes.txt").write_text("not media")
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(folder), "--save-txt") == 0
    stdout = capsys.readouterr().out
    assert (out / image.name).is_file()
    assert (out / "clip.mp4").is_file() and stdout.count("clip.avi frame") == 3
    assert sorted(p.name for p in (out / "labels").glob("clip_*.txt")) == [
        "clip_1.txt",
        "clip_2.txt",
        "clip_3.txt",
    ]


def test_camera_index(checkpoint, tmp_path, monkeypatch, capsys):
    video = _video(tmp_path / "cam.mp4", frames=2)
    real = predict.open_capture
    opened = []

    def fake_camera(source):
        opened.append(source)
        return real(video) if source == "0" else real(source)

    monkeypatch.setattr(predict, "open_capture", fake_camera)
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", "0") == 0
    assert opened == ["0"]
    assert (out / "camera0.mp4").is_file()
    assert capsys.readouterr().out.count("0 frame") == 2


def test_camera_or_stream_that_cannot_open(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(predict, "open_capture", lambda source: cv2.VideoCapture())
    assert _main(checkpoint, tmp_path / "o", "--source", "3") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot open camera 3" in err
    monkeypatch.undo()
    # A real refused connection: OpenCV gives up at once.
    assert _main(checkpoint, tmp_path / "o", "--source", "rtsp://127.0.0.1:9/none") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "rtsp://127.0.0.1:9/none: cannot open the stream" in err


def test_flag_errors(checkpoint, tmp_path, capsys):
    image = tmp_path / "x.jpg"
    cv2.imwrite(str(image), np.zeros((64, 64, 3), np.uint8))
    assert _main(checkpoint, tmp_path / "o", "--source", str(image), "--half") == 2
    assert "--half needs a CUDA device" in capsys.readouterr().err
    assert _main(checkpoint, tmp_path / "o", "--source", str(image), "--classes", "9") == 2
    assert "class ids are 0..4" in capsys.readouterr().err


def test_capture_names():
    assert predict.capture_name(Path("/a/clip.mp4")) == "clip"
    assert predict.capture_name("0") == "camera0"
    assert predict.capture_name("rtsp://host:554/live/cam.sdp") == "cam_sdp"
    assert predict.is_stream("HTTP://x") and not predict.is_stream("clip.mp4")
