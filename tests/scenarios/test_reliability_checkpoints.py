"""Reliability, the epoch's end: a signal (SIGKILL, SIGTERM, SIGINT) at each write of an epoch's
end -- while ``results.csv``, ``last.pt`` or ``best.pt`` is being written, or between ``last.pt``
and ``best.pt`` -- followed by ``--resume``, ends in the run folder of an uninterrupted run:
``last.pt`` and ``best.pt`` with bitwise equal weights, ``best.pt`` the epoch ``last.pt`` names
as the best, the same ``results.csv`` rows (timing columns aside), and a log that names only
files that exist. A SLURM-style SIGUSR1 mid-epoch stops the run with exit status 75 and a
``last.pt`` that resumes exactly.

The signals are sent by the process to itself at the chosen write (tests/workers/
interrupted_train.py, ``signal-at-write``), so each point is hit deterministically. Also here:
SIGUSR1 reaching one of two gloo ranks stops both before the same batch
(tests/workers/stop_request_worker.py), ``--resume``'s repair of ``best.pt`` on its own, and the
README's sbatch script (requeue on 75, ``--resume`` when requeued) with stand-in srun/scontrol.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import rank_envs, run_pair, train_argv, worker_cmd

from build_utils.errors import CheckpointError
from data.make_shapes import make_dataset
from train_utils import resume
from train_utils.checkpoint import load_checkpoint, save_checkpoint
from train_utils.cli import EXIT_INTERRUPTED, EXIT_STOPPED
from train_utils.reporting import TIMING_COLUMNS
from train_utils.stop_signals import STOP_POLL_BATCHES

REPO = Path(__file__).resolve().parents[2]
RUN = {"epochs": 2, "batch": 8, "img": 64, "nbs": 8}  # as test_reliability_interrupt's runs
TIMING = set(TIMING_COLUMNS)
WEIGHTS = ("model", "train_model", "ema")
PARK_S = 10  # how long the SIGUSR1 test's process waits, parked, for the signal


def _env(tmp: Path, **rel: object) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.update({f"REL_{k.upper()}": str(v) for k, v in rel.items()})
    return env


def _train(tmp: Path, data: Path, out: Path, *extra: str, **rel: str) -> tuple[int, str]:
    """One training process (the hook's wrapper when ``rel`` names a point); status and output."""
    cmd = worker_cmd("interrupted_train") if rel else [sys.executable, str(REPO / "train.py")]
    env = _env(tmp, **(rel or {"point": "none", "marker": tmp / "unused"}))
    argv = [*cmd, *train_argv(data, out, *extra, **RUN)]
    proc = warm_python.run(argv, cwd=tmp, env=env, timeout=300, merge_stderr=True)
    return proc.returncode, proc.stdout


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open(newline="") as f:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The dataset and the folder of one uninterrupted run, shared by every case."""
    tmp = tmp_path_factory.mktemp("ckpt-ref")
    data = make_dataset(tmp / "shapes", 16, 2, img_size_range=(96, 128), workers=1)
    out = tmp / "ref"
    code, log = _train(tmp, data, out)
    assert code == 0, log[-3000:]
    return data, out


def _assert_same_folder(out: Path, ref: Path) -> None:
    """``out`` is ``ref``: checkpoints with bitwise equal weights, results rows, best.pt the
    epoch last.pt names, and the last "done" line naming only files that exist."""
    for name in ("last.pt", "best.pt"):
        got, want = load_checkpoint(out / name), load_checkpoint(ref / name)
        assert (got["epoch"], got["best_epoch"]) == (want["epoch"], want["best_epoch"]), name
        for key in WEIGHTS:
            if want.get(key) is None:
                continue
            assert got[key].keys() == want[key].keys()
            for k, v in want[key].items():
                assert torch.equal(got[key][k], v), f"{name} {key}.{k} differs"
    last, best = load_checkpoint(out / "last.pt"), load_checkpoint(out / "best.pt")
    assert best["epoch"] == last["best_epoch"]
    assert _rows(out) == _rows(ref)
    done = [line for line in (out / "train.log").read_text().splitlines() if "done:" in line]
    named = re.search(r"weights (.*)$", done[-1]).group(1).split(", ")
    assert named and all(Path(p).is_file() for p in named), done[-1]


# (write, signal): a signal the run handles (SIGTERM, SIGINT) at each write, SIGKILL where it
# can leave the checkpoints disagreeing. SIGKILL during last.pt (and so after results.csv) is
# tests/scenarios/test_reliability_interrupt.py's kill-in-save; each case costs two training
# processes.
CASES = [
    ("results.csv", "TERM"),
    ("last.pt", "INT"),
    ("between", "KILL"),
    ("best.pt", "KILL"),
    ("best.pt", "TERM"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("write", "sig"), CASES, ids=[f"{w}-{s}" for w, s in CASES])
def test_signal_at_an_epoch_end_write_then_resume_equals_an_uninterrupted_run(
    reference, tmp_path, write, sig
):
    data, ref = reference
    best_epoch = load_checkpoint(ref / "last.pt")["best_epoch"]
    # best.pt is written only at a best epoch; the other writes at the last epoch, after which
    # last.pt of the epoch before exists to resume from.
    epoch = best_epoch if write in ("between", "best.pt") else RUN["epochs"] - 1
    out = tmp_path / "run"
    marker = tmp_path / "marker"
    code, log = _train(
        tmp_path,
        data,
        out,
        point="signal-at-write",
        marker=marker,
        write=write,
        epoch=epoch,
        signal=sig,
    )
    assert marker.is_file(), log[-3000:]
    if sig == "KILL":
        assert code == -signal.SIGKILL, log[-3000:]
    else:
        assert code == EXIT_INTERRUPTED and "Traceback" not in log, log[-3000:]
        # The signal waited for the epoch's writes: the three agree at once.
        last, best = load_checkpoint(out / "last.pt"), load_checkpoint(out / "best.pt")
        assert last["epoch"] == epoch and best["epoch"] == last["best_epoch"]
        assert [int(r["epoch"]) for r in _rows(out)] == list(range(epoch + 1))

    code, log = _train(tmp_path, data, out, "--resume")
    assert code == 0 and "Traceback" not in log, log[-3000:]
    _assert_same_folder(out, ref)


@pytest.mark.slow
def test_sigusr1_stops_between_batches_with_status_75_and_resumes_exactly(reference, tmp_path):
    """SLURM's warning signal (``--signal=USR1@120``): the run stops before its next batch,
    keeps the last finished epoch's last.pt, exits 75 (the sbatch script requeues on it), and
    --resume ends in the uninterrupted run's folder. Before: SIGUSR1 killed the process."""
    data, ref = reference
    out = tmp_path / "run"
    marker = tmp_path / "marker"
    # Parked after the first batch of epoch 0 (of 2), long enough for the signal to come; the
    # park goes on after it (the handler only asks), then the run stops before epoch 1.
    env = _env(tmp_path, point="park-mid-epoch", marker=marker, epoch=0, park_s=PARK_S)
    argv = [*worker_cmd("interrupted_train"), *train_argv(data, out, **RUN)]
    proc = warm_python.start(argv, cwd=tmp_path, env=env, merge_stderr=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.output()[0]
    assert marker.exists() and code == EXIT_STOPPED, log[-3000:]
    assert "Traceback" not in log
    assert "stopped: SIGUSR1 (stop requested) in epoch 1 before batch 0/2" in log
    assert load_checkpoint(out / "last.pt")["epoch"] == 0
    code, log = _train(tmp_path, data, out, "--resume")
    assert code == 0, log[-3000:]
    _assert_same_folder(out, ref)


@pytest.mark.slow
def test_sigusr1_on_one_rank_stops_every_rank_before_the_same_batch(tmp_path):
    """Under DDP the stop is agreed (a collective every STOP_POLL_BATCHES batches): a signal
    that reached one rank only stops both ranks before the same batch, none left waiting."""
    out = tmp_path / "out"
    out.mkdir()
    run_pair([worker_cmd("stop_request_worker", out)] * 2, rank_envs())
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    stop_at = STOP_POLL_BATCHES  # the first poll after rank 1's signal (after batch 3)
    for res in results:
        assert res["taken"] == list(range(stop_at))
        expected = f"SIGUSR1 (stop requested) in epoch 4 before batch {stop_at}/25"
        assert res["message"].startswith(expected)


# ---------------------------------------------------------------- --resume's repair of best.pt


def _ckpt(path: Path, epoch: int, best_epoch: int | None) -> None:
    save_checkpoint({"epoch": epoch, "best_epoch": best_epoch, "w": torch.full((2,), epoch)}, path)


def test_resume_rebuilds_a_best_pt_that_a_crash_left_missing_or_stale(tmp_path, caplog):
    """A crash between last.pt and best.pt (or a folder of the old order): last.pt names itself
    the best, so best.pt becomes a copy of it; one that already agrees is left alone."""
    caplog.set_level(logging.INFO)
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    _ckpt(last, 3, 3)
    ckpt = load_checkpoint(last)
    resume.reconcile_best(ckpt, last, best, trust=False)  # missing
    assert best.read_bytes() == last.read_bytes()
    _ckpt(best, 1, 1)  # stale
    resume.reconcile_best(ckpt, last, best, trust=False)
    assert best.read_bytes() == last.read_bytes()
    assert "best.pt was epoch 1: rebuilt from" in caplog.text
    _ckpt(best, 3, 3)  # agrees: not rewritten
    mtime = best.stat().st_mtime_ns
    resume.reconcile_best(ckpt, last, best, trust=False)
    assert best.stat().st_mtime_ns == mtime


def test_resume_says_when_best_pt_cannot_be_rebuilt(tmp_path, caplog):
    """last.pt names an earlier epoch as the best whose best.pt is gone: one warning, nothing
    written (the next better epoch writes best.pt)."""
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    _ckpt(last, 3, 2)
    _ckpt(best, 1, 1)
    before = best.read_bytes()
    resume.reconcile_best(load_checkpoint(last), last, best, trust=False)
    assert best.read_bytes() == before
    assert "is epoch 1 but" in caplog.text and "names epoch 2 as the best" in caplog.text


# ---------------------------------------------------------------- README's sbatch script


def _readme_sbatch_script() -> str:
    text = (REPO / "README.md").read_text()
    scripts = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", text, flags=re.S)
    # The training job's (the other, --evolve's on Ray, requeues nothing itself).
    requeuing = [s for s in scripts if "scontrol requeue" in s]
    assert len(requeuing) == 1
    return requeuing[0]


def test_readme_sbatch_script_requeues_on_status_75_and_resumes_when_requeued(tmp_path):
    """The README's sbatch script with stand-ins for srun and scontrol: a first job trains
    without --resume; stopped by the signal (75) it requeues itself; the requeued job, finding
    last.pt, passes --resume; a job that ends with 0 is not requeued."""
    runs = tmp_path / "runs"
    script = tmp_path / "job.sh"
    script.write_text(_readme_sbatch_script().replace("/shared/runs", str(runs)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    # srun: records its arguments, "saves" last.pt and exits with $SRUN_STATUS.
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho "srun $*" >> {calls}\nmkdir -p {runs}/yolo-42\n'
        f"touch {runs}/yolo-42/last.pt\nexit $SRUN_STATUS\n"
    )
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.update(SLURM_JOB_NAME="yolo", SLURM_JOB_ID="42")

    def job(status: int) -> tuple[int, list[str]]:
        calls.write_text("")
        proc = subprocess.run(["bash", str(script)], env={**env, "SRUN_STATUS": str(status)})
        return proc.returncode, calls.read_text().splitlines()

    # An earlier job of the same name (another id) has a run of its own: not this job's.
    (runs / "yolo-41").mkdir(parents=True)
    (runs / "yolo-41" / "last.pt").write_bytes(b"an earlier job's run")
    code, lines = job(EXIT_STOPPED)
    assert code == EXIT_STOPPED
    assert "--resume" not in lines[0].split() and lines[1:] == ["scontrol requeue 42"]
    code, lines = job(0)
    assert code == 0 and lines[0].split()[-1] == "--resume" and len(lines) == 1


def test_a_best_pt_that_cannot_be_rebuilt_is_a_warning(tmp_path, caplog, monkeypatch):
    """The repair runs on rank 0 only: a failed copy (read-only folder, full disk) must not
    raise there while the other ranks wait in a collective; it is one warning."""
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    _ckpt(last, 3, 3)

    def fail(*args):
        raise CheckpointError("cannot copy: Read-only file system", best)

    monkeypatch.setattr(resume, "copy_checkpoint", fail)
    resume.reconcile_best(load_checkpoint(last), last, best, trust=False)
    assert not best.exists() and "could not be rebuilt" in caplog.text
