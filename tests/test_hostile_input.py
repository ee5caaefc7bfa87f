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

# (family 1c tests go here)


# =============================================================================================
# Family 2: files that are not files (FIFOs, devices, sockets, folders named x.jpg, link loops)
# =============================================================================================

# (family 2 tests go here)


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
    assert "0 corrupt images excluded" in result.stderr
    assert "data: 6 train / 2 val images" in result.stderr
    with np.load(cache, allow_pickle=False) as z:
        assert z["ok"].all() and str(z["key"]) == str(arrays["key"])
