"""``train.py --evolve --evolve-backend ray`` on a Ray of this machine (two trials at a time, one
CPU each): a trial whose process is killed is started again, and a search whose driver (with
its Ray) is killed continues with ``--resume`` from the search folder alone, every candidate
scored once and the rows written before the kill kept as they were."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import script_env, train_argv
from train_utils.evolve import record

pytest.importorskip("ray.tune", reason="needs Ray Tune (pip install -r requirements-ray.txt)")

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 420  # each of the two processes (Ray starts in ~10 s on 2 idle cores)


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """train.py in a session of its own (its Ray's processes with it), output in ``log``."""
    env = {**script_env(), "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(what, proc: subprocess.Popen, log: Path, limit_s: float = LIMIT_S):
    deadline = time.monotonic() + limit_s
    while not (found := what()):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)
    return found


def rows(out: Path) -> list[dict[str, str]]:
    path = out / record.CSV_NAME
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_ray_search_retries_a_killed_trial_and_continues_after_its_driver_is_killed(
    make_shapes_data, tmp_path
) -> None:
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "search"
    argv = train_argv(data, out, "--evolve", "3", "--evolve-backend", "ray", epochs=2)
    first_log = tmp_path / "first.log"
    driver = start(argv, first_log)
    try:
        # Kill candidate 0's process while it trains: Ray starts the trial again.
        lock = out / "candidate-000" / "run.lock"
        wait_for(lambda: lock.is_file() and lock.stat().st_size > 0, driver, first_log)
        killed = json.loads(lock.read_text())["pid"]
        os.kill(killed, signal.SIGKILL)
        # The driver and its whole Ray go once a candidate is scored.
        wait_for(lambda: rows(out), driver, first_log)
    finally:
        kill_session(driver)
    before = {r["candidate"]: r for r in rows(out)}
    assert before
    second_log = tmp_path / "second.log"
    resumed = start(["--resume", str(out)], second_log)
    try:
        assert resumed.wait(LIMIT_S) == 0, second_log.read_text()[-4000:]
    finally:
        kill_session(resumed)
    after = rows(out)
    assert sorted(r["candidate"] for r in after) == ["0", "1", "2"]
    for r in after:
        assert r["status"] == "done" or r["status"].startswith("stopped early"), r
        assert float(r["fitness"]) >= 0
        if r["candidate"] in before:  # scored before the driver was killed: kept as it was
            assert r == before[r["candidate"]]
    # Candidate 0's retry took over the killed attempt's lock (what that attempt had written,
    # if anything, was set aside or continued, never mixed: run_folder's own tests); a later
    # attempt may have moved the retry's log into replaced-*/.
    logs = "".join(p.read_text() for p in (out / "candidate-000").rglob("train.log"))
    assert f"taking over the lock of a run that is gone (pid {killed} " in logs
    # Two trials at a time (the machine's 2 CPUs, 1 each); whether two actually overlap depends
    # on how fast Ray starts its second worker, which a loaded machine decides.
    assert "1 CPU and 0 GPU each, up to 2 at once" in first_log.read_text()
    assert "Traceback" not in second_log.read_text()
    assert (out / record.BEST_HYP_NAME).is_file() == any(r["status"] == "done" for r in after)
