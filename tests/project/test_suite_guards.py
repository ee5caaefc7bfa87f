"""The suite's own settings (pyproject.toml, the Makefile's ``--dist loadfile``) end a run whose
test hangs or whose pytest worker dies with the test named and a summary, instead of leaving CI
idle until its limit.

Each case runs a throwaway suite under those settings in a pytest of its own, with a short
``timeout``: a test that kills its worker (as a crash does), one that sleeps past the timeout,
and quick ones beside them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NESTED_LIMIT_S = 180  # the nested run's own limit; it needs ~20 s

QUICK = """
def test_one():
    pass

def test_two():
    pass
"""
# Kills its worker in its second test (SIGKILL: no Python clean-up, as a native crash does).
CRASHES = """
import os, signal

def test_before():
    pass

def test_crashes():
    os.kill(os.getpid(), signal.SIGKILL)

def test_after():
    pass
"""
HANGS = """
import time

def test_hangs():
    time.sleep(120)

def test_after_the_hang():
    pass
"""


def run_suite(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    """pytest on ``files`` (name -> source) with two workers, ``--dist loadfile`` as
    ``make test`` runs, the repository's pytest settings and a 5 s timeout."""
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, source in files.items():
        (suite / name).write_text(textwrap.dedent(source))
    argv = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml")]
    argv += ["--rootdir", str(suite), "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
    argv += ["-o", "timeout=5", str(suite)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    try:
        return subprocess.run(
            argv, cwd=suite, env=env, capture_output=True, text=True, timeout=NESTED_LIMIT_S
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")[-2000:]
        pytest.fail(f"the suite did not end within {NESTED_LIMIT_S} s (an idle xdist):\n{out}")


def summary(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines of pytest's short summary (``-ra``) and its final line."""
    lines = proc.stdout.splitlines()
    start = lines.index(
        "=========================== short test summary info ============================"
    )
    return lines[start + 1 :]


@pytest.mark.slow
def test_a_worker_that_dies_ends_the_run_with_its_test_named(tmp_path):
    """A dead worker ends the run at once, its test named in the summary. (With xdist's default,
    replacing the worker, this suite ended in some runs and sat idle in others.)"""
    files = {"test_a.py": QUICK, "test_crash.py": CRASHES, "test_b.py": QUICK, "test_c.py": QUICK}
    proc = run_suite(tmp_path, files)
    assert proc.returncode == 1, proc.stdout[-3000:]
    lines = summary(proc)
    assert lines[0].startswith("FAILED test_crash.py::test_crashes - worker 'gw"), lines
    assert "crashed while running 'test_crash.py::test_crashes'" in proc.stdout
    assert "failed" in lines[-1] and "xdist: worker gw" in proc.stdout


@pytest.mark.slow
def test_a_hanging_test_fails_by_name_and_the_run_goes_on(tmp_path):
    proc = run_suite(tmp_path, {"test_a.py": QUICK, "test_hang.py": HANGS, "test_b.py": QUICK})
    assert proc.returncode == 1, proc.stdout[-3000:]
    lines = summary(proc)
    assert (
        lines[0] == "FAILED test_hang.py::test_hangs - Failed: Timeout (>5.0s) from pytest-timeout."
    )
    # The worker survived the time-out: the test after the hang, in the same file, ran.
    assert " 1 failed, 5 passed in " in lines[-1], lines[-1]
