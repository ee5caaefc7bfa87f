"""Reliability, interrupted runs: ``train.py`` processes stopped by SIGINT and SIGKILL at several
points (mid-epoch, mid-evaluation, half-way through writing ``last.pt``), each followed by
``--resume``, lose nothing: ``last.pt`` always loads, the finished run's ``results.csv`` has
every epoch exactly once. Ctrl-C in the very first epoch leaves a ``last.pt`` that resumes.

The kill points are made deterministic by a small wrapper (tests/workers/interrupted_train.py)
that runs ``train.main`` with one hook: it either parks the process at a known point and writes a
marker file, so the test signals it from outside, or sends SIGKILL to itself there. SIGKILL of a
torchrun worker under ``--max-restarts=1`` is tests/scenarios/test_ddp.py
``test_killed_worker_is_restarted_and_the_run_completes``.
"""

from __future__ import annotations

import csv
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import warm_python
from conftest import train_argv, worker_cmd

import train as train_script
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint
from train_utils.memory_format import CACHE_ENV
from train_utils.plan import EpochPlan

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 2
KILLED_EPOCH = 1  # epoch 0 finishes and is checkpointed first
PARK_SECONDS = 120  # how long a parked process waits for the test's signal

# train_argv's settings of every run here: batches of 8 (nominal 8) at 64 px.
RUN = {"epochs": EPOCHS, "batch": 8, "img": 64, "nbs": 8}


def _epochs_in_results(out: Path) -> list[int]:
    path = out / "results.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return [int(r["epoch"]) for r in csv.DictReader(f)]


class Run:
    """One training process (the wrapper with a hook, or plain train.py)."""

    def __init__(self, tmp: Path, data: Path, out: Path, point: str | None, *extra: str):
        self.marker = tmp / f"marker-{point}-{time.monotonic_ns()}"
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(REPO),  # the worker module runs from tmp, outside the repository
            REL_POINT=point or "none",
            REL_MARKER=str(self.marker),
            REL_EPOCH=str(KILLED_EPOCH),
            REL_PARK_S=str(PARK_SECONDS),
        )
        cmd = worker_cmd("interrupted_train") if point else [sys.executable, str(REPO / "train.py")]
        timed = point == "park-in-timing"  # the memory format timed, not given: it parks there
        argv = [*cmd, *train_argv(data, out, *extra, **RUN, channels_last=None if timed else False)]
        self.proc = warm_python.start(argv, cwd=tmp, env=env, merge_stderr=True)

    def wait_for_marker(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self.marker.exists():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited {self.proc.returncode} before the kill point:\n"
                    f"{self.proc.output()[0][-3000:]}"
                )
            assert time.monotonic() < deadline, "the kill point was never reached"
            time.sleep(0.1)

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        """Exit status and everything the process printed."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.proc.output()[0]


def _assert_resumable(out: Path, epoch: int, rows: list[int]) -> None:
    """last.pt loads (weights_only) and holds the last finished epoch; no torn file."""
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["epoch"] == epoch and ckpt["optimizer"] is not None
    assert _epochs_in_results(out) == rows


@pytest.fixture
def start(tmp_path):
    """``start(data, out, point, *extra) -> Run``; a process still alive after the test (a
    failed assertion while it was parked) is killed."""
    started: list[Run] = []

    def _start(data: Path, out: Path, point: str | None, *extra: str) -> Run:
        started.append(Run(tmp_path, data, out, point, *extra))
        return started[-1]

    yield _start
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_training_removes_the_lock(
    make_shapes_data, tmp_path, start, monkeypatch, signum
) -> None:
    """Was: SIGTERM during the start-up timing (the run folder locked, nothing trained) exited
    143 without a word and left run.lock behind. Now SIGTERM acts as Ctrl-C from the moment the
    lock is taken: one line, exit 130, no lock, what the start wrote set aside in failed-*/."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # no cached timing to skip the park
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"
    run = start(data, out, "park-in-timing")
    run.wait_for_marker()
    assert (out / "run.lock").is_file()
    run.proc.send_signal(signum)
    rc, log = run.finish()
    assert rc == 130, log[-3000:]
    assert not (out / "run.lock").exists()
    line = f"the run was interrupted before its first checkpoint; its files are in {out}"
    assert line in log and "Traceback" not in log
    (failed,) = out.glob("failed-*")
    assert (failed / "train.log").is_file() and not (out / "train.log").exists()


@pytest.mark.slow
def test_sigint_and_sigkill_at_every_point_then_resume_completes(make_shapes_data, tmp_path, start):
    data = make_shapes_data(n_train=16, n_val=2, img_size_range=(96, 128))  # 2 batches/epoch
    out = tmp_path / "run"

    # 1. Ctrl-C in the middle of epoch 1: exit 130, a resumable last.pt, and how to resume.
    run = start(data, out, "park-mid-epoch")
    run.wait_for_marker()
    _assert_resumable(out, 0, [0])
    run.proc.send_signal(signal.SIGINT)
    code, err = run.finish()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err
    assert (
        f"interrupted in epoch {KILLED_EPOCH}; last completed epoch is saved in "
        f"{out / 'last.pt'}; continue with --resume" in err
    )
    _assert_resumable(out, 0, [0])

    # 2. SIGKILL in the middle of epoch 1 (after one batch trained).
    run = start(data, out, "park-mid-epoch", "--resume")
    run.wait_for_marker()
    run.proc.send_signal(signal.SIGKILL)
    code, err = run.finish()
    assert code == -signal.SIGKILL and "resuming from" in err
    _assert_resumable(out, 0, [0])

    # 3. SIGKILL during the evaluation of epoch 1.
    code, err = start(data, out, "kill-in-eval", "--resume").finish()
    assert code == -signal.SIGKILL, err[-3000:]
    _assert_resumable(out, 0, [0])

    # 4. SIGKILL half-way through writing last.pt of epoch 1 (its results row is written).
    code, err = start(data, out, "kill-in-save", "--resume").finish()
    assert code == -signal.SIGKILL, err[-3000:]
    _assert_resumable(out, 0, [0, 1])
    assert list(out.glob(".last.pt.*.tmp")), "the torn write went to a temporary file"

    # 5. A plain --resume finishes the run: every epoch exactly once.
    code, err = start(data, out, None, "--resume").finish()
    assert code == 0, err[-3000:]
    # This session's epochs, and all of the run's (was: only the former, as if the whole run).
    assert (
        "Traceback" not in err and f"done: {EPOCHS - KILLED_EPOCH} epochs ({EPOCHS} in all)" in err
    )
    _assert_resumable(out, EPOCHS - 1, list(range(EPOCHS)))
    load_checkpoint(out / "best.pt")
    log = (out / "train.log").read_text()
    assert log.count("resuming from") == 4


@pytest.mark.slow
def test_ctrl_c_in_the_first_epoch_leaves_a_resumable_checkpoint(
    make_shapes_data, tmp_path, monkeypatch, console
):
    """Before the fix, the last.pt saved on Ctrl-C in epoch 0 (epoch=-1) was refused by
    --resume as 'weights, not a training state' although the message said to resume."""
    data = make_shapes_data(n_train=8, n_val=2, img_size_range=(96, 128))
    out = tmp_path / "run"
    real = trainer_module.train_one_epoch

    def ctrl_c(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT to this process
        time.sleep(5)  # the handler raises KeyboardInterrupt here
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(trainer_module, "train_one_epoch", ctrl_c)
    # Python's own Ctrl-C handler, whatever the test runner installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = [*train_argv(data, out, **RUN), "--epochs", "1"]
    try:
        assert train_script.main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = console.readouterr().err
    assert "interrupted in epoch 0 before any epoch completed; its part-trained weights" in err
    assert "last completed epoch" not in err and "continue with --resume" in err
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["epoch"] == -1 and ckpt["train_model"] is not None
    monkeypatch.setattr(trainer_module, "train_one_epoch", real)
    assert train_script.main([*argv, "--resume"]) == 0
    assert load_checkpoint(out / "last.pt")["epoch"] == 0
    assert _epochs_in_results(out) == [0]


@pytest.mark.slow
def test_ctrl_c_between_two_epochs_says_the_epoch_is_complete(
    make_shapes_data, tmp_path, monkeypatch, console
):
    """A SIGINT after epoch 0 was saved and before epoch 1 began: the message says epoch 0 is
    complete and saved (was: "interrupted in epoch 0", as if it had to be trained again)."""
    data = make_shapes_data(n_train=8, n_val=2, img_size_range=(96, 128))
    out = tmp_path / "run"

    def ctrl_c_after_the_epoch(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, once epoch 0's files are written
        time.sleep(5)
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(EpochPlan, "after_epoch", ctrl_c_after_the_epoch)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert train_script.main([*train_argv(data, out, **RUN), "--epochs", "2"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = console.readouterr().err
    assert f"interrupted after epoch 0, which is complete and saved in {out / 'last.pt'}" in err
    assert "interrupted in epoch" not in err
    assert load_checkpoint(out / "last.pt")["epoch"] == 0 and _epochs_in_results(out) == [0]
