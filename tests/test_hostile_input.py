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

# (family 5 tests go here)


# =============================================================================================
# Family 6: caches that lie (stale key, inconsistent arrays)
# =============================================================================================

# (family 6 tests go here)
