"""tests/warm_python.py: a script forked from the warm interpreter behaves as ``python script.py``
started afresh. Each case runs the same probe both ways and compares what it saw and how it
ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import warm_python

PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    mode = sys.argv[1]
    seen = {
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "file": __file__,
        "name": __name__, "threads": torch.get_num_threads(), "env": os.environ.get("PROBE"),
        "on_path": os.environ.get("PROBE_DIR") in sys.path,
    }
    print(json.dumps(seen))
    print("to stderr", file=sys.stderr)
    if mode == "thread":  # a non-daemon thread finishes before the process exits
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    if mode == "atexit":
        import atexit
        atexit.register(lambda: print("atexit ran"))
    if mode == "error":
        raise RuntimeError("boom")
    if mode == "ctrl-c":
        raise KeyboardInterrupt
    if mode == "kill":
        os.kill(os.getpid(), 9)
    if mode == "term":
        os.kill(os.getpid(), 15)
        time.sleep(5)
    sys.exit(3 if mode == "exit3" else 0)
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "real").mkdir()
    (folder / "real" / "probe.py").write_text(PROBE)
    # Called through a symbolic link: sys.path[0] is the folder of the file it points to.
    (folder / "link.py").symlink_to(folder / "real" / "probe.py")
    return folder


def _both(probe: Path, mode: str, threads: str) -> tuple:
    env = {**os.environ, "PROBE": mode, "PROBE_DIR": str(probe), "PYTHONPATH": str(probe)}
    env["OMP_NUM_THREADS"] = threads
    argv = [sys.executable, "link.py", mode]
    fresh = subprocess.run(argv, cwd=probe, env=env, capture_output=True, text=True, timeout=60)
    warm = warm_python.run(argv, cwd=probe, env=env, timeout=60)
    return fresh, warm


@pytest.mark.parametrize(
    ("mode", "threads"),
    [("exit0", "1"), ("exit3", "2"), ("thread", "1"), ("atexit", "1"), ("error", "1")],
)
def test_a_warm_script_sees_and_ends_as_a_fresh_one(probe, mode, threads) -> None:
    fresh, warm = _both(probe, mode, threads)
    assert warm.returncode == fresh.returncode == {"exit3": 3, "error": 1}.get(mode, 0)
    assert warm.stdout == fresh.stdout, (warm.stdout, fresh.stdout)
    first = warm.stdout.splitlines()[0]
    assert f'"path0": "{probe / "real"}"' in first and f'"threads": {threads}' in first
    assert '"on_path": true' in first and '"name": "__main__"' in first
    if mode == "error":
        assert warm.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "RuntimeError: boom"
        assert "Traceback (most recent call last)" in warm.stderr
    else:
        assert warm.stderr == fresh.stderr == "to stderr\n"


@pytest.mark.parametrize(
    ("mode", "status"),
    [("ctrl-c", -signal.SIGINT), ("kill", -signal.SIGKILL), ("term", -signal.SIGTERM)],
)
def test_a_warm_script_ended_by_a_signal_reports_it(probe, mode, status) -> None:
    fresh, warm = _both(probe, mode, "1")
    assert warm.returncode == fresh.returncode == status
    assert warm.stdout == fresh.stdout  # what it printed before the signal is kept


def test_start_waits_kills_and_reports_timeouts(probe) -> None:
    env = {**os.environ, "PROBE": "x"}
    proc = warm_python.start([sys.executable, "link.py", "term"], cwd=probe, env=env)
    assert proc.wait(60) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    slow = [sys.executable, "-c", "x"]
    with pytest.raises(ValueError, match="not a script or -m module"):
        warm_python.start(slow, cwd=probe, env=env)
    (probe / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "sleeper.py"], cwd=probe, env=env, timeout=1)


def test_peak_memory_is_the_childs_own_and_the_address_space_cap_holds(probe) -> None:
    """What tests/scenarios/test_hostile_input.py measures: the peak resident memory of the
    script alone (600 MB touched shows as 600 more than a script that touches none), and an
    allocation past the cap fails in the script instead of taking the machine's memory."""
    (probe / "touch.py").write_text(
        "import sys\nblock = bytearray(int(sys.argv[1]) << 20)\n"
        "block[::4096] = b'x' * len(block[::4096])  # every page touched\n"
    )
    env = {**os.environ}

    def peak(mb: int, cap: int | None = None) -> tuple[int, float | None, str]:
        argv = [sys.executable, "touch.py", str(mb)]
        proc = warm_python.start(argv, cwd=probe, env=env, address_space=cap)
        proc.wait(60)
        return proc.returncode, proc.peak_rss_mb, proc.output()[1]

    rc0, none_touched, _ = peak(0)
    rc1, touched, _ = peak(600)
    assert rc0 == rc1 == 0 and none_touched is not None and touched is not None
    assert 550 < touched - none_touched < 700, (none_touched, touched)
    rc, _, err = peak(16 << 10, cap=12 << 30)
    assert rc == 1 and err.splitlines()[-1] == "MemoryError", err[-500:]
