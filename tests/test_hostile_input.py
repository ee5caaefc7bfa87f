"""Hostile and broken input through the real entry points: one clear line (exit 2) or a skip with
its reason in the report, bounded memory, no hang, nothing written outside the dataset or run.

One section per family of issue #24 (``build_utils/limits.py`` holds the limits). Each test runs
the script as a user would, in a process of its own (:func:`run_script`), so a hang is a timeout,
a traceback is visible on stderr and the peak memory of that one process is measured
(``os.wait4`` returns the child's own ``ru_maxrss``). An address-space cap on the child keeps a
regression from taking the shared test machine's memory with it.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

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


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))


def run_script(
    script: str,
    *args: str | Path,
    cwd: Path,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> ScriptResult:
    """Run ``python <repo>/<script> args`` in ``cwd``; its exit status, output, and the peak
    resident memory of that process alone. A run over ``timeout`` seconds (a hang) fails the
    test with what it printed so far."""
    cmd = [sys.executable, str(REPO_ROOT / script), *map(str, args)]
    start = time.monotonic()
    # Output goes to files, not pipes: the child is reaped with os.wait4 (for its own rusage),
    # which Popen.communicate would do first.
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**script_env(), **(env or {})},
            stdout=out_f,
            stderr=err_f,
            text=True,
            preexec_fn=_cap_address_space,
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                out_f.seek(0), err_f.seek(0)
                pytest.fail(
                    f"{script} hung for {timeout} s\nstdout:\n{out_f.read()[-3000:]}"
                    f"\nstderr:\n{err_f.read()[-3000:]}"
                )
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0), err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    return ScriptResult(proc.returncode, out, err, usage.ru_maxrss / 1024, time.monotonic() - start)


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

# (family 1a tests go here)


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
    from tests.conftest import train_argv
    from tests.test_image_io import sparse_file, write_png

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
    assert "6 images: " in r.stderr and "2 corrupt images excluded" in r.stderr
    assert r.peak_rss_mb < BOUNDED_RSS_MB, r.peak_rss_mb


def test_pixel_bomb_and_40_gb_sparse_jpg_are_skipped_by_predict(tmp_path):
    from tests.test_image_io import good_jpeg, sparse_file, write_png

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

# (family 1c tests go here)


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
    assert "train: 7 images: " in r.stderr and "3 corrupt images excluded" in r.stderr
    assert "val: 6 images: " in r.stderr and "4 corrupt images excluded" in r.stderr

    stats, val_dir = tmp_path / "stats.json", tmp_path / "val"
    argv = validation_argv(out / "model.cfg", data, out / "last.pt", img=64)
    argv += ["--json-out", str(stats), "--save-dir", str(val_dir)]
    v = run_script("validation.py", *argv, cwd=tmp_path, timeout=120)
    assert "Traceback" not in v.stderr, v.stderr[-3000:]
    assert v.rc == 0, v.stderr[-3000:]
    assert "val: 6 images: " in v.stderr and "4 corrupt images excluded" in v.stderr
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
    from tests.test_image_io import bind_socket, good_jpeg

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

# (family 3 tests go here)


# =============================================================================================
# Family 4: text that is not what it claims (encodings, YAML tags, odd keys, numbers)
# =============================================================================================

# (family 4 tests go here)


# =============================================================================================
# Family 5: writes outside the dataset (list entries that traverse)
# =============================================================================================

# (family 5 tests go here)


# =============================================================================================
# Family 6: caches that lie (stale key, inconsistent arrays)
# =============================================================================================

# (family 6 tests go here)
