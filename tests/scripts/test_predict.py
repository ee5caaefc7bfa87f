"""predict.py on images, folders and a video, with class names from the checkpoint."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import predict
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes, write_model_cfg
from models.darknet import Darknet
from train_utils.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[2]
NAMES = ["circle", "square", "triangle", "star", "cross"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 5-class nano model whose head biases make every box confident, as a lineage-style
    checkpoint carrying its cfg and class names."""
    d = tmp_path_factory.mktemp("ckpt")
    blocks = rewrite_cfg_classes(parse_model_cfg(REPO / "cfg" / "yolov3-spp-nano.cfg"), 5)
    write_model_cfg(blocks, d / "model.cfg")
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(128, 128))
    with torch.no_grad():
        for i in model.yolo_layers:
            bias = model.module_list[i - 1].Conv2d.bias.view(3, -1)
            bias[:, 4] = 5.0  # objectness ~ 1
            bias[:, 5] = 5.0  # class 0 wins
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


def test_images_folders_and_video(checkpoint, shapes_data, tmp_path, capsys):
    images = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[:3]
    folder = tmp_path / "folder"
    folder.mkdir()
    for p in images[1:]:
        (folder / p.name).write_bytes(p.read_bytes())
    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 5, (160, 120))
    for k in range(3):
        writer.write(np.full((120, 160, 3), 40 * k, np.uint8))
    writer.release()
    out = tmp_path / "out"
    code = predict.main(
        [
            "--weights",
            str(checkpoint),
            "--source",
            str(images[0]),
            str(folder),
            str(video),
            "--output",
            str(out),
            "--img-size",
            "128",
            "--device",
            "cpu",
            "--conf-thres",
            "0.5",
        ]
    )
    assert code == 0
    stdout = capsys.readouterr().out
    # Several sources: the folder's images go to a sub-folder named after it.
    assert (out / images[0].name).is_file()
    for p in images[1:]:
        assert (out / "folder" / p.name).is_file() and not (out / p.name).exists()
    for p in images:
        assert any(p.name in x and "detections" in x for x in stdout.splitlines()), p
    # The biased heads make every kept box a confident 'circle', drawn inside the image.
    first = next(x for x in stdout.splitlines() if x.startswith(str(images[0])))
    assert "circle" in first
    img = cv2.imread(str(out / images[0].name))
    assert img.shape == cv2.imread(str(images[0])).shape
    assert (out / "clip.mp4").is_file() and stdout.count("clip.mp4 frame") == 3


def test_bad_inputs(checkpoint, tmp_path, capsys, caplog):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not an image")
    code = predict.main(
        [
            "--weights",
            str(checkpoint),
            "--source",
            str(bad),
            "--output",
            str(tmp_path / "o"),
            "--img-size",
            "128",
            "--device",
            "cpu",
        ]
    )
    # Nothing readable at all: exit 2 and no output folder (was: exit 0, an empty folder).
    assert code == 2 and "skipped" in caplog.text and not (tmp_path / "o").exists()
    assert "no image or video frame could be read" in capsys.readouterr().err
    assert predict.main(["--weights", str(tmp_path / "none.pt"), "--source", str(bad)]) == 2
    assert "weights file not found" in capsys.readouterr().err
    assert (
        predict.main(
            [
                "--weights",
                str(checkpoint),
                "--source",
                str(tmp_path / "nothing"),
                "--img-size",
                "128",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert "--source: no such file or folder" in capsys.readouterr().err
    assert (
        predict.main(["--weights", str(checkpoint), "--source", str(bad), "--img-size", "100"]) == 2
    )


def test_a_picture_smaller_than_img_size_gets_the_boxes_validation_scored(
    checkpoint, shapes_data, tmp_path
):
    """Was: predict.py did not enlarge a picture smaller than --img-size while validation's
    loader does (as the lineage's and YOLOv5's detect both do), so the boxes drawn were not
    the boxes scored. Both now see the same input: the same boxes, in the same pixels."""
    import validation

    src = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    image = tmp_path / "data" / "images" / "small.jpg"  # square: no padding to differ by
    image.parent.mkdir(parents=True)
    cv2.imwrite(str(image), cv2.resize(cv2.imread(str(src)), (200, 200)))
    (tmp_path / "data" / "labels").mkdir()
    label = shapes_data.parent / "val" / "labels" / f"{src.stem}.txt"
    (tmp_path / "data" / "labels" / "small.txt").write_text(label.read_text())
    (tmp_path / "one.txt").write_text(f"{image}\n")
    data = tmp_path / "one.data"
    names = shapes_data.parent / "shapes.names"
    data.write_text(
        f"classes=5\ntrain={tmp_path / 'one.txt'}\nvalid={tmp_path / 'one.txt'}\nnames={names}\n"
    )
    same = ["--weights", str(checkpoint), "--img-size", "320", "--conf-thres", "0.5"]
    same += ["--iou-thres", "0.6", "--device", "cpu", "--amp", "off", "--save-txt", "--save-conf"]
    assert predict.main([*same, "--source", str(image), "--output", str(tmp_path / "p")]) == 0
    val = ["--data", str(data), "--batch-size", "1", "--no-multi-label", "--no-plots"]
    assert validation.main([*same, *val, "--save-dir", str(tmp_path / "v")]) == 0

    def rows(path: Path) -> np.ndarray:
        return np.array(
            sorted([float(v) for v in r.split()] for r in path.read_text().splitlines())
        )

    ours = rows(tmp_path / "p" / "labels" / "small.txt")
    scored = rows(tmp_path / "v" / "labels" / "small.txt")
    assert len(ours) > 0 and ours.shape == scored.shape
    np.testing.assert_allclose(ours, scored, atol=1e-4)
