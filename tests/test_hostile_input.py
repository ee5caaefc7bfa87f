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

# (family 1b tests go here)


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

# (family 2 tests go here)


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
