"""A run folder has one owner: a live run's lock refuses a second run, a previous run is never
written over (numbered folders, --exist-ok moves it aside), the lock goes with the run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import LAUNCH_VARS, REPO_ROOT, read_results, run_training, script_env, train_argv

import train as train_script
from build_utils.errors import ConfigError
from train_utils import run_folder
from train_utils import run_folder as run_folder_module
from train_utils import trainer as trainer_module
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.process_group import DistInfo
from train_utils.run_folder import (
    FOREIGN_STALE_S,
    LOCK_NAME,
    claim_run_folder,
    folder_of_launch,
    launch_id,
    read_lock,
    resume_command,
)

IMG = 64
REPO = REPO_ROOT


def _write_lock(folder: Path, host: str, pid: int, age_s: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    lock.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01T00:00:00"}))
    if age_s:
        t = time.time() - age_s
        os.utime(lock, (t, t))
    return lock


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _is_zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"


@pytest.fixture
def sleeper():
    """A live process of this host (the holder of a lock), killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


# ---- the lock -------------------------------------------------------------------------------


def test_a_claim_locks_the_folder_with_host_and_pid_and_releases_it(tmp_path):
    claim = claim_run_folder(tmp_path / "r", resume=False, exist_ok=False)
    holder = read_lock(tmp_path / "r" / LOCK_NAME)
    assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
    # A second claim while it is held is refused, naming the holder.
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} on "):
        claim_run_folder(tmp_path / "r", resume=True, exist_ok=False)
    claim.release()
    assert not (tmp_path / "r" / LOCK_NAME).exists()


def test_a_live_lock_refuses_and_a_dead_pids_lock_is_taken_over(tmp_path, sleeper, caplog):
    run = tmp_path / "r"
    lock = _write_lock(run, socket.gethostname(), sleeper.pid)
    (run / "last.pt").write_bytes(b"previous")
    before = _snapshot(run)
    for resume, exist_ok in ((False, False), (True, False), (False, True)):
        with pytest.raises(ConfigError, match=f"pid {sleeper.pid} on {socket.gethostname()}"):
            claim_run_folder(run, resume=resume, exist_ok=exist_ok)
    assert _snapshot(run) == before and sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    sleeper.kill()
    while not _is_zombie(sleeper.pid):  # killed, not yet reaped: dead all the same
        time.sleep(0.01)
    claim = claim_run_folder(run, resume=True, exist_ok=False)
    assert claim.path == run and read_lock(lock).pid == os.getpid()
    assert any(
        f"taking over the lock of a run that is gone (pid {sleeper.pid}" in n for n in claim.notes
    )
    claim.release()


def test_another_hosts_lock_is_honoured_until_its_heartbeat_stops(tmp_path):
    run = tmp_path / "r"
    _write_lock(run, "node-17", 4242, age_s=FOREIGN_STALE_S / 2)
    with pytest.raises(ConfigError, match="pid 4242 on node-17"):
        claim_run_folder(run, resume=True, exist_ok=False)
    _write_lock(run, "node-17", 4242, age_s=FOREIGN_STALE_S + 60)
    claim = claim_run_folder(run, resume=True, exist_ok=False)
    assert read_lock(run / LOCK_NAME).host == socket.gethostname()
    claim.release()


def test_an_earlier_attempt_of_the_same_job_is_taken_over_at_once(tmp_path, monkeypatch):
    """A requeued SLURM job (same SLURM_JOB_ID) may start on another node right away."""
    run = tmp_path / "r"
    lock = _write_lock(run, "node-3", 99)
    info = json.loads(lock.read_text())
    lock.write_text(json.dumps({**info, "job": "slurm:77"}))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(ConfigError, match="pid 99 on node-3"):
        claim_run_folder(run, resume=True, exist_ok=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    claim = claim_run_folder(run, resume=True, exist_ok=False)
    assert read_lock(lock).job == "slurm:77" and read_lock(lock).pid == os.getpid()
    claim.release()


def test_the_path_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(ConfigError, match="the run folder's path is a file"):
        claim_run_folder(tmp_path / "f", resume=False, exist_ok=False)
    assert (tmp_path / "f").read_text() == "mine"


# ---- numbering and --exist-ok ---------------------------------------------------------------


def test_a_folder_holding_a_run_gets_the_next_free_number(tmp_path):
    base = tmp_path / "x"
    for name in ("x", "x2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.csv").write_text("epoch\n0\n")
    (base / "last.pt").write_bytes(b"a checkpoint")  # what --resume would continue
    (tmp_path / "x3").mkdir()  # empty: free
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "x3"
    assert claim.notes == [
        f"{base} holds a previous run (never overwritten); this run writes {tmp_path / 'x3'} "
        f"(--resume continues {base}, --exist-ok reuses it)"
    ]
    assert not (base / LOCK_NAME).exists()
    claim.release()
    # An empty or run-less folder is used as it is.
    claim = claim_run_folder(tmp_path / "x3", resume=False, exist_ok=False)
    assert claim.path == tmp_path / "x3" and claim.notes == []
    claim.release()


def test_exist_ok_moves_the_previous_run_aside(tmp_path):
    run = tmp_path / "x"
    (run / "val").mkdir(parents=True)
    (run / "results.csv").write_text("old rows")
    (run / "val" / "pic.png").write_bytes(b"png")
    claim = claim_run_folder(run, resume=False, exist_ok=True)
    assert claim.path == run and claim.moved_to is not None
    assert sorted(p.name for p in run.iterdir()) == sorted([LOCK_NAME, claim.moved_to.name])
    assert claim.moved_to.name.startswith("replaced-")
    assert (claim.moved_to / "results.csv").read_text() == "old rows"
    assert (claim.moved_to / "val" / "pic.png").read_bytes() == b"png"
    claim.release()


def test_a_folder_holding_files_a_run_writes_is_not_written_over(tmp_path):
    """Was: --output-dir DIR holding a user's model.cfg and hyp.yaml (this run's own --cfg and
    --hyp, say) had them replaced by the run's copies, without a word."""
    base = tmp_path / "m"
    base.mkdir()
    (base / "model.cfg").write_text("# my cfg\n")
    (base / "hyp.yaml").write_text("# my hyp\n")
    (base / "notes.txt").write_text("a file a run never writes: no reason to move on")
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "m2"
    assert claim.notes[0].startswith(f"{base} holds files a run writes (model.cfg, hyp.yaml")
    claim.release()
    assert (base / "model.cfg").read_text() == "# my cfg\n"
    # --exist-ok: the folder itself, its files moved aside first.
    claim = claim_run_folder(base, resume=False, exist_ok=True)
    assert claim.path == base and (claim.moved_to / "hyp.yaml").read_text() == "# my hyp\n"
    claim.release()
    only_notes = tmp_path / "n"
    only_notes.mkdir()
    (only_notes / "notes.txt").write_text("x")
    claim = claim_run_folder(only_notes, resume=False, exist_ok=False)
    assert claim.path == only_notes and claim.notes == []
    claim.release()


# A file of each name or glob a run writes besides RUN_FILES (run_folder.RUN_WRITES, checkpoints).
PICTURES_AND_OTHERS = [
    "labels.png",
    "results.png",
    "confusion_matrix.png",
    "F1_curve.png",
    "train_batch2.jpg",
    "val_batch0_pred.jpg",
    "events.out.tfevents.1795777144.vm.4102.0",
    "coco_gt_0123abcd.json",
    "trackers.json",
    "epoch3.pt",
    "last.weights",
    "evolve.csv",  # an --evolve search's (was: a user's evolve.csv read as the search's rows)
    "evolve.log",
]


@pytest.mark.parametrize("name", PICTURES_AND_OTHERS)
def test_a_folder_holding_a_picture_or_other_file_a_run_writes_is_not_written_over(tmp_path, name):
    """Was: only model.cfg, hyp.yaml, args.yaml, per_class.csv and the run's own files counted;
    a folder holding the user's labels.png (or results.png, an events file, ...) had it replaced
    by the run's, without a word."""
    base = tmp_path / "u"
    base.mkdir()
    (base / name).write_text("mine\n")
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "u2"
    assert claim.notes == [
        f"{base} holds files a run writes ({name}: never overwritten); this run writes "
        f"{tmp_path / 'u2'} (--exist-ok reuses it)"  # no last.pt: nothing to --resume
    ]
    claim.release()
    assert _snapshot(base) == {name: b"mine\n"}
    # The next number is not one holding such a file either.
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "u2"  # empty but for what this test left: free
    claim.release()
    (tmp_path / "u2" / name).write_text("mine too\n")
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "u3"
    claim.release()
    # --exist-ok: the folder itself, the file moved aside first (as for model.cfg).
    claim = claim_run_folder(base, resume=False, exist_ok=True)
    assert claim.path == base and (claim.moved_to / name).read_text() == "mine\n"
    assert claim.notes == [f"--exist-ok: the previous run in {base} was moved to {claim.moved_to}"]
    claim.release()


def test_a_note_names_the_first_files_a_run_writes_and_counts_the_rest(tmp_path):
    base = tmp_path / "u"
    base.mkdir()
    for name in PICTURES_AND_OTHERS:
        (base / name).write_text("mine\n")
    (base / "empty.png").write_text("")
    (base / "train_batch9.jpg").write_text("a batch a run never draws")
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.notes[0].startswith(
        f"{base} holds files a run writes (confusion_matrix.png, F1_curve.png, "
        "val_batch0_pred.jpg, labels.png, train_batch2.jpg and 8 more: never overwritten); "
    )
    claim.release()


# ---- through the trainer and train.py -------------------------------------------------------


def test_the_lock_is_gone_after_an_exception_and_ctrl_c(make_shapes_data, tmp_path, monkeypatch):
    data = make_shapes_data(n_train=4, n_val=2)
    config = build_config(get_args_parser().parse_args(train_argv(data, tmp_path / "r", img=IMG)))

    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        held = []

        def fail(config, dist, t_start, signals, error=error, held=held):
            held.append(config.output_dir)
            assert read_lock(config.output_dir / LOCK_NAME).pid == os.getpid()
            raise error

        monkeypatch.setattr(trainer_module, "_train", fail)
        with pytest.raises(type(error)):
            trainer_module.run(config, DistInfo.single(torch.device("cpu")))
        assert held and not (held[0] / LOCK_NAME).exists()


def test_train_py_on_a_live_runs_folder_exits_2_with_one_line(
    make_shapes_data, tmp_path, sleeper, console
):
    """Defect 2: a second run on a folder a live run holds stops, writing nothing there."""
    data = make_shapes_data(n_train=4, n_val=2)
    run = tmp_path / "same"
    _write_lock(run, socket.gethostname(), sleeper.pid)
    (run / "train.log").write_text("the live run's log\n")
    before = _snapshot(run)
    for extra in ((), ("--exist-ok",), ("--resume",)):
        code = train_script.main(train_argv(data, run, *extra, img=IMG))
        assert code == 2
        [line] = console.readouterr().err.splitlines()
        assert line.startswith(f"error: {run} is in use by another run (pid {sleeper.pid} on ")
        assert _snapshot(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same", "shapes"]


@pytest.mark.slow
def test_a_name_in_use_never_overwrites_the_run_there(make_shapes_data, tmp_path, caplog):
    """Defect 1: training again with the name of a copied run leaves the copy as it was and
    writes the next numbered folder; --exist-ok reuses it with the old run moved aside."""
    data = make_shapes_data(n_train=4, n_val=2)
    first = tmp_path / "r3"
    run_training(train_argv(data, first, img=IMG, epochs=1))
    assert not (first / LOCK_NAME).exists()
    copy = tmp_path / "r3copy"
    shutil.copytree(first, copy)
    before = _snapshot(copy)

    with caplog.at_level(logging.INFO):
        summary = run_training(train_argv(data, copy, img=IMG, epochs=1))
    assert summary.output_dir == tmp_path / "r3copy2"
    assert _snapshot(copy) == before
    assert [r["epoch"] for r in read_results(tmp_path / "r3copy2" / "results.csv")] == ["0"]
    assert (
        f"{copy} holds a previous run (never overwritten); this run writes {tmp_path / 'r3copy2'}"
        in caplog.text
    )
    assert (
        f"this run writes {tmp_path / 'r3copy2'}"
        in (tmp_path / "r3copy2" / "train.log").read_text()
    )
    assert not (tmp_path / "r3copy2" / LOCK_NAME).exists()

    # --weights from inside the folder that --exist-ok empties still loads (it moved along).
    summary = run_training(
        train_argv(data, copy, "--exist-ok", "--weights", str(copy / "last.pt"), img=IMG, epochs=1)
    )
    assert summary.output_dir == copy
    [moved] = [p for p in copy.iterdir() if p.name.startswith("replaced-")]
    assert _snapshot(moved) == before
    assert [r["epoch"] for r in read_results(copy / "results.csv")] == ["0"]
    assert "the previous run" not in (moved / "train.log").read_text()
    assert "--exist-ok: the previous run" in (copy / "train.log").read_text()
    assert not (copy / LOCK_NAME).exists()


@pytest.mark.slow
def test_train_py_never_replaces_a_users_pictures(make_shapes_data, tmp_path, console):
    """The defect as found: --output-dir u holding the user's labels.png, results.png,
    confusion_matrix.png, train_batch0.jpg and PR_curve.png exited 0 with the run's pictures in
    their place. Now the run writes u2 and says so; u is as it was."""
    data = make_shapes_data(n_train=4, n_val=2)
    base = tmp_path / "u"
    base.mkdir()
    names = ("labels.png", "results.png", "confusion_matrix.png", "train_batch0.jpg")
    for name in (*names, "PR_curve.png"):
        (base / name).write_text("mine\n")
    before = _snapshot(base)
    assert train_script.main(train_argv(data, base, img=IMG, epochs=1, plots=True)) == 0
    note = (
        f"{base} holds files a run writes (confusion_matrix.png, PR_curve.png, labels.png, "
        f"train_batch0.jpg, results.png: never overwritten); this run writes {tmp_path / 'u2'} "
        "(--exist-ok reuses it)"
    )
    assert note in console.readouterr().err
    assert _snapshot(base) == before
    written = {p.name for p in (tmp_path / "u2").iterdir()}
    assert {*names, "PR_curve.png", "last.pt", "train.log"} <= written
    assert note in (tmp_path / "u2" / "train.log").read_text()


@pytest.mark.slow
def test_under_ddp_a_refusal_stops_every_rank(make_shapes_data, tmp_path, sleeper):
    """train_multi_GPU.py with 2 spawned gloo processes: a live lock stops both ranks with the
    same one line (no hang), and nothing is written."""
    data = make_shapes_data(n_train=8, n_val=2)
    run = tmp_path / "x"
    _write_lock(run, socket.gethostname(), sleeper.pid)
    (run / "results.csv").write_text("epoch\n0\n")
    before = _snapshot(run)
    env = {k: v for k, v in script_env().items() if k not in LAUNCH_VARS}
    cmd = [sys.executable, str(REPO / "train_multi_GPU.py"), "--nproc-per-node", "2"]
    cmd += train_argv(data, run, img=IMG)
    proc = warm_python.run(cmd, cwd=tmp_path, env=env, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: claiming the run folder failed on rank 0 ({socket.gethostname()}): {run} is in "
        f"use by another run (pid {sleeper.pid} on {socket.gethostname()}, started "
        f"2026-01-01T00:00:00); wait for it to finish or choose another --name/--output-dir "
        f"(if that run is gone, delete {run / LOCK_NAME})"
    ]
    assert _snapshot(run) == before and not (tmp_path / "x2").exists()


def test_a_restarted_launch_finds_the_numbered_folder_its_first_attempt_wrote(tmp_path):
    """torchrun --max-restarts: the first attempt wrote runs/x2 (runs/x held a previous run);
    the restart must continue runs/x2, never the previous run in runs/x (the old code looked
    for runs/x/last.pt and would have resumed someone else's run there)."""
    agent = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "none"}
    me = launch_id(agent)
    assert me == f"torchrun-agent:{socket.gethostname()}:{os.getppid()}"
    assert launch_id({"SLURM_JOB_ID": "42", **agent}) == "slurm:42"
    assert launch_id({}) == ""  # no launcher: nothing to continue
    base = tmp_path / "x"
    for name, launch in (("x", "slurm:7"), ("x2", me), ("x3", "slurm:8"), ("xy", me)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "last.pt").write_bytes(b"weights")
        (tmp_path / name / "args.yaml").write_text(f"epochs: 3\nlaunch: '{launch}'\n")
    assert folder_of_launch(base, me) == tmp_path / "x2"
    assert folder_of_launch(base, "slurm:7") == base
    assert folder_of_launch(base, "slurm:9") is None
    assert folder_of_launch(base, "") is None
    (tmp_path / "x2" / "last.pt").unlink()  # the first attempt died before its first epoch
    assert folder_of_launch(base, me) is None


def test_a_requeued_job_writes_the_folder_its_killed_first_attempt_left_without_checkpoint(
    tmp_path, monkeypatch
):
    """The README's sbatch script: an attempt SIGKILLed before its first epoch leaves train.log,
    results.csv, args.yaml and its lock, and no last.pt; each requeue then wrote OUT2, OUT3, ...
    from epoch 0 and never resumed. Now an attempt of the same job sets those files aside and
    writes OUT; another job's folder is still never written over."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    base = tmp_path / "yolo-4242"
    base.mkdir()
    killed = {"args.yaml": "launch: slurm:4242\n", "train.log": "epoch 0\n", "results.csv": "e\n"}
    for name, text in killed.items():
        (base / name).write_text(text)
    (base / "notes.txt").write_text("mine\n")  # not a run's file: stays where it is
    (base / LOCK_NAME).write_text('{"host": "gone", "pid": 1, "started": "x", "job": "slurm:4242"}')
    claim = claim_run_folder(base, resume=False, exist_ok=False)
    assert claim.path == base
    [aside] = base.glob("failed-*")
    assert {p.name: p.read_text() for p in aside.iterdir()} == killed
    assert (base / "notes.txt").read_text() == "mine\n"
    assert claim.notes[0] == (
        f"{base}: an earlier attempt of this job (slurm:4242) stopped before its first "
        f"checkpoint; its files are in {aside}, and this attempt writes {base}"
    )
    claim.release()
    # Another job's killed start: numbered, as any previous run.
    other = tmp_path / "other"
    other.mkdir()
    for name, text in {**killed, "args.yaml": "launch: slurm:7\n"}.items():
        (other / name).write_text(text)
    claim = claim_run_folder(other, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "other2" and not list(other.glob("failed-*"))
    claim.release()
    # This job's folder whose files cannot be moved: numbered too, said, never a traceback.
    again = tmp_path / "again"
    again.mkdir()
    for name, text in killed.items():
        (again / name).write_text(text)

    def cannot_move(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(run_folder_module, "_move_into", cannot_move)
    claim = claim_run_folder(again, resume=False, exist_ok=False)
    assert claim.path == tmp_path / "again2"
    assert "an earlier attempt's files cannot be moved aside" in claim.notes[0]
    claim.release()


def test_half_written_files_of_a_killed_run_are_removed_when_the_folder_is_claimed(tmp_path):
    """A SIGKILL during last.pt leaves .last.pt.<pid>.<hex>.tmp; the next run that holds the
    folder (--resume) removes it, and nothing else."""
    folder = tmp_path / "run"
    folder.mkdir()
    torn = folder / ".last.pt.4242.0123abcd.tmp"
    torn.write_bytes(b"half a checkpoint")
    keep = [folder / "last.pt", folder / ".hidden.tmp", folder / "notes.4242.0123abcd.tmp"]
    for p in keep:
        p.write_bytes(b"the user's")
    claim = claim_run_folder(folder, resume=True, exist_ok=False)
    try:
        assert not torn.exists()
        assert all(p.read_bytes() == b"the user's" for p in keep)
        assert any(".last.pt.4242.0123abcd.tmp" in note for note in claim.notes)
    finally:
        claim.release()


def test_default_named_runs_started_in_the_same_second_take_the_next_numbers(tmp_path):
    """The default name (the start time) is not the user's choice: a job array's runs started
    in one second each get a folder (x, x2, x3), where a chosen name in use is refused."""
    base = tmp_path / "20261123-223512"
    claims = [claim_run_folder(base, resume=False, exist_ok=False, auto_named=True)]
    try:
        with pytest.raises(ConfigError, match="is in use by another run"):
            claim_run_folder(base, resume=False, exist_ok=False)
        claims.append(claim_run_folder(base, resume=False, exist_ok=False, auto_named=True))
        claims.append(claim_run_folder(base, resume=False, exist_ok=False, auto_named=True))
        assert [c.path.name for c in claims] == [base.name, f"{base.name}2", f"{base.name}3"]
        assert "is in use by another run; this run writes" in claims[1].notes[0]
    finally:
        for claim in claims:
            claim.release()


def test_a_default_name_that_loses_the_race_for_its_lock_takes_the_next_number(
    tmp_path, monkeypatch
):
    """Both runs saw a free folder; the other run's lock appears just before ours."""
    base = tmp_path / "20261123-223512"
    real_acquire = run_folder._acquire
    raced = []

    def acquire(folder, notes):
        if not raced:  # the other run takes the folder between our choice and our lock
            raced.append(None)
            monkeypatch.setattr(run_folder, "_acquire", real_acquire)
            raced[0] = claim_run_folder(folder, resume=False, exist_ok=False)
            monkeypatch.setattr(run_folder, "_acquire", acquire)
        return real_acquire(folder, notes)

    monkeypatch.setattr(run_folder, "_acquire", acquire)
    claim = claim_run_folder(base, resume=False, exist_ok=False, auto_named=True)
    try:
        assert raced[0].path == base and claim.path == base.with_name(f"{base.name}2")
    finally:
        claim.release()
        raced[0].release()


def test_a_hostile_args_yaml_is_not_a_run_of_ours(tmp_path):
    """args.yaml files that are not what they claim (a billion-laughs document, a FIFO, a
    Python tag, UTF-16) are skipped quickly, without hanging or filling memory; the next
    folder with the launch is found."""
    me = "slurm:42"
    laughs = "a0: &a0 [" + ", ".join(['"lol"'] * 10) + "]\n"
    for i in range(1, 10):
        laughs += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n"
    hostile = {
        "x": laughs + f"launch: '{me}'\n",
        "x2": f"launch: !!python/object/apply:os.system ['touch {tmp_path}/pwned']\n",
        "x3": None,  # a FIFO: opening it would block forever
        "x4": f"launch: '{me}'\n".encode("utf-16"),
    }
    for name, content in hostile.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "last.pt").write_bytes(b"weights")
        args = tmp_path / name / "args.yaml"
        if content is None:
            os.mkfifo(args)
        elif isinstance(content, bytes):
            args.write_bytes(content)
        else:
            args.write_text(content)
    start = time.monotonic()
    assert folder_of_launch(tmp_path / "x", me) is None
    (tmp_path / "x5").mkdir()
    (tmp_path / "x5" / "last.pt").write_bytes(b"weights")
    (tmp_path / "x5" / "args.yaml").write_text(f"epochs: 3\nlaunch: '{me}'\n")
    assert folder_of_launch(tmp_path / "x", me) == tmp_path / "x5"
    assert time.monotonic() - start < 2
    assert not (tmp_path / "pwned").exists()


def test_the_resume_hint_names_the_checkpoint_where_bare_resume_would_not_find_it(
    tmp_path, monkeypatch
):
    """Bare --resume looks for runs/*/last.pt; a run of --project runs/train was told
    "continue with --resume", which then found nothing."""
    monkeypatch.chdir(tmp_path)
    assert resume_command(Path("runs/exp/last.pt")) == "--resume"
    assert resume_command(tmp_path / "runs" / "exp" / "last.pt") == "--resume"
    deeper = Path("runs/train/exp3/last.pt")
    assert resume_command(deeper) == f"--resume {deeper}"
    assert resume_command(tmp_path / "x" / "last.pt") == f"--resume {tmp_path / 'x' / 'last.pt'}"
    # A candidate of an --evolve search: the search continues it (was: the candidate alone).
    search = tmp_path / "runs" / "evolve"
    search.mkdir(parents=True)
    (search / "search.yaml").write_text("generations: 3\n")
    assert resume_command(search / "candidate-003" / "last.pt") == f"--resume {search}"
