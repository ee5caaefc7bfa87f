"""train_utils/threads.py: the thread count follows the cores this process has to itself.

The controller is driven here by fake clocks and fake scheduler readings (the decisions are a
function of them); the readers are checked against files in /proc's format and, on Linux,
against this process's own /proc. The speed it buys is measured in bench/README.md."""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_training, train_argv

from build_utils.errors import ConfigError
from train_utils import threads
from train_utils.distributed import launch
from train_utils.threads import (
    CHECK_INTERVAL_S,
    MAX_THREADS,
    PROBE_FIRST_S,
    PROBE_MAX_S,
    ThreadController,
    fixed_thread_count,
    read_idle_cpu_seconds,
    read_run_queue_waits,
)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"YOLO_THREADS": "auto"}, None),
        ({"YOLO_THREADS": "3"}, 3),
        ({"OMP_NUM_THREADS": "4"}, 4),  # the user's (or torchrun's) count is kept
        ({"YOLO_THREADS": "2", "OMP_NUM_THREADS": "4"}, 2),
        ({"YOLO_THREADS": " AUTO ", "OMP_NUM_THREADS": "x"}, None),
        ({"YOLO_THREADS": "", "OMP_NUM_THREADS": "4"}, 4),  # set but empty: as if unset
        ({"YOLO_THREADS": "  "}, None),
    ],
)
def test_fixed_thread_count(env, expected) -> None:
    assert fixed_thread_count(env) == expected


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_yolo_threads_is_one_clear_error(bad) -> None:
    with pytest.raises(ConfigError, match=f"YOLO_THREADS={bad!r}: expected auto or a positive"):
        fixed_thread_count({"YOLO_THREADS": bad})


@pytest.mark.parametrize("bad", ["\u00b2", "\u0663", "\uff12"])
def test_digits_other_than_ascii_are_one_clear_error(bad) -> None:
    # str.isdigit() accepts them; int() refuses '²' with a ValueError (was a traceback).
    with pytest.raises(ConfigError, match="expected auto or a positive integer"):
        fixed_thread_count({"YOLO_THREADS": bad})
    assert fixed_thread_count({"OMP_NUM_THREADS": bad}) is None
    assert launch.threads_per_process(1, {"OMP_NUM_THREADS": bad}) >= 1


@pytest.mark.parametrize("huge", [str(MAX_THREADS + 1), "100000", "9" * 30])
def test_a_huge_thread_count_is_refused(huge) -> None:
    # torch.set_num_threads overflowed (a traceback) or OpenMP ran out of memory starting them.
    with pytest.raises(ConfigError, match=f"YOLO_THREADS={huge!r}: at most {MAX_THREADS}"):
        fixed_thread_count({"YOLO_THREADS": huge})
    assert fixed_thread_count({"OMP_NUM_THREADS": huge}) is None  # left to OpenMP
    assert launch.threads_per_process(1, {"OMP_NUM_THREADS": huge}) <= os.cpu_count()
    assert fixed_thread_count({"YOLO_THREADS": str(MAX_THREADS)}) == MAX_THREADS


def test_run_queue_waits_are_read_per_thread(tmp_path: Path) -> None:
    for tid, wait_ns in ((101, 2_500_000_000), (102, 7)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(f"123456 {wait_ns} 42\n")
    (tmp_path / "103").mkdir()  # a thread that ended before its file was read
    assert read_run_queue_waits(tmp_path) == {101: 2.5, 102: 7e-9}
    assert read_run_queue_waits(tmp_path / "absent") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")
def test_this_process_has_run_queue_waits_and_idle_seconds() -> None:
    waits = read_run_queue_waits()
    assert waits is not None and os.getpid() in waits and all(w >= 0 for w in waits.values())
    idle = read_idle_cpu_seconds()
    assert idle is not None and idle >= 0


def test_idle_seconds_count_the_allowed_cpus(tmp_path: Path, monkeypatch) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 20 30 40 50 0 0 0 0 0\n"
        "cpu0 1 100 3 400 5 0 0 0 0 0\n"
        "cpu1 1 200 3 800 9 0 0 0 0 0\n"
        "cpu2 1 300 3 999 9 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    hz = os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(threads.os, "getpriority", lambda *_a: 0)
    # idle + iowait, and niced work (which yields to this un-niced process), on cpu0 and cpu1.
    assert read_idle_cpu_seconds(stat) == pytest.approx((405 + 100 + 809 + 200) / hz)
    monkeypatch.setattr(threads.os, "getpriority", lambda *_a: 10)
    assert read_idle_cpu_seconds(stat) == pytest.approx((405 + 809) / hz)


class FakeMachine:
    """A clock, per-thread run-queue waits and idle CPU seconds that a test moves forward."""

    def __init__(self, n_threads: int = 2) -> None:
        self.now = 0.0
        self.waits = {tid: 0.0 for tid in range(n_threads)}
        self.idle = 0.0
        self.counts: list[int] = []

    def advance(self, seconds: float, wait_share: float = 0.02, free_cores: float = 0.0) -> None:
        """``seconds`` pass; each thread waits ``wait_share`` of them for a core."""
        self.now += seconds
        for tid in self.waits:
            self.waits[tid] += wait_share * seconds
        self.idle += free_cores * seconds

    def controller(self, max_threads: int = 2) -> ThreadController:
        return ThreadController(
            max_threads,
            read_waits=lambda: dict(self.waits),
            set_threads=self.counts.append,
            clock=lambda: self.now,
            read_idle=lambda: self.idle,
        )


def _interval(machine: FakeMachine, ctl: ThreadController, **kw) -> int:
    machine.advance(CHECK_INTERVAL_S, **kw)
    ctl.tick()
    return ctl.threads


def test_idle_cores_keep_every_thread() -> None:
    machine = FakeMachine()
    ctl = machine.controller()
    for _ in range(100):
        assert _interval(machine, ctl, wait_share=0.07) == 2
    assert machine.counts == []  # never touched torch's count


def test_a_busy_neighbour_drops_a_thread_and_its_departure_brings_it_back(caplog) -> None:
    machine = FakeMachine()
    ctl = machine.controller()
    machine.advance(CHECK_INTERVAL_S / 2, wait_share=0.5)
    ctl.tick()  # within the interval: nothing read, nothing decided
    assert ctl.threads == 2
    with caplog.at_level(logging.INFO, logger=threads.__name__):
        assert _interval(machine, ctl, wait_share=0.5) == 1
        for _ in range(3):  # one thread beside the neighbour: no wait, but no free core
            assert _interval(machine, ctl, wait_share=0.01) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 2 threads" in warnings[0].getMessage()
    assert "YOLO_THREADS=N" in warnings[0].getMessage()
    # The neighbour leaves: a core sits idle, one more thread is tried and kept.
    assert _interval(machine, ctl, wait_share=0.01, free_cores=1.0) == 2
    assert _interval(machine, ctl, wait_share=0.05) == 2
    assert machine.counts == [1, 2]


def test_timed_tries_back_off_while_the_cores_stay_taken() -> None:
    machine = FakeMachine()
    ctl = machine.controller()
    _interval(machine, ctl, wait_share=0.5)
    dropped, tries = machine.now, []
    while machine.now < 2000:
        before = ctl.threads
        # Two threads wait half the time (the neighbour stays); one has its core.
        if _interval(machine, ctl, wait_share=0.5 if before == 2 else 0.01) > before:
            tries.append(machine.now)
    # The first try PROBE_FIRST_S after the drop; after each failed one (undone an interval
    # later) twice the wait, up to PROBE_MAX_S.
    expected_waits = [min(PROBE_FIRST_S * 2**k, PROBE_MAX_S) for k in range(len(tries))]
    assert tries[0] - dropped == pytest.approx(PROBE_FIRST_S, abs=CHECK_INTERVAL_S)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    for gap, wait in zip(gaps, expected_waits[1:], strict=False):
        assert gap == pytest.approx(CHECK_INTERVAL_S + wait, abs=CHECK_INTERVAL_S)
    assert gaps[-1] == pytest.approx(CHECK_INTERVAL_S + PROBE_MAX_S, abs=CHECK_INTERVAL_S)
    # The intervals spent at 2 threads on taken cores (the tries) are a small share of the run.
    assert len(tries) * CHECK_INTERVAL_S / machine.now < 0.02


def test_a_free_core_that_misleads_is_not_believed_again_at_once() -> None:
    """Niced work shows as free, but under the kernel's autogroups it may not yield."""
    machine = FakeMachine()
    ctl = machine.controller()
    _interval(machine, ctl, wait_share=0.5)
    assert _interval(machine, ctl, wait_share=0.01, free_cores=1.0) == 2  # believed once
    assert _interval(machine, ctl, wait_share=0.5, free_cores=0.0) == 1  # it was not free
    for _ in range(int(PROBE_FIRST_S / CHECK_INTERVAL_S) - 2):
        assert _interval(machine, ctl, wait_share=0.01, free_cores=1.0) == 1


def test_more_cores_drop_only_the_contended_threads() -> None:
    machine = FakeMachine(n_threads=8)
    ctl = machine.controller(max_threads=8)
    machine.advance(CHECK_INTERVAL_S)
    machine.waits[3] += 0.5 * CHECK_INTERVAL_S  # one thread shares its core
    ctl.tick()
    assert ctl.threads == 7


def test_yolo_threads_fixes_the_count(monkeypatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("YOLO_THREADS", "1")
    try:
        assert ThreadController.for_device(torch.device("cpu")) is None
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("YOLO_THREADS", "auto")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert ThreadController.for_device(torch.device("cuda")) is None  # CPU runs only


def test_a_bad_yolo_threads_stops_a_run_before_it_writes_anything(
    monkeypatch, make_shapes_data, tmp_path
) -> None:
    data = make_shapes_data(n_train=2, n_val=1)
    monkeypatch.setenv("YOLO_THREADS", "many")
    with pytest.raises(ConfigError, match="YOLO_THREADS='many'"):
        run_training(train_argv(data, tmp_path / "run", img=64, batch=2))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["validation", "predict"])
def test_a_bad_yolo_threads_stops_validation_and_predict_before_they_load(
    script, monkeypatch, tmp_path, capsys
) -> None:
    # The weights and the source do not exist: the YOLO_THREADS line must come first, and no
    # output folder may be left behind.
    module = __import__(script)
    missing = str(tmp_path / "missing.pt")
    out = tmp_path / "out"
    if script == "validation":
        argv = ["--weights", missing, "--data", str(tmp_path / "x.data"), "--save-dir", str(out)]
    else:
        argv = ["--weights", missing, "--source", str(tmp_path / "none"), "--output", str(out)]
    monkeypatch.setenv("YOLO_THREADS", "0")
    assert module.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: YOLO_THREADS='0': expected auto or a positive integer"]
    assert not out.exists()
    monkeypatch.setenv("YOLO_THREADS", "2")  # a good value: the next error is the missing file
    assert module.main(argv) == 2
    assert "YOLO_THREADS" not in capsys.readouterr().err


def test_a_bad_yolo_threads_stops_a_spawning_launcher_before_it_spawns(
    monkeypatch, make_shapes_data, tmp_path, capsys
) -> None:
    import train_multi_GPU
    from train_utils.distributed import launch

    spawned = []
    monkeypatch.setattr(launch, "spawn_training", lambda *a, **k: spawned.append(a))
    monkeypatch.setattr(train_multi_GPU, "spawn_training", lambda *a, **k: spawned.append(a))
    data = make_shapes_data(n_train=2, n_val=1)
    monkeypatch.setenv("YOLO_THREADS", "lots")
    argv = [*train_argv(data, tmp_path / "run", img=64, batch=2), "--nproc-per-node", "2"]
    assert train_multi_GPU.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: YOLO_THREADS='lots': expected auto or a positive integer"]
    assert spawned == [] and not (tmp_path / "run").exists()
