"""``train.py --evolve`` end to end on the CPU: the search's files, the best hyp reproducing its
fitness, a failed candidate recorded while the search goes on, a search killed at a candidate's
mid-point continued with ``--resume`` into the same evolve.csv as an uninterrupted one, a full
disk, and bad input as one line before anything is written."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import pytest

import train
from build_utils.errors import OutputError, RunStopped
from build_utils.safe_yaml import load_yaml
from tests.conftest import finish_all, read_results, run_script, start_process, train_argv
from tests.train_utils.test_stop_signals import InterruptsWhenDeleted, swallowed
from train_utils import trainer
from train_utils.checkpoint import load_checkpoint
from train_utils.config import HYP_SPECS, load_hyp
from train_utils.engine import NonFiniteLossError
from train_utils.evolve import record, search, space
from train_utils.run_folder import SEARCH_RECORD

REPO = Path(__file__).resolve().parents[2]
SHIPPED_SPACE = space.load_space(REPO / space.DEFAULT_SPACE)


def search_argv(data: Path, out: Path, n: int, *extra: str, epochs: int = 1) -> list[str]:
    return train_argv(data, out, "--evolve", str(n), *extra, epochs=epochs)


def csv_rows(out: Path) -> list[dict[str, str]]:
    with (out / record.CSV_NAME).open(newline="") as f:
        return list(csv.DictReader(f))


def last_fitness(run: Path) -> float:
    last = [r for r in read_results(run / "results.csv") if r["mAP50-95"]][-1]
    return space.fitness({k: float(last[k]) for k in record.METRICS})


def second_candidate_raises(monkeypatch, error: BaseException):
    """Make candidate-001's training raise ``error`` (the others train); the real run."""
    real_run = trainer.run

    def run(config, dist, signals=None):
        if config.output_dir.name == "candidate-001":
            raise error
        return real_run(config, dist, signals)

    monkeypatch.setattr(trainer, "run", run)
    return real_run


def test_a_search_writes_its_files_records_a_failure_and_its_best_hyp_reproduces(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    real_run = second_candidate_raises(
        monkeypatch, NonFiniteLossError("the loss became NaN at epoch 0, batch 1")
    )
    assert train.main(search_argv(data, out, 3)) == 0
    rows = csv_rows(out)
    assert [r["candidate"] for r in rows] == ["0", "1", "2"]
    assert [r["status"] for r in rows] == ["done", "failed", "done"]
    assert rows[1]["reason"] == "the loss became NaN at epoch 0, batch 1" and not rows[1]["fitness"]
    base = load_hyp(REPO / "cfg/hyp.yaml")
    parsed = record.read_rows(out / record.CSV_NAME, {k: HYP_SPECS[k].kind for k in base})
    assert parsed[0].hyp == base  # the first candidate is --hyp itself
    for row in parsed[1:]:
        changed = {k for k in base if row.hyp[k] != base[k]}
        assert changed and changed <= {k for k, g in SHIPPED_SPACE.genes.items() if g.gain > 0}
    # Each candidate is a run folder of its own; its fitness is its last epoch's.
    for row in parsed[::2]:
        assert row.fitness == last_fitness(out / row.run)
        assert row.fitness == pytest.approx(
            0.1 * row.metrics["mAP50"] + 0.9 * row.metrics["mAP50-95"]
        )
    assert (out / record.PLOT_NAME).stat().st_size > 0 and (out / SEARCH_RECORD).is_file()
    best = record.best_row(parsed)
    assert "the best, " + best.run in capsys.readouterr().err
    # hyp_evolve.yaml is the best candidate's hyp, and trains to the same fitness.
    best_hyp = out / record.BEST_HYP_NAME
    assert load_hyp(best_hyp) == best.hyp
    monkeypatch.setattr(trainer, "run", real_run)
    again = tmp_path / "again"
    assert train.main(train_argv(data, again, "--hyp", str(best_hyp))) == 0
    assert last_fitness(again) == best.fitness


def test_a_killed_search_continues_into_the_evolve_csv_of_an_uninterrupted_one(
    make_shapes_data, tmp_path
) -> None:
    data = make_shapes_data(n_train=8, n_val=4)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_py = [sys.executable, str(REPO / "train.py")]
    reference = start_process([*train_py, *search_argv(data, whole, 3, "--seed", "3", epochs=2)])
    proc = start_process([*train_py, *search_argv(data, killed, 3, "--seed", "3", epochs=2)])
    # SIGKILL once candidate 1 has saved its first epoch: in the middle of its second.
    deadline = time.monotonic() + 300
    while not (killed / "candidate-001" / "last.pt").exists():
        assert proc.poll() is None, proc.output()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    finish_all([reference])
    assert [r["candidate"] for r in csv_rows(killed)] == ["0"]
    done_before = (killed / "candidate-000" / "results.csv").read_bytes()
    resumed = run_script("train.py", ["--resume", str(killed)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing" in resumed.stderr and "1 of 3 candidates done" in resumed.stderr
    # Candidate 0 was not trained again; candidate 1 continued its last.pt.
    assert (killed / "candidate-000" / "results.csv").read_bytes() == done_before
    assert "resuming from" in (killed / "candidate-001" / "train.log").read_text()

    def comparable(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert comparable(csv_rows(killed)) == comparable(csv_rows(whole))


def test_a_full_disk_stops_the_search_and_resume_finishes_it(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    real = record.write_rows
    calls = []

    def full_on_the_second(path, rows, keys):
        calls.append(len(rows))
        if len(calls) == 2:
            raise OutputError(f"cannot write {path}: No space left on device")
        real(path, rows, keys)

    monkeypatch.setattr(record, "write_rows", full_on_the_second)
    assert train.main(search_argv(data, out, 2)) == 2
    assert "No space left on device" in capsys.readouterr().err.strip().splitlines()[-1]
    assert [r["candidate"] for r in csv_rows(out)] == ["0"]
    monkeypatch.setattr(record, "write_rows", real)
    assert train.main(["--resume", str(out)]) == 0
    rows = csv_rows(out)
    assert [r["candidate"] for r in rows] == ["0", "1"]
    assert all(r["status"] == "done" for r in rows)

    # --evolve N with --resume extends a finished search; it keeps that size afterwards, also
    # when stopped before the extension is done (the record says it at once).
    def stop_at_the_third(*args, **kwargs):
        raise KeyboardInterrupt

    search_here = search._search_here
    monkeypatch.setattr(search, "_search_here", stop_at_the_third)
    assert train.main(["--evolve", "3", "--resume", str(out)]) == 130
    assert load_yaml(out / "search.yaml", "search record")["evolve"] == 3
    monkeypatch.setattr(search, "_search_here", search_here)
    assert train.main(["--resume", str(out)]) == 0
    assert [r["candidate"] for r in csv_rows(out)] == ["0", "1", "2"]
    capsys.readouterr()
    assert train.main(["--resume", str(out)]) == 0
    assert "3 of 3 candidates done" in capsys.readouterr().err


def test_a_stop_request_ends_the_search_with_75_and_resume_finishes_it(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    """SIGUSR1 (a SLURM job's warning) stops the candidate in training (its run raises
    RunStopped after keeping last.pt): the search stops with status 75, resumable."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    real_run = second_candidate_raises(monkeypatch, RunStopped("stop requested (SIGUSR1)"))
    assert train.main(search_argv(data, out, 2)) == 75
    assert capsys.readouterr().err.strip().splitlines()[-1] == "stopped: stop requested (SIGUSR1)"
    assert [r["candidate"] for r in csv_rows(out)] == ["0"]
    assert not (out / "run.lock").exists()  # the search's lock is given back
    monkeypatch.setattr(trainer, "run", real_run)
    assert train.main(["--resume", str(out)]) == 0
    assert [(r["candidate"], r["status"]) for r in csv_rows(out)] == [("0", "done"), ("1", "done")]


def test_a_ctrl_c_python_swallowed_still_stops_the_search(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    """Was: the search went on through every candidate left (1 of 3 Ctrl-Cs of a real search)."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    real_run = trainer.run

    def run(config, dist, signals=None):
        summary = real_run(config, dist, signals)
        InterruptsWhenDeleted()  # at the candidate's very end, after its last stop point
        return summary

    monkeypatch.setattr(trainer, "run", run)
    ignored = swallowed(monkeypatch)
    assert train.main(search_argv(data, out, 3)) == 130
    # Python swallowed it (inside a finaliser), unprinted (StopSignals.installed); the search
    # still stopped.
    assert ignored == []
    err = capsys.readouterr().err
    assert f"continue the search with: python train.py --resume {out}" in err
    assert [r["candidate"] for r in csv_rows(out)] == ["0"]  # candidate 1 never started
    assert not (out / "candidate-001").exists()


def test_a_continued_search_keeps_its_flags_redraws_its_files_and_bare_resume_finds_it(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    data = make_shapes_data(n_train=8, n_val=4)
    monkeypatch.chdir(tmp_path)  # bare --resume looks in ./runs
    out = tmp_path / "runs" / "search"
    assert train.main(search_argv(data, out, 1)) == 0
    written = (out / record.CSV_NAME).read_text()
    # Its candidates are compared by fitness: a flag that changes what they train is refused.
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--epochs", "2", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --resume") and "--epochs 2 (the search has 1)" in err
    assert "--batch-size 2 (the search has 4)" in err
    assert (out / record.CSV_NAME).read_text() == written
    # A stop between a row and its picture: the continued search draws it again. Bare
    # --resume finds the search when it was written after any run's last.pt.
    (out / record.PLOT_NAME).unlink()
    (out / record.BEST_HYP_NAME).unlink()
    assert train.main(["--resume"]) == 0
    assert "1 of 1 candidates done" in capsys.readouterr().err
    assert (out / record.PLOT_NAME).stat().st_size > 0 and (out / record.BEST_HYP_NAME).is_file()


def test_a_stop_in_a_candidates_first_epoch_starts_it_over(
    make_shapes_data, tmp_path, monkeypatch, capsys
) -> None:
    """Ctrl-C in a candidate's first epoch saves its part-trained weights as "epoch -1"; a
    candidate continued from them would not be the uninterrupted one, so it starts over (the
    partial start moved aside). The stop names the search to continue."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    real = trainer.train_one_epoch

    def interrupted(state, loader, epoch, opts):
        for _ in loader:  # a batch is loaded, then Ctrl-C
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_one_epoch", interrupted)
    assert train.main(search_argv(data, out, 1)) == 130
    assert f"continue the search with: python train.py --resume {out}" in capsys.readouterr().err
    assert load_checkpoint(out / "candidate-000" / "last.pt")["epoch"] == -1
    monkeypatch.setattr(trainer, "train_one_epoch", real)
    assert train.main(["--resume", str(out)]) == 0
    log = (out / "candidate-000" / "train.log").read_text()
    assert "resuming from" not in log
    # The partial start is kept aside, as --exist-ok keeps a run it replaces.
    assert [p.name for p in (out / "candidate-000").glob("replaced-*/last.pt")] == ["last.pt"]
    assert [r["status"] for r in csv_rows(out)] == ["done"]


def test_each_candidate_of_a_ddp_search_is_one_run_of_both_processes(
    make_shapes_data, tmp_path
) -> None:
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "search"
    argv = search_argv(data, out, 2, "--nproc-per-node", "2", "--seed", "5")
    proc = run_script("train_multi_GPU.py", [*argv, "--batch-size", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = record.read_rows(out / record.CSV_NAME, {k: HYP_SPECS[k].kind for k in HYP_SPECS})
    assert [(r.candidate, r.status) for r in rows] == [(0, "done"), (1, "done")]
    for r in rows:
        assert "device cpu x 2 process(es)" in (out / r.run / "train.log").read_text()
    # Rank 0 decided candidate 1 as the local backend would: a mutation of candidate 0 (the
    # only parent) drawn from the stream of (seed 5, candidate 1).
    base = load_hyp(REPO / "cfg/hyp.yaml")
    expected = space.next_candidate(base, [(base, rows[0].fitness)], SHIPPED_SPACE, 5, 1)
    assert rows[1].hyp == expected


def test_budget_is_shared_by_the_candidates_left(tmp_path) -> None:
    from train_utils.evolve.search import Search, _budget_share

    config = type("C", (), {"time_budget": 10.0, "hyp": {}})()
    search = Search(tmp_path, config, SHIPPED_SPACE, total=4, backend="local")
    assert _budget_share(search, 0) == pytest.approx(600 / 4)
    search.rows = [record.Row(0, record.DONE, {}, seconds=300.0)]
    assert _budget_share(search, 1) == pytest.approx(300 / 3)  # the rest, equally
    config.time_budget = None
    assert _budget_share(search, 1) is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--evolve", "0"], "--evolve takes a number of candidates >= 1, got 0"),
        (["--evolve", "2", "--recipe", "darknet"], "--recipe darknet takes its settings"),
        (["--evolve", "2", "--notest"], "drop --notest"),
        (["--evolve", "2", "--evolve-space", "missing.yaml"], "missing.yaml"),
        (["--evolve", "2", "--resume", "nowhere"], "nowhere is not a search folder"),
        (["--evolve-space", "cfg/evolve.yaml"], "--evolve-space applies only to a search"),
        (["--evolve-backend", "local"], "--evolve-backend applies only to a search"),
        (["--evolve", "2", "--address", "1.2.3.4:6379"], "--address are the Ray backend's"),
        (["--evolve", "2", "--trial-resources", "0", "1"], "--trial-resources takes CPUS > 0"),
    ],
)
def test_bad_evolve_flags_are_one_line_before_any_folder(
    shapes_data, tmp_path, capsys, extra, message
) -> None:
    out = tmp_path / "search"
    argv = train_argv(shapes_data, out, *extra)
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and len([ln for ln in err if ln.startswith("error")]) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "record_text, message",
    [
        ("just text\n", "not a search record of this version"),
        ("schema: 1\nevolve: 2\nargs: {}\nhyp: {}\n", "not a search record of this version"),
        ("schema: 1\nevolve: 2\nargs: ARGS\nhyp: {lr0: fast}\nspace: SPACE\n", "'lr0' must"),
        (
            "schema: 1\nevolve: 2\nargs: ARGS\nhyp: {}\nspace: {keys: {mosaic: [1, 0, 1]}}\n",
            "'mosaic' is not a searchable hyp key",
        ),
    ],
)
def test_an_edited_search_record_is_one_line(
    shapes_data, tmp_path, capsys, record_text, message
) -> None:
    folder = tmp_path / "search"
    folder.mkdir()
    args = {"data": str(shapes_data), "img_size": 64, "epochs": 1, "device": "cpu"}
    text = record_text.replace("ARGS", str(args)).replace("SPACE", str(SHIPPED_SPACE.to_dict()))
    (folder / SEARCH_RECORD).write_text(text)
    assert train.main(["--resume", str(folder)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("error: ") and message in line
    assert sorted(p.name for p in folder.iterdir()) == [SEARCH_RECORD]


def test_ray_backend_without_ray_is_one_line(shapes_data, tmp_path, capsys, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    argv = train_argv(shapes_data, tmp_path / "s", "--evolve", "2", "--evolve-backend", "ray")
    assert train.main(argv) == 2
    assert "pip install -r requirements-ray.txt" in capsys.readouterr().err
