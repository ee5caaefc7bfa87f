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
from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes, write_model_cfg
from models.darknet import Darknet
from train_utils.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[2]
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


def test_save_txt_never_replaces_a_datasets_labels(checkpoint, make_shapes_data, tmp_path, capsys):
    """Was: --output d/val --exist-ok --save-txt (--exist-ok moves nothing aside: same names
    are replaced) wrote predictions over the dataset's ground truth d/val/labels/val_000001.txt.
    A labels folder that holds the labels of the images beside it is refused, even with
    --exist-ok: one line, exit 2, the labels byte for byte as they were."""
    split = make_shapes_data(n_train=1, n_val=2).parent / "val"
    source = tmp_path / "imgs" / "val_000001.jpg"
    source.parent.mkdir()
    shutil.copy(split / "images" / "val_000001.jpg", source)
    before = {p: p.read_bytes() for p in split.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _main(checkpoint, split, "--source", str(source), "--exist-ok", "--save-txt") == 2
    assert capsys.readouterr().err == (
        f"error: --output {split}: {split / 'labels'} holds the labels of the images in "
        f"{split / 'images'} (a dataset's), which --save-txt would replace; choose another "
        "--output\n"
    )
    assert {p: p.read_bytes() for p in split.rglob("*") if p.is_file()} == before


def test_exist_ok_never_draws_over_a_datasets_images_or_a_runs_pictures(
    checkpoint, make_shapes_data, tmp_path, capsys
):
    """Was: --exist-ok into a dataset's images folder replaced its training images with drawn
    ones, and into a run folder its train_batch0.jpg. Both refused: one line, exit 2, every
    byte kept. Predictions of other names into a run folder are still written."""
    images = make_shapes_data(n_train=1, n_val=2).parent / "val" / "images"
    source = tmp_path / "imgs" / "val_000001.jpg"
    source.parent.mkdir()
    shutil.copy(images / "val_000001.jpg", source)
    before = {p: p.read_bytes() for p in images.parent.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _main(checkpoint, images, "--source", str(source), "--exist-ok") == 2
    label = images.parent / "labels" / "val_000001.txt"
    assert capsys.readouterr().err == (
        f"error: --output {images}: {images / 'val_000001.jpg'} is a dataset's image (its labels "
        f"are in {label}), which a drawn picture would replace; choose another --output\n"
    )
    assert {p: p.read_bytes() for p in images.parent.rglob("*") if p.is_file()} == before
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text("epoch\n0\n")
    (run / "train_batch0.jpg").write_bytes(b"the run's picture")
    shutil.copy(source, tmp_path / "imgs" / "train_batch0.jpg")
    argv = ["--source", str(tmp_path / "imgs" / "train_batch0.jpg"), "--exist-ok"]
    assert _main(checkpoint, run, *argv) == 2
    assert "is a file of the training run" in capsys.readouterr().err
    assert (run / "train_batch0.jpg").read_bytes() == b"the run's picture"
    assert _main(checkpoint, run, "--source", str(source), "--exist-ok") == 0
    assert (run / "val_000001.jpg").is_file()


def test_save_conf_without_save_txt_says_it_is_ignored(checkpoint, shapes_data, tmp_path, caplog):
    """Was: silently ignored (as YOLOv5 does); now one warning line, and nothing else changes."""
    image = str(sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0])
    line = "--save-conf adds the confidence to --save-txt's labels; ignored without it"
    with caplog.at_level("WARNING"):
        assert _main(checkpoint, tmp_path / "a", "--source", image, "--save-conf") == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [line]
    assert not (tmp_path / "a" / "labels").exists()
    caplog.clear()
    with caplog.at_level("WARNING"):
        argv = ["--source", image, "--save-conf", "--save-txt"]
        assert _main(checkpoint, tmp_path / "b", *argv) == 0
    assert line not in caplog.messages


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
    # One source folder: each output keeps its path inside the folder.
    assert (out / "sub" / "clip.mp4").is_file() and stdout.count("clip.avi frame") == 3
    assert sorted(p.name for p in (out / "labels" / "sub").glob("clip_*.txt")) == [
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


def test_a_camera_that_does_not_exist_is_one_line_without_opencvs_warnings(capfd):
    """Was: OpenCV's own "[ WARN:0@3.141] global cap_v4l.cpp ... can't open camera by index"
    lines on stderr before the project's error. Now they are silenced for the open, and
    OpenCV's log level is the user's again afterwards."""
    log = cv2.utils.logging
    level = log.getLogLevel()
    with pytest.raises(ConfigError, match="--source 99: cannot open camera 99; check"):
        predict.open_video("99")
    assert capfd.readouterr().err == ""
    assert log.getLogLevel() == level


def test_flag_errors(checkpoint, tmp_path, capsys):
    image = tmp_path / "x.jpg"
    cv2.imwrite(str(image), np.zeros((64, 64, 3), np.uint8))
    assert _main(checkpoint, tmp_path / "o", "--source", str(image), "--half") == 2
    assert "--half needs a CUDA device" in capsys.readouterr().err
    assert _main(checkpoint, tmp_path / "o", "--source", str(image), "--classes", "9") == 2
    assert "class ids are 0..4" in capsys.readouterr().err


def test_an_empty_source_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch):
    """Was: --source "" searched the current folder for images (here it would predict on
    x.jpg), or said the default --output was "inside --source ". Now one line."""
    from build_utils.errors import ConfigError
    from predict import plan_outputs

    cv2.imwrite(str(tmp_path / "x.jpg"), np.zeros((8, 8, 3), np.uint8))
    monkeypatch.chdir(tmp_path)
    for source in ("", " "):
        with pytest.raises(ConfigError) as info:
            plan_outputs([str(tmp_path / "x.jpg"), source])
        assert str(info.value) == (
            f"--source {source!r}: an empty source; give an image, folder, video, pattern, "
            "camera index or URL"
        )


def test_capture_names():
    assert predict.capture_name(Path("/a/clip.mp4")) == "clip"
    assert predict.capture_name("0") == "camera0"
    assert predict.capture_name("rtsp://host:554/live/cam.sdp") == "cam_sdp"
    assert predict.is_stream("HTTP://x") and not predict.is_stream("clip.mp4")


def _image(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.full((64, 96, 3), value, np.uint8))
    return path


def _tree(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_output_over_a_source_is_refused(checkpoint, tmp_path, console):
    src = tmp_path / "imgs"
    _image(src / "a.jpg", 50)
    _image(src / "deep" / "b.jpg", 90)
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    before = _tree(tmp_path)
    cases = {
        "same folder": (str(src), src),
        "inside it": (str(src), src / "pred"),
        "a symlink to it": (str(src), tmp_path / "link"),
        "a source given through a symlink": (str(tmp_path / "link"), src / "pred"),
        "holds a source file": (str(src / "deep" / "b.jpg"), src),
        "holds a source folder": (str(src / "deep"), src),
    }
    for case, (source, out) in cases.items():
        assert _main(checkpoint, out, "--source", source, "--save-txt") == 2, case
        err = console.readouterr().err.strip()
        assert err.startswith("error: --output") and "\n" not in err, (case, err)
        assert _tree(tmp_path) == before, case  # nothing written, nothing replaced


def test_same_names_from_several_sources_keep_apart(checkpoint, tmp_path):
    a, b = _image(tmp_path / "a" / "x.jpg", 40), _image(tmp_path / "b" / "x.jpg", 200)
    c = _image(tmp_path / "p" / "b" / "y.jpg", 120)  # a second source folder named 'b'
    _image(tmp_path / "a" / "x.png", 80)  # x.jpg and x.png would share labels/x.txt
    _image(tmp_path / "a" / "x.v2.jpg", 60)  # a dot in the stem stays
    out = tmp_path / "out"
    argv = ["--source", str(a.parent), str(b.parent), str(c.parent), "--save-txt"]
    # Thin boxes without tags: the pictures stay mostly their sources' grey.
    assert _main(checkpoint, out, *argv, "--hide-labels", "--line-thickness", "1") == 0
    # Each folder has its sub-folder (b_2 for the second 'b'); the drawn copies differ as
    # their sources do, and each has its own label file.
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.*")) == [
        "a/x.jpg",
        "a/x.v2.jpg",
        "a/x_2.png",
        "b/x.jpg",
        "b_2/y.jpg",
        "labels/a/x.txt",
        "labels/a/x.v2.txt",
        "labels/a/x_2.txt",
        "labels/b/x.txt",
        "labels/b_2/y.txt",
    ]
    assert cv2.imread(str(out / "a" / "x.jpg")).mean() < cv2.imread(str(out / "b" / "x.jpg")).mean()
    # The same file name given twice as files: the second becomes x_2.
    out2 = tmp_path / "files"
    assert _main(checkpoint, out2, "--source", str(a), str(b)) == 0
    assert sorted(p.name for p in out2.iterdir()) == ["x.jpg", "x_2.jpg"]


def test_a_second_run_never_overwrites_the_first(checkpoint, tmp_path, console):
    src = tmp_path / "imgs"
    _image(src / "a.jpg", 50)
    out = tmp_path / "pred"
    assert _main(checkpoint, out, "--source", str(src)) == 0
    (out / "a.jpg").write_bytes(b"the first run's picture, edited by its user")
    first = _tree(out)
    assert _main(checkpoint, out, "--source", str(src)) == 0
    assert "writing to " + str(tmp_path / "pred2") in console.readouterr().err
    assert _tree(out) == first and (tmp_path / "pred2" / "a.jpg").is_file()
    assert _main(checkpoint, out, "--source", str(src)) == 0
    assert (tmp_path / "pred3" / "a.jpg").is_file()
    # --exist-ok: the user says the folder may be written into.
    assert _main(checkpoint, out, "--source", str(src), "--exist-ok") == 0
    assert (out / "a.jpg").read_bytes() == (tmp_path / "pred2" / "a.jpg").read_bytes()
    # A file where the folder should be: one line.
    (tmp_path / "afile").write_text("x")
    assert _main(checkpoint, tmp_path / "afile", "--source", str(src)) == 2
    assert "is a file where a folder should be" in console.readouterr().err


def test_a_source_without_images_stops(checkpoint, tmp_path, console):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("no pictures here")
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(empty)) == 2
    err = console.readouterr().err.strip()
    assert err.startswith(f"error: --source {empty}: no images or videos") and "\n" not in err
    assert not out.exists()


def test_a_source_with_nothing_readable_is_one_line_before_anything_is_written(tmp_path):
    """``--source /dev/zero`` or a folder holding only a FIFO named like an image: nothing to
    predict on, one line (the old code drew "0 images" and made the output folder)."""
    import os

    from build_utils.errors import ConfigError
    from predict import plan_outputs

    folder = tmp_path / "fifos"
    folder.mkdir()
    os.mkfifo(folder / "x.jpg")
    with pytest.raises(ConfigError) as info:
        plan_outputs(["/dev/zero"])
    assert str(info.value) == (
        "--source: nothing readable to predict on: /dev/zero: "
        "a character device, not a regular file"
    )
    with pytest.raises(ConfigError, match=r"fifos/x\.jpg: a FIFO \(named pipe\)"):
        plan_outputs([str(folder)])
    good = tmp_path / "ok.jpg"
    good.write_bytes(b"not decoded here")
    assert [o.source for o in plan_outputs([str(folder), str(good)])][-1] == good


# ---- sources: patterns, nothing to predict on, cameras --------------------------------------


def test_a_quoted_glob_is_a_source(checkpoint, tmp_path, capsys):
    """Was "no such file": YOLOv5's ``--source 'dir/val_0001*.jpg'`` (the shell left the
    pattern alone) now predicts on the files it matches, ``**`` reaching into sub-folders."""
    for name in ("val_00010.jpg", "val_00011.jpg", "val_00020.jpg", "deep/val_00012.jpg"):
        _image(tmp_path / "dir" / name, 60)
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(tmp_path / "dir" / "val_0001*.jpg")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["val_00010.jpg", "val_00011.jpg"]
    out2 = tmp_path / "out2"
    assert _main(checkpoint, out2, "--source", str(tmp_path / "dir" / "**" / "val_0001*.jpg")) == 0
    assert sorted(p.name for p in out2.iterdir()) == [
        "val_00010.jpg",
        "val_00011.jpg",
        "val_00012.jpg",
    ]
    capsys.readouterr()
    assert _main(checkpoint, tmp_path / "o", "--source", str(tmp_path / "dir" / "x*.jpg")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --source {tmp_path / 'dir' / 'x*.jpg'}: no file matches")
    assert not (tmp_path / "o").exists()


def test_a_source_with_no_images_writes_nothing(checkpoint, tmp_path, capsys):
    """Was: exit 0 and an empty output folder for a source holding no image (a text file)."""
    notes = tmp_path / "notes.md"
    notes.write_text("not a picture")
    assert _main(checkpoint, tmp_path / "o", "--source", str(notes)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --source: nothing readable to predict on: ")
    assert "not an image or video file" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_a_txt_list_of_image_paths(checkpoint, shapes_data, tmp_path, capsys, caplog):
    """Was: `--source val.txt` (YOLOv5 takes a list) refused as 'not an image or video file'.
    Relative entries are taken beside the list, a missing one is skipped with its reason."""
    images = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[:2]
    listing = tmp_path / "lists" / "some.txt"
    listing.parent.mkdir()
    shutil.copy(images[1], listing.parent / images[1].name)
    listing.write_text(f"# two images\n{images[0]}\n\nmissing.jpg\n{images[1].name}\n")
    out = tmp_path / "o"
    assert _main(checkpoint, out, "--source", str(listing), "--save-txt") == 0
    captured = capsys.readouterr()
    assert captured.out.count(" detections") == 2
    assert f"skipped: {listing.parent / 'missing.jpg'}: image file not found" in caplog.messages
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [images[0].name, images[1].name, "labels"]
    )
    assert (out / "labels" / f"{images[1].stem}.txt").is_file()

    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing listed\n")
    assert _main(checkpoint, tmp_path / "o2", "--source", str(empty)) == 2
    err = capsys.readouterr().err
    assert err == f"error: --source {empty}: no image or video paths in this list\n"
    assert not (tmp_path / "o2").exists()


class _NoFrames:
    """A camera that opens and then gives no frame (unplugged, or taken by another program)."""

    def isOpened(self) -> bool:  # OpenCV's name
        return True

    def get(self, prop: int) -> float:
        return 0.0

    def grab(self) -> bool:
        return False

    def read(self) -> tuple[bool, None]:
        return False, None

    def release(self) -> None:
        pass


def test_a_camera_that_gives_nothing_writes_nothing(checkpoint, tmp_path, monkeypatch, capsys):
    """Was: exit 0 with an empty output folder (a camera that cannot open: exit 2, but the
    folder was made first)."""
    monkeypatch.setattr(predict, "open_capture", lambda source: _NoFrames())
    assert _main(checkpoint, tmp_path / "o", "--source", "0", "--save-txt") == 2
    assert "no image or video frame could be read" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(predict, "open_capture", lambda source: cv2.VideoCapture())
    assert _main(checkpoint, tmp_path / "o", "--source", "3") == 2
    assert "cannot open camera 3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_replayed_precision_is_logged(checkpoint, tmp_path, caplog):
    """As validation.py does: the autocast dtype (or none), where it came from and the memory
    format (predict.py's inputs are contiguous)."""
    image = _image(tmp_path / "x.jpg", 80)
    caplog.set_level("INFO")
    assert _main(checkpoint, tmp_path / "o", "--source", str(image)) == 0
    assert "precision: full (float32) (--amp auto), contiguous" in caplog.text
    assert _main(checkpoint, tmp_path / "o2", "--source", str(image), "--amp", "off") == 0
    assert "precision: full (float32) (--amp off), contiguous" in caplog.text


def test_a_sub_folder_of_which_nothing_was_read_leaves_no_empty_folders(checkpoint, tmp_path):
    # Was: OUTPUT/bad/ and OUTPUT/labels/bad/ stayed, empty, for a sub-folder of unreadable images.
    src = tmp_path / "src"
    (src / "bad" / "deeper").mkdir(parents=True)
    (src / "bad" / "empty.jpg").write_bytes(b"")
    (src / "bad" / "deeper" / "cut.jpg").write_bytes(b"\xff\xd8\xff")  # a truncated JPEG
    (src / "good").mkdir()
    _image(src / "good" / "a.jpg", 90)
    out = tmp_path / "out"
    assert _main(checkpoint, out, "--source", str(src), "--save-txt") == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "good",
        "good/a.jpg",
        "labels",
        "labels/good",
        "labels/good/a.txt",
    ]


def test_an_interrupted_video_is_kept_and_said_to_be_partial(tmp_path, caplog):
    # Was: Ctrl-C kept out/clip.mp4 with the frames so far and only said "interrupted".
    clip = _video(tmp_path / "clip.mp4", frames=5)
    calls = []

    def predictor(frame):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return torch.zeros(0, 6)

    out = tmp_path / "out"
    out.mkdir()
    saver = predict.Saver(out, NAMES)
    with caplog.at_level("WARNING", logger="predict"), pytest.raises(KeyboardInterrupt):
        predict.predict_video(predictor, clip, saver, Path("clip"))
    cap = cv2.VideoCapture(str(out / "clip.mp4"))
    assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) == 2
    cap.release()
    assert f"{clip}: interrupted; {out / 'clip.mp4'} holds its first 2 frames" in caplog.text
    assert sorted(p.name for p in out.iterdir()) == ["clip.mp4"]  # no temporary left


def test_a_source_folder_enters_linked_folders(checkpoint, shapes_data, tmp_path, capsys):
    """Was: images in a linked sub-folder of a --source folder were skipped in silence."""
    image = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(image, part / "b.jpg")
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "linked").symlink_to(part)
    (folder / "loop").symlink_to(folder)
    out = tmp_path / "o"
    assert _main(checkpoint, out, "--source", str(folder)) == 0
    assert capsys.readouterr().out.count(" detections") == 1
    assert (out / "linked" / "b.jpg").is_file()
