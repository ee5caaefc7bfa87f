"""Hostile and broken input through the real entry points: one clear line (exit 2) or a skip with
its reason in the report, bounded memory, no hang, nothing written outside the dataset or run.

One section per family of issue #24 (``build_utils/limits.py`` holds the limits). Each test runs
the script as a user would, in a process of its own (:func:`run_script`, forked from an
interpreter that has imported torch), so a hang is a timeout, a traceback is visible on stderr
and the peak memory of that one process is measured (its own ``ru_maxrss``). An address-space
cap on the child keeps a regression from taking the shared test machine's memory with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import warm_python

from tests.conftest import REPO_ROOT, script_env

# A child may not map more than this: the old code's 11.7 GB YAML or 6.3 GB PNG decode fails
# fast instead of swapping the machine. torch itself maps about 2-3 GB of address space.
CHILD_ADDRESS_SPACE = 12 << 30
# What a bounded run may use at most (peak RSS of the script process): torch, OpenCV and a
# nano model at 64-128 px need about 0.5-1 GB.
BOUNDED_RSS_MB = 2500


@dataclass
class ScriptResult:
    rc: int
    stdout: str
    stderr: str
    peak_rss_mb: float
    seconds: float

    def error_lines(self) -> list[str]:
        """Non-empty stderr lines that are not log lines (the one ``error: ...`` line)."""
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]


def run_script(
    script: str,
    *args: str | Path,
    cwd: Path,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> ScriptResult:
    """Run ``python <repo>/<script> args`` in ``cwd`` (forked warm: tests/warm_python.py); its
    exit status, output, and the peak resident memory of that process alone. A run over
    ``timeout`` seconds (a hang) fails the test with what it printed so far."""
    cmd = [sys.executable, str(REPO_ROOT / script), *map(str, args)]
    start = time.monotonic()
    env = {**script_env(), **(env or {})}
    proc = warm_python.start(cmd, cwd=cwd, env=env, address_space=CHILD_ADDRESS_SPACE)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        out, err = proc.output()
        pytest.fail(
            f"{script} hung for {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        )
    seconds = time.monotonic() - start
    out, err = proc.output()
    peak = proc.peak_rss_mb
    return ScriptResult(proc.returncode, out, err, float("inf") if peak is None else peak, seconds)


def assert_one_line(result: ScriptResult, *fragments: str) -> str:
    """Exit 2, no traceback, exactly one ``error:`` line holding every fragment; the line."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.rc == 2, (result.rc, result.stderr[-3000:])
    lines = result.error_lines()
    assert len(lines) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert len(lines[0]) < 600, f"an error line of {len(lines[0])} characters"
    return lines[0]


# =============================================================================================
# Family 1a: resource exhaustion by small YAML files (billion laughs, huge documents)
# =============================================================================================


def _fake_dataset(root: Path) -> Path:
    """A ``.data`` whose lists and names exist (all that flag, hyp and ``.data`` validation
    reads): configuration mistakes are found before any image would be opened."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.txt").write_text("images/a.jpg\n")
    (root / "val.txt").write_text("images/a.jpg\n")
    (root / "x.names").write_text("".join(f"c{i}\n" for i in range(5)))
    data = root / "x.data"
    data.write_text(f"classes=5\ntrain={root / 'train.txt'}\nvalid={root / 'val.txt'}\n")
    data.write_text(data.read_text() + f"names={root / 'x.names'}\n")
    return data


def _yaml_bomb_hyp(levels: int = 10, fan: int = 10) -> str:
    """The repository's hyp.yaml whose FIRST value holds every level of nested aliases:
    ``fan ** levels`` strings once expanded, so the old reader's error line (``got [[[...``,
    the value's repr) had to expand them all. About 3 KB."""
    items = ["&l0 [" + ", ".join(['"lol"'] * fan) + "]"]
    for i in range(1, levels):
        items.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]")
    rest = (REPO_ROOT / "cfg" / "hyp.yaml").read_text().splitlines()
    rest = [line for line in rest if not line.startswith("giou:")]
    return "giou:\n" + "".join(f"  - {item}\n" for item in items) + "\n".join(rest) + "\n"


def test_billion_laughs_hyp_is_one_line_quickly_with_bounded_memory(tmp_path):
    """Issue #24's 3 KB hyp.yaml of nested aliases: was 63 s, 11.7 GB and a 2.1 GB error line."""
    data = _fake_dataset(tmp_path / "d")
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(_yaml_bomb_hyp())
    assert 1000 < hyp.stat().st_size < 4000
    out = tmp_path / "run"
    args = ["--data", data, "--cfg", REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg", "--hyp", hyp]
    result = run_script("train.py", *args, "--output-dir", out, cwd=tmp_path, timeout=60)
    line = assert_one_line(
        result,
        f"error: {hyp}:",
        "a YAML document of at least",
        "over the limit of 100000 nodes",
        "set YOLO_MAX_YAML_NODES to raise it",
    )
    assert len(line) < 400
    assert result.peak_rss_mb < BOUNDED_RSS_MB, result.peak_rss_mb
    assert result.seconds < 30
    assert not out.exists()


# =============================================================================================
# Family 1b: resource exhaustion by images (pixel bombs, huge sparse files)
# =============================================================================================


def _nano_checkpoint(folder: Path) -> Path:
    """A 1-class nano checkpoint carrying its cfg and names (predict.py needs --weights only)."""
    import torch

    from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes, write_model_cfg
    from models.darknet import Darknet
    from tests.conftest import NANO_CFG
    from train_utils.checkpoint import save_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 1)
    write_model_cfg(blocks, folder / "model.cfg")
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(64, 64))
    path = folder / "model.pt"
    ckpt = {"model": model.state_dict(), "epoch": -1, "names": ["shape"]}
    save_checkpoint({**ckpt, "cfg": (folder / "model.cfg").read_text()}, path)
    return path


def _files_under(root: Path) -> set[Path]:
    """Every file and link under ``root`` (links not followed: a loop is listed, not entered)."""
    return {Path(d) / f for d, dirs, files in os.walk(root) for f in files + dirs}


def _reports(root: Path) -> str:
    """Every dataset report under ``root``, wherever the label cache puts it."""
    return "".join(p.read_text() for p in sorted(root.rglob("*cache_report.txt")))


@pytest.mark.slow
def test_pixel_bomb_and_40_gb_sparse_jpg_in_training_are_skipped(make_shapes_data, tmp_path):
    """A valid 76 KB PNG declaring 25000x25000 pixels (the old code decoded it: GBs) and a
    40 GB sparse .jpg (the old code read it whole) in the training list: both excluded with
    the limit they break, the run completes, its memory stays bounded."""
    from tests.build_utils.test_image_io import sparse_file, write_png
    from tests.conftest import train_argv

    data = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 96))
    root = data.parent
    images = root / "train" / "images"
    write_png(images / "bomb.png", 25000, 25000)
    sparse_file(images / "huge.jpg", 40 << 30)
    with open(root / "train.txt", "a") as f:
        f.write("train/images/bomb.png\ntrain/images/huge.jpg\n")
    out = tmp_path / "run"
    r = run_script("train.py", *train_argv(data, out, img=64), cwd=tmp_path, timeout=240)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.rc == 0, r.stderr[-3000:]
    assert (out / "last.pt").is_file()
    report = _reports(root)
    assert (
        f"{images / 'bomb.png'}: excluded: image of 25000x25000 = 625000000 pixels, over the "
        "limit of 150000000 pixels (decoded pixels per image); set YOLO_MAX_IMAGE_PIXELS to "
        "raise it"
    ) in report
    assert (
        f"{images / 'huge.jpg'}: excluded: 40 GiB, over the limit of 512 MiB (bytes per image "
        "file); set YOLO_MAX_IMAGE_BYTES to raise it"
    ) in report
    assert (
        "6 images: " in r.stderr
        and "2 images excluded for an unusable image or label file" in r.stderr
    )
    assert r.peak_rss_mb < BOUNDED_RSS_MB, r.peak_rss_mb


def test_pixel_bomb_and_40_gb_sparse_jpg_are_skipped_by_predict(tmp_path):
    from tests.build_utils.test_image_io import good_jpeg, sparse_file, write_png

    weights = _nano_checkpoint(tmp_path / "ckpt")
    src = tmp_path / "src"
    src.mkdir()
    bomb = write_png(src / "bomb.png", 25000, 25000)
    huge = sparse_file(src / "huge.jpg", 40 << 30)
    good = good_jpeg(src / "ok.jpg", 64, 48)
    out = tmp_path / "out"
    args = ["--weights", weights, "--source", bomb, huge, good, "--output", out]
    r = run_script("predict.py", *args, "--img-size", "64", "--device", "cpu", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.rc == 0, r.stderr[-3000:]
    assert (
        f"skipped: {bomb}: image of 25000x25000 = 625000000 pixels, over the limit of "
        "150000000 pixels (decoded pixels per image); set YOLO_MAX_IMAGE_PIXELS to raise it"
    ) in r.stderr
    assert (
        f"skipped: {huge}: 40 GiB, over the limit of 512 MiB (bytes per image file); "
        "set YOLO_MAX_IMAGE_BYTES to raise it"
    ) in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["ok.jpg"]
    assert r.peak_rss_mb < BOUNDED_RSS_MB, r.peak_rss_mb


# =============================================================================================
# Family 1c: resource exhaustion by weights and image sizes (huge .weights, --img-size 65536)
# =============================================================================================


def _f1c_sparse_files(folder: Path) -> dict[str, Path]:
    """A 40 GB sparse Darknet ``.weights`` (a valid v0.2 header, then holes) and ``.pt`` (a zip
    signature, then holes): no disk used, but a reader that reads them whole needs 40 GB."""
    import numpy as np

    files = {"weights": folder / "big.weights", "pt": folder / "big.pt"}
    with files["weights"].open("wb") as f:
        f.write(np.array([0, 2, 0], "<i4").tobytes() + np.array([0], "<i8").tobytes())
        f.truncate(40 << 30)
    with files["pt"].open("wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(40 << 30)
    return files


def _f1c_image_folder(folder: Path) -> Path:
    import cv2
    import numpy as np

    folder.mkdir()
    cv2.imwrite(str(folder / "a.jpg"), np.full((64, 64, 3), 127, np.uint8))
    return folder


def test_img_size_65536_is_one_line(shapes_data, tmp_path):
    """Was: a 12 GB batch allocated, then a traceback. Now the limit, before anything is built."""
    from tests.conftest import train_argv

    out = tmp_path / "run"
    result = run_script("train.py", *train_argv(shapes_data, out, img=65536), cwd=tmp_path)
    assert_one_line(
        result,
        "--img-size 65536 is larger than the limit 8192 (pixels per side of --img-size)",
        "set YOLO_MAX_IMG_SIZE to raise it",
    )
    assert result.peak_rss_mb < BOUNDED_RSS_MB
    assert not out.exists()


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        ("train.py", "weights"),
        ("validation.py", "pt"),
        ("predict.py", "pt"),
        ("predict.py", "weights"),
    ],
)
def test_a_40_gb_sparse_weights_file_is_one_line(shapes_data, tmp_path, script, kind):
    """Was: read whole (MemoryError traceback, or 40 GB of RAM). Now refused from its size."""
    from tests.conftest import NANO_CFG, train_argv

    big = _f1c_sparse_files(tmp_path)[kind]
    out = tmp_path / "out"
    if script == "train.py":
        args = train_argv(shapes_data, out, "--weights", str(big))
    elif script == "validation.py":
        args = ["--weights", big, "--data", shapes_data, "--save-dir", out]
    else:
        source = _f1c_image_folder(tmp_path / "images")
        args = ["--weights", big, "--cfg", NANO_CFG, "--source", source, "--output", out]
    result = run_script(script, *args, cwd=tmp_path)
    assert_one_line(
        result,
        str(big),
        "40 GiB, over the limit of 8 GiB (bytes per weights or checkpoint file)",
        "set YOLO_MAX_WEIGHTS_BYTES to raise it",
    )
    assert result.peak_rss_mb < BOUNDED_RSS_MB
    assert not out.exists()


# =============================================================================================
# Family 2: files that are not files (FIFOs, devices, sockets, folders named x.jpg, link loops)
# =============================================================================================


@pytest.mark.slow
def test_files_that_are_not_files_are_skipped_by_training_and_validation(
    make_shapes_data, tmp_path
):
    """One train.py run carrying every kind: a FIFO x.jpg in the training folder (the old code
    waited on it forever), a link loop named like an image and a folder link back to its parent,
    a FIFO as a label file; /dev/zero, a link to it, a folder named x.jpg and a dangling link
    in the validation list. Each is excluded with its reason in its split's report, the run
    completes, validation.py skips them too, and nothing is written outside the dataset and
    the run folder."""
    from tests.conftest import train_argv, validation_argv

    data = make_shapes_data(n_train=5, n_val=2, img_size_range=(64, 96))
    root = data.parent
    train_images = root / "train" / "images"
    val_images = root / "val" / "images"
    first = sorted(train_images.glob("*.jpg"))[0]
    os.mkfifo(train_images / "fifo.jpg")
    (train_images / "loop.jpg").symlink_to("loop.jpg")
    (train_images / "back").symlink_to(train_images)  # a folder loop: never entered
    fifo_label = root / "train" / "labels" / f"{first.stem}.txt"
    fifo_label.unlink()
    os.mkfifo(fifo_label)
    (val_images / "zero.jpg").symlink_to("/dev/zero")
    (val_images / "dir.jpg").mkdir()
    (val_images / "dangling.jpg").symlink_to("gone.jpg")
    with open(root / "val.txt", "a") as f:
        f.write("/dev/zero\nval/images/zero.jpg\nval/images/dir.jpg\nval/images/dangling.jpg\n")
    data.write_text(data.read_text().replace("train=train.txt", "train=train/images"))
    before = _files_under(tmp_path)
    out = tmp_path / "run"

    r = run_script("train.py", *train_argv(data, out, img=64), cwd=tmp_path, timeout=240)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.rc == 0, r.stderr[-3000:]
    assert (out / "last.pt").is_file()
    report = _reports(root)
    for path, reason in [
        (train_images / "fifo.jpg", "a FIFO (named pipe), not a regular file"),
        (train_images / "loop.jpg", "a symbolic link loop"),
        (first, f"label file {fifo_label}: a FIFO (named pipe), not a regular file"),
        ("/dev/zero", "a character device, not a regular file"),
        (val_images / "zero.jpg", "a character device, not a regular file"),
        (val_images / "dir.jpg", "a folder, not a file"),
        (val_images / "dangling.jpg", "dangling symbolic link"),
    ]:
        assert f"{path}: excluded: {reason}\n" in report, (path, report)
    assert (
        "train: 7 images: " in r.stderr
        and "3 images excluded for an unusable image or label file" in r.stderr
    )
    assert (
        "val: 6 images: " in r.stderr
        and "4 images excluded for an unusable image or label file" in r.stderr
    )

    stats, val_dir = tmp_path / "stats.json", tmp_path / "val"
    argv = validation_argv(out / "model.cfg", data, out / "last.pt", img=64)
    argv += ["--json-out", str(stats), "--save-dir", str(val_dir)]
    v = run_script("validation.py", *argv, cwd=tmp_path, timeout=120)
    assert "Traceback" not in v.stderr, v.stderr[-3000:]
    assert v.rc == 0, v.stderr[-3000:]
    assert (
        "val: 6 images: " in v.stderr
        and "4 images excluded for an unusable image or label file" in v.stderr
    )
    new = _files_under(tmp_path) - before
    outside = [
        p
        for p in new
        if not p.is_relative_to(out)
        and not p.is_relative_to(val_dir)
        and p != stats
        and not (p.is_relative_to(root) and ".cache" in p.name)
    ]
    assert outside == [], outside


def test_files_that_are_not_files_are_skipped_by_predict(tmp_path):
    """A source folder holding a FIFO x.jpg, a FIFO clip.mp4, a socket and a link loop, and a
    FIFO given by name: each skipped with its reason (the old code passed over the folder's
    silently and refused the named FIFO as missing), the real image drawn."""
    from tests.build_utils.test_image_io import bind_socket, good_jpeg

    weights = _nano_checkpoint(tmp_path / "ckpt")
    src = tmp_path / "src"
    src.mkdir()
    good_jpeg(src / "ok.jpg", 64, 48)
    os.mkfifo(src / "fifo.jpg")
    os.mkfifo(src / "clip.mp4")
    bind_socket(src / "sock.jpg")
    (src / "loop.jpg").symlink_to("loop.jpg")
    named = tmp_path / "named.jpg"
    os.mkfifo(named)
    out = tmp_path / "out"
    args = ["--weights", weights, "--source", src, named, "--output", out]
    r = run_script("predict.py", *args, "--img-size", "64", "--device", "cpu", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.rc == 0, r.stderr[-3000:]
    for path, reason in [
        (src / "fifo.jpg", "a FIFO (named pipe), not a regular file"),
        (src / "clip.mp4", "a FIFO (named pipe), not a regular file"),
        (src / "sock.jpg", "a socket, not a regular file"),
        (src / "loop.jpg", "a symbolic link loop"),
        (named, "a FIFO (named pipe), not a regular file"),
    ]:
        assert f"skipped: {path}: {reason}\n" in r.stderr, path
    drawn = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert drawn == ["src/ok.jpg"]


# =============================================================================================
# Family 3: values that pass validation and then explode (cfg values, checkpoint contents)
# =============================================================================================


def _f3_edited_nano(folder: Path, old: str, new: str, nth: int = 1) -> tuple[Path, int]:
    """The nano cfg with the ``nth`` line equal to ``old`` replaced by ``new``; the file and
    the line number of the edit."""
    from tests.conftest import NANO_CFG

    lines = NANO_CFG.read_text().splitlines()
    index = [i for i, line in enumerate(lines) if line == old][nth - 1]
    lines[index] = new
    path = folder / "edited.cfg"
    path.write_text("\n".join(lines) + "\n")
    return path, index + 1


# (line to edit, its replacement, which occurrence, what the one line says after "file:line: ")
EXPLODING_CFG_VALUES = {
    "filters_a_billion": (
        "filters=16",
        "filters=1000000000",
        1,
        "[convolutional]: filters=1000000000 is over the limit: allowed 1..65536",
    ),
    "maxpool_size_a_million": (
        "size=5",
        "size=1000000",
        1,
        "[maxpool]: size=1000000 is over the limit: allowed 1..63",
    ),
    "conv_stride_a_million": (
        "stride=2",
        "stride=1000000",
        1,
        "[convolutional]: stride=1000000 is over the limit: allowed 1..32",
    ),
    "net_channels_1": (
        "channels=3",
        "channels=1",
        1,
        "[net]: channels=1: only channels=3 is supported",
    ),
    "net_channels_1000": (
        "channels=3",
        "channels=1000",
        1,
        "[net]: channels=1000: only channels=3 is supported",
    ),
}


@pytest.mark.parametrize("case", sorted(EXPLODING_CFG_VALUES))
def test_a_cfg_value_that_would_explode_is_one_line_naming_its_line(shapes_data, tmp_path, case):
    """Was: a RuntimeError traceback at build or forward (or a 108 GB allocation). Now one line
    at the cfg's line, before a run folder exists. In-process: the process adds nothing here."""
    import contextlib
    import io

    import train
    from tests.conftest import train_argv

    old, new, nth, says = EXPLODING_CFG_VALUES[case]
    cfg, line = _f3_edited_nano(tmp_path, old, new, nth)
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(train_argv(shapes_data, out, cfg=cfg))
    errors = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err.getvalue()[-3000:]
    assert errors[0].startswith(f"error: {cfg}:{line}: {says}")
    assert "Traceback" not in err.getvalue()
    assert not out.exists()


@pytest.fixture(scope="module")
def family3_run(tmp_path_factory, shapes_data) -> Path:
    """A checkpoint the product wrote: one epoch of nano at 64 px."""
    from tests.conftest import run_training, train_argv

    out = tmp_path_factory.mktemp("family3") / "run"
    run_training(train_argv(shapes_data, out, "--notest", img=64))
    return out / "last.pt"


def _f3_two_wide_convs(text: str) -> str:
    """``text`` (a cfg) with its first two 3x3 convolutions 65536 filters wide: each value is
    within its bounds, the second layer's weights are 65536 x 65536 x 3 x 3 (154 GB)."""
    blocks = text.split("\n\n")
    wide = 0
    for i, block in enumerate(blocks):
        if block.startswith("[convolutional]") and "size=3" in block and wide < 2:
            blocks[i] = "\n".join(
                "filters=65536" if ln.startswith("filters=") else ln for ln in block.splitlines()
            )
            wide += 1
    return "\n\n".join(blocks)


@pytest.mark.parametrize("edit", ["filters_a_billion", "two_wide_layers"])
def test_a_checkpoint_whose_cfg_explodes_is_one_line_through_predict(family3_run, tmp_path, edit):
    """Was: predict.py allocating 108 GB for the checkpoint's own cfg. Now the cfg's bounds, or
    the model's memory estimate, refuse it in one line with bounded memory."""
    import torch

    ckpt = torch.load(family3_run, map_location="cpu", weights_only=True)
    if edit == "filters_a_billion":
        ckpt["cfg"] = ckpt["cfg"].replace("filters=16", "filters=1000000000", 1)
        says = "[convolutional]: filters=1000000000 is over the limit: allowed 1..65536"
    else:
        ckpt["cfg"] = _f3_two_wide_convs(ckpt["cfg"])
        says = "[convolutional] layer 1: the model does not fit: about 14"  # 147 GiB
    bad = tmp_path / "bad.pt"
    torch.save(ckpt, bad)
    source = _f1c_image_folder(tmp_path / "images")
    out = tmp_path / "out"
    result = run_script(
        "predict.py", "--weights", bad, "--source", source, "--output", out, cwd=tmp_path
    )
    line = assert_one_line(result, f"{bad} (its cfg):", says)
    if edit == "two_wide_layers":
        assert "GiB needed up to this layer (inference, batch 1, 64x64 px)" in line
    assert result.peak_rss_mb < BOUNDED_RSS_MB, line
    assert not out.exists()


def test_resume_from_a_garbage_optimizer_state_is_one_line(family3_run, tmp_path):
    """Was: a TypeError/ValueError traceback at the first step or at load. Now one line; the
    run folder keeps its checkpoint as it was."""
    import shutil

    import torch

    ckpt = torch.load(family3_run, map_location="cpu", weights_only=True)
    first = next(iter(ckpt["optimizer"]["state"]))
    ckpt["optimizer"]["state"][first] = {"momentum_buffer": "not a tensor"}
    folder = tmp_path / "runs" / "bad"
    shutil.copytree(family3_run.parent, folder)
    torch.save(ckpt, folder / "last.pt")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".pt"}
    result = run_script("train.py", "--resume", folder / "last.pt", cwd=tmp_path)
    assert_one_line(
        result,
        f"{folder / 'last.pt'}: the checkpoint's optimizer state is damaged: parameter {first}: "
        "momentum_buffer 'not a tensor'",
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix == ".pt"} == before


def _f3_rewritten_zip(path: Path, obj: dict, edit, deflate: bool = False) -> Path:
    """``torch.save(obj)`` at ``path`` with each member's bytes passed through ``edit(name,
    data)`` (the pickle or a tensor's storage), deflated when ``deflate``."""
    import io
    import zipfile

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = edit(info.filename, src.read(info.filename))
            kind = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            dst.writestr(info.filename, data, compress_type=kind)
    return path


def test_a_checkpoint_nested_deep_or_unpacking_past_the_limit_is_one_line(tmp_path):
    """A 1 MB checkpoint of lists nested 100,000 deep (weights_only unpickling follows it, the
    walk of the dict after it did not: a RecursionError traceback), and a 0.1 MB zip checkpoint
    whose deflated storage unpacks to 100 MB (over a lowered YOLO_MAX_WEIGHTS_BYTES: the limit
    held the file's size, not what it unpacks to, so a 2 MB file filled 2 GB)."""
    import struct

    depth = 100_000
    nested_pickle = b"\x80\x02}X\x05\x00\x00\x00extra" + b"]" * depth + b"a" * (depth - 1)
    nested = _f3_rewritten_zip(
        tmp_path / "nested.pt",
        {"extra": 0},
        lambda name, data: nested_pickle + b"s." if name.endswith("data.pkl") else data,
    )
    numel = 25 << 20  # float32: 100 MB unpacked

    def bomb_edit(name: str, data: bytes) -> bytes:
        if name.endswith("data.pkl"):
            return data.replace(b"M\xe8\x03", b"J" + struct.pack("<i", numel))
        return bytes(4 * numel) if name.endswith("/0") else data

    import torch

    bomb = _f3_rewritten_zip(
        tmp_path / "bomb.pt", {"model": {"w": torch.zeros(1000)}}, bomb_edit, deflate=True
    )
    assert bomb.stat().st_size < 1 << 20
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (64, 48)).save(images / "a.jpg")
    for weights, env, parts in (
        (nested, {}, ("not a checkpoint: its values are nested thousands of levels deep",)),
        (
            bomb,
            {"YOLO_MAX_WEIGHTS_BYTES": str(64 << 20)},
            ("unpacks to 100.0 MiB, over the limit of 64 MiB", "YOLO_MAX_WEIGHTS_BYTES"),
        ),
    ):
        result = run_script(
            "predict.py", "--weights", weights, "--source", images, "--output", tmp_path / "o",
            "--device", "cpu", cwd=tmp_path, timeout=120, env=env,
        )  # fmt: skip
        assert_one_line(result, f"error: {weights}: ", *parts)
        assert result.peak_rss_mb < BOUNDED_RSS_MB, result.peak_rss_mb
        assert not (tmp_path / "o").exists()


def test_a_cfg_whose_routes_join_maps_of_different_sizes_is_one_line(shapes_data, tmp_path):
    """``size=2`` with ``pad=1`` (valid values, same strides) grows a map by one pixel; the
    route joining it with an earlier map was a torch.cat RuntimeError traceback in the first
    forward. Now one line at the route, with the sizes at the run's input."""
    import contextlib
    import io

    import train
    from tests.conftest import train_argv

    cfg, _ = _f3_edited_nano(tmp_path, "size=3", "size=2", 1)
    route = next(n for n, ln in enumerate(cfg.read_text().splitlines(), 1) if ln == "layers=-1, 16")
    out = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = train.main(train_argv(shapes_data, out, cfg=cfg, img=128))
    errors = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err.getvalue()[-3000:]
    assert errors[0].startswith(
        f"error: {cfg}:{route}: [route]: layers=-1,16 joins feature maps of different sizes "
        "(10x10 and 9x9) at an input of 128x128"
    ), errors[0]
    assert "Traceback" not in err.getvalue()
    # The model is built in the trainer, once the run folder (its train.log) exists.
    assert not list(out.glob("*.pt"))


# =============================================================================================
# Family 4: text that is not what it claims (encodings, YAML tags, odd keys, numbers)
# =============================================================================================


def _hyp_with(**values: str) -> str:
    """The repository's hyp.yaml with the named keys' values replaced as written."""
    lines = (REPO_ROOT / "cfg" / "hyp.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        key = line.split(":", 1)[0]
        if key in values:
            lines[i] = f"{key}: {values.pop(key)}"
    assert not values, values
    return "\n".join(lines) + "\n"


def _line_of_key(text: str, key: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(f"{key}:"))


def test_python_tag_in_hyp_runs_no_code_and_is_one_line(tmp_path):
    """``!!python/object/apply:os.system`` (PyYAML's safe_load refused it with a traceback):
    one line naming the line and the tag, and the command never runs."""
    data = _fake_dataset(tmp_path / "d")
    text = _hyp_with(lr0='!!python/object/apply:os.system ["touch pwned"]')
    hyp = tmp_path / "hyp.yaml"
    hyp.write_text(text)
    out = tmp_path / "run"
    args = ["--data", data, "--cfg", REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg", "--hyp", hyp]
    result = run_script("train.py", *args, "--output-dir", out, cwd=tmp_path, timeout=60)
    assert_one_line(
        result,
        f"error: {hyp}:{_line_of_key(text, 'lr0')}: tag '!!python/object/apply:os.system'",
        "is not a standard YAML tag",
    )
    for place in (tmp_path, REPO_ROOT, Path.cwd()):
        assert not (place / "pwned").exists(), place
    assert not out.exists()


def test_utf16_model_cfg_is_one_line(tmp_path):
    """The model cfg is read once the run folder exists (in the trainer): a UTF-16 cfg (as
    Windows Notepad saves "Unicode") was a UnicodeDecodeError traceback there."""
    data = _fake_dataset(tmp_path / "d")
    cfg = tmp_path / "nano16.cfg"
    cfg.write_bytes((REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg").read_text().encode("utf-16"))
    out = tmp_path / "run"
    args = ["--data", data, "--cfg", cfg, "--hyp", REPO_ROOT / "cfg" / "hyp.yaml"]
    result = run_script(
        "train.py", *args, "--output-dir", out, "--device", "cpu", cwd=tmp_path, timeout=120
    )
    assert_one_line(result, f"error: {cfg}: model cfg is UTF-16 text; save it as UTF-8")


def _hostile_text_cases(root: Path) -> dict[str, tuple[dict[str, Path], tuple[str, ...]]]:
    """Case name -> (the files train.py gets: --hyp and/or --data, the error line's parts)."""
    hyp_text = (REPO_ROOT / "cfg" / "hyp.yaml").read_text()
    data = _fake_dataset(root / "d")

    def write(name: str, content: str | bytes) -> Path:
        path = root / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    latin1 = write("latin1.yaml", ("# réglages\n" + hyp_text).encode("latin-1"))
    utf16 = write("utf16.yaml", hyp_text.encode("utf-16"))
    utf16_nobom = write("utf16le.yaml", hyp_text.encode("utf-16-le"))
    name_tag = write("name.yaml", _hyp_with(lrf="!!python/name:os.system"))
    seq_key = write("seqkey.yaml", hyp_text + "? [lr0, lrf]\n: 0.1\n")
    big_int = write("bigint.yaml", _hyp_with(momentum="9" * 400))
    lr_1e6 = write("lr1e6.yaml", _hyp_with(lr0="1e6"))
    data_latin1 = write("latin1.data", ("# données\n" + data.read_text()).encode("latin-1"))
    n_hyp = len(hyp_text.splitlines())
    return {
        "latin-1 hyp": (
            {"--hyp": latin1},
            (f"{latin1}:1: hyperparameter file is not UTF-8 text (byte 0xe9", "save it as UTF-8"),
        ),
        "UTF-16 hyp": (
            {"--hyp": utf16},
            (f"{utf16}: hyperparameter file is UTF-16 text; save it as UTF-8",),
        ),
        "UTF-16 hyp without BOM": (
            {"--hyp": utf16_nobom},
            (f"{utf16_nobom}: hyperparameter file holds NUL bytes", "save it as UTF-8"),
        ),
        "python/name tag": (
            {"--hyp": name_tag},
            (
                f"{name_tag}:{_line_of_key(hyp_text, 'lrf')}: tag '!!python/name:os.system' "
                "is not a standard YAML tag",
            ),
        ),
        "sequence key": (
            {"--hyp": seq_key},
            (f"{seq_key}:{n_hyp + 1}: a list is used as a key",),
        ),
        "400-digit integer": (
            {"--hyp": big_int},
            (
                f"{big_int}:{_line_of_key(hyp_text, 'momentum')}: 'momentum' = "
                "999999999999...(400 digits) is outside [0.0, 1.0]",
            ),
        ),
        "lr0 1e6": (
            {"--hyp": lr_1e6},
            (
                f"{lr_1e6}:{_line_of_key(hyp_text, 'lr0')}: 'lr0' = 1000000.0 is outside "
                "[0.0, 10.0]",
            ),
        ),
        "latin-1 .data": (
            {"--data": data_latin1},
            (f"{data_latin1}:1: .data file is not UTF-8 text (byte 0xe9", "save it as UTF-8"),
        ),
    }


def test_text_that_is_not_what_it_claims_is_one_line(tmp_path, console):
    """Every case through train.py's main() in this process (the process-level contract is
    pinned by the tests above): exit 2, one short error line naming file and line, no run
    folder, no traceback."""
    import train

    cases = _hostile_text_cases(tmp_path)
    defaults = {
        "--data": _fake_dataset(tmp_path / "d"),
        "--hyp": REPO_ROOT / "cfg" / "hyp.yaml",
        "--cfg": REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg",
    }
    for name, (files, parts) in cases.items():
        out = tmp_path / "run"
        argv = [str(a) for k, v in {**defaults, **files}.items() for a in (k, v)]
        code = train.main([*argv, "--output-dir", str(out), "--device", "cpu"])
        err = console.readouterr().err
        assert code == 2, (name, err[-2000:])
        assert "Traceback" not in err, name
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
        for part in parts:
            assert part in lines[0], (name, part, lines[0])
        assert len(lines[0]) < 300, (name, lines[0])
        assert not out.exists(), name


def test_a_megabyte_cfg_line_gives_a_short_error_line(tmp_path, console):
    """A cfg line of 1 MB (a value, key, section name, header, activation or text before the
    first section) within the cfg's byte limit: one error line naming file and line that quotes
    the piece cut in the middle (the whole line was copied into a 1 MB "one-line" error)."""
    import train

    nano = (REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg").read_text()
    big = "x" * (1 << 20)
    first_filters = next(ln for ln in nano.splitlines() if ln.startswith("filters="))
    edits = {
        "value": (first_filters, f"filters={big}"),
        "digits": (first_filters, f"filters={'9' * (1 << 20)}"),
        "key": (first_filters, f"{first_filters}\n{big}=1"),
        "section": ("[net]", f"[net]\n[{big}]"),
        "header": ("[net]", f"[net]\n[{big}"),
        "before the first section": ("[net]", f"{big}\n[net]"),
        "activation": ("activation=leaky", f"activation={big}"),
    }
    data = _fake_dataset(tmp_path / "d")
    for name, (old, new) in edits.items():
        cfg = tmp_path / f"{name.replace(' ', '_')}.cfg"
        cfg.write_text(nano.replace(old, new, 1))
        argv = ["--data", str(data), "--cfg", str(cfg), "--device", "cpu"]
        argv += ["--hyp", str(REPO_ROOT / "cfg" / "hyp.yaml"), "--output-dir", str(tmp_path / name)]
        code = train.main(argv)
        err = console.readouterr().err
        assert code == 2, (name, err[-2000:])
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1, (name, err[-2000:])
        assert lines[0].startswith(f"error: {cfg}:"), (name, lines[0][:300])
        assert "xxxxxxxx...xxxxxxxx" in lines[0] or "99999999...99999999" in lines[0], name
        assert len(lines[0]) < 700, (name, len(lines[0]))


# =============================================================================================
# Family 5: writes outside the dataset (list entries that traverse)
# =============================================================================================


def test_list_entries_that_traverse_train_and_write_nothing_outside(tmp_path):
    """A dataset whose list entries traverse (``../../../outside/...``) to images in a folder
    outside it trains on them, and every file the run writes is in the dataset folder (caches
    and reports beside the lists) or the run folder: the whole tree is compared."""
    from data.make_shapes import make_dataset

    make_dataset(tmp_path / "outside", 6, 2, img_size_range=(64, 96), workers=1)
    ds = tmp_path / "a" / "b" / "ds"
    ds.mkdir(parents=True)
    for split in ("train", "val"):
        entries = (tmp_path / "outside" / f"{split}.txt").read_text().split()
        (ds / f"{split}.txt").write_text("".join(f"../../../outside/{e}\n" for e in entries))
    (ds / "mine.data").write_text(
        f"classes=5\ntrain=train.txt\nvalid=val.txt\nnames={tmp_path / 'outside/shapes.names'}\n"
    )
    for leftover in tmp_path.glob("outside/*.cache*"):
        leftover.unlink()  # none expected; the comparison below starts from a clean tree

    def tree() -> set[Path]:
        return {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}

    before = tree()
    run = tmp_path / "run"
    from tests.conftest import train_argv

    argv = train_argv(ds / "mine.data", run, img=64, batch=4, epochs=1)
    result = run_script("train.py", *argv, "--cache-images", "disk", cwd=ds)
    assert result.rc == 0, result.stderr[-3000:]
    assert "data: 6 train / 2 val images" in result.stderr, result.stderr[-3000:]
    new = tree() - before
    outside = sorted(str(p) for p in new if p.parts[:3] != ("a", "b", "ds") and p.parts[0] != "run")
    assert outside == [], outside
    assert {Path("a/b/ds") / n for n in ("train.cache.npz", "val.cache.npz")} <= new
    assert Path("a/b/ds/train.cache_report.txt") in new and Path("a/b/ds/train.img64") in new
    assert len(list((ds / "train.img64").glob("*.npy"))) == 6
    assert result.peak_rss_mb < BOUNDED_RSS_MB


# =============================================================================================
# Family 6: caches that lie (stale key, inconsistent arrays)
# =============================================================================================


def _shapes_run(tmp_path: Path, n_train: int = 6) -> tuple[Path, Path, Path]:
    """A shapes dataset of ``n_train`` training images whose label cache has been built (as a
    first run would), for the runs below: its ``.data`` file, label cache and report."""
    from build_utils.datasets import LoadImagesAndLabels
    from data.make_shapes import make_dataset

    data = make_dataset(tmp_path / "shapes", n_train, 2, img_size_range=(64, 96), workers=1)
    d = LoadImagesAndLabels(data.parent / "train.txt", 64, nc=5)
    assert d.cache_path == data.parent / "train.cache.npz" and d.cache_path.is_file()
    return data, d.cache_path, d.report_path


def test_label_edited_with_size_and_time_kept_is_read_again(tmp_path):
    """A label edited in place with its size and modification time put back (``touch -r``) is
    read again by the next run: its edited line (a class id over the class count, same size) is
    dropped and reported, and the run sees one label fewer."""
    data, _, report_path = _shapes_run(tmp_path)
    label = sorted((data.parent / "train" / "labels").glob("*.txt"))[0]
    text = label.read_text()
    stamp = tmp_path / "stamp"
    stamp.touch()
    os.utime(stamp, ns=(label.stat().st_atime_ns, label.stat().st_mtime_ns))
    n_labels = sum(len(p.read_text().split("\n")) - 1 for p in label.parent.glob("*.txt"))
    label.write_text("9" + text[1:])  # same size: class 9 of 5
    subprocess.run(["touch", "-r", str(stamp), str(label)], check=True)
    assert label.stat().st_mtime_ns == stamp.stat().st_mtime_ns
    from tests.conftest import train_argv

    result = run_script("train.py", *train_argv(data, tmp_path / "run", img=64), cwd=tmp_path)
    assert result.rc == 0, result.stderr[-3000:]
    assert "1 bad label lines dropped" in result.stderr, result.stderr[-3000:]
    assert f"anchors vs {n_labels - 1} training labels" in result.stderr
    report = report_path.read_text()
    assert f"{label}:1: dropped: class id 9 outside [0, 5)" in report


def test_cache_with_a_valid_key_and_inconsistent_arrays_is_rebuilt(tmp_path):
    """A label cache with its key intact but arrays that disagree (images marked excluded while
    its stats count them as used) is rebuilt with a warning naming it; the run trains on every
    image and its summary says so (was: trained on 1 of 6 images, summary "0 excluded")."""
    import numpy as np

    data, cache, _ = _shapes_run(tmp_path)
    with np.load(cache, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["ok"][1:] = False  # the lie: 5 of 6 excluded, stats still "0 corrupt"
    with open(cache, "wb") as f:
        np.savez(f, **arrays)
    from tests.conftest import train_argv

    result = run_script("train.py", *train_argv(data, tmp_path / "run", img=64), cwd=tmp_path)
    assert result.rc == 0, result.stderr[-3000:]
    assert f"label cache {cache} disagrees with itself (" in result.stderr, result.stderr[-3000:]
    assert "train: 6 images: 6 label files found" in result.stderr
    assert "0 images excluded for an unusable image or label file" in result.stderr
    assert "data: 6 train / 2 val images" in result.stderr
    with np.load(cache, allow_pickle=False) as z:
        assert z["ok"].all() and str(z["key"]) == str(arrays["key"])
