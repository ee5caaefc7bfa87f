"""Experiment trackers (train_utils/trackers, the reporter's results.csv and TensorBoard) and the
per-epoch split of training time into data wait and compute (engine._WaitClock)."""

from __future__ import annotations

import ast
import csv
import importlib.util
import json
import logging
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import NANO_CFG, REPO_ROOT, read_results, run_training, script_env, train_argv

import train as train_script
from build_utils.errors import ConfigError, OutputError
from models.darknet import Darknet
from models.loss import scale_loss_gains
from train_utils import trainer as trainer_module
from train_utils.config import load_hyp
from train_utils.engine import EpochStats, TrainOptions, TrainState, train_one_epoch
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.optim import build_optimizer, build_scheduler
from train_utils.reporting import (
    DATA_WAIT_WARN_SHARE,
    RESULTS_HEADER,
    TIMING_COLUMNS,
    EpochReporter,
    SilentReporter,
    make_reporter,
)
from train_utils.stop_signals import StopPoints
from train_utils.trackers import (
    FINISHED,
    KILLED,
    RECORD_NAME,
    GuardedTracker,
    Tracker,
    check_trackers,
)

SIDE = 64
SLEEP_S = 0.25  # each batch of the slow loader takes this long to arrive
STARVED_S = 2.0  # a training step of the nano model at 64 px takes a fraction of it
NEW_COLUMNS = ("data_wait_s", "compute_s", "data_wait_share")  # not in older results.csv files


def _val(x: float = 0.25) -> dict[str, float]:
    return {name: x for name in STAT_NAMES}


def _stats(wait: float) -> EpochStats:
    return EpochStats(1.0, 2.0, 3.0, 6.0, lr=0.01, images=8, data_wait_s=wait)


# ---------------------------------------------------------------- data wait vs compute


class _SlowLoader:
    """Batches that take :data:`SLEEP_S` each to arrive, as a starved data pipeline's."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.batches = [
            (
                torch.randint(0, 256, (2, 3, SIDE, SIDE), dtype=torch.uint8, generator=g),
                torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4], [1, 2, 0.4, 0.6, 0.2, 0.2]]),
                ["a.jpg", "b.jpg"],
                None,
                None,
            )
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            time.sleep(SLEEP_S)
            yield b


def _slow_epoch(device: torch.device) -> tuple[float, float]:
    """One epoch of 3 batches from :class:`_SlowLoader` on ``device``: (its data wait, its
    wall time)."""
    hyp = scale_loss_gains(load_hyp(REPO_ROOT / "cfg" / "hyp.yaml"), 80, SIDE)
    torch.manual_seed(0)
    model = Darknet(NANO_CFG, img_size=SIDE).to(device)
    optimizer = build_optimizer(model, hyp, 0.01)
    state = TrainState(model, model, optimizer, build_scheduler(optimizer, 1, hyp["lrf"]))
    t0 = time.perf_counter()
    stats = train_one_epoch(state, _SlowLoader(3), 0, TrainOptions(device, hyp))
    return stats.data_wait_s, time.perf_counter() - t0


def test_epoch_wait_includes_the_loaders_sleep(single_thread):
    wait, total = _slow_epoch(torch.device("cpu"))
    assert 3 * SLEEP_S <= wait < 3 * SLEEP_S + 0.2
    assert wait < total  # the steps themselves are compute


@pytest.mark.cuda
def test_epoch_wait_on_cuda_is_the_gpus_idle_time():
    """On CUDA the wait is read from timing events: the GPU idles while the loader sleeps
    (its own work takes milliseconds), so the wait is nearly the sleep, never more than it."""
    wait, total = _slow_epoch(torch.device("cuda"))
    assert 0.9 * 3 * SLEEP_S <= wait < 3 * SLEEP_S + 0.2
    assert wait < total


def test_reporter_splits_the_epoch_and_warns_once(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = EpochReporter(tmp_path, 0, workers=2)
    with caplog.at_level(logging.INFO, logger="train_utils.reporting"):
        reporter.end_epoch(0, 3, _stats(3.0), _val(), 4.0, 5.0)
        reporter.end_epoch(1, 3, _stats(0.5), None, 4.0, 9.0)  # not evaluated: no row
        reporter.end_epoch(2, 3, _stats(3.9), _val(), 4.0, 14.0)
    reporter.close()
    rows = read_results(tmp_path / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "2"]
    assert (rows[0]["data_wait_s"], rows[0]["compute_s"], rows[0]["data_wait_share"]) == (
        "3.0",
        "1.0",
        "0.75",
    )
    assert float(rows[1]["data_wait_share"]) == pytest.approx(3.9 / 4.0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("epoch 0/2" in m and "data wait 3.0 s (75%)" in m for m in messages)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and DATA_WAIT_WARN_SHARE < 0.75  # once per run
    for knob in ("--workers (now 2)", "--cache-images", "--img-size", "mosaic"):
        assert knob in warnings[0], knob
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    share = [(e.step, e.value) for e in events.Scalars("time/data_wait_share")]
    assert share == [(0, 0.75), (1, 0.125), (2, pytest.approx(0.975))]
    assert [e.step for e in events.Scalars("val/mAP50")] == [0, 2]
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2]


def test_resume_keeps_an_old_results_csv_and_upgrades_its_header(tmp_path):
    """A run folder written before the data-wait columns existed: its rows stay, the header
    gains the new columns (empty in the old rows), new rows fill them."""
    old_header = [c for c in RESULTS_HEADER if c not in NEW_COLUMNS]
    with (tmp_path / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_header)
        w.writeheader()
        for epoch in range(3):  # epoch 2 is after last.pt's: redone, its row dropped
            w.writerow({k: 0.5 for k in old_header} | {"epoch": epoch})
    reporter = EpochReporter(tmp_path, start_epoch=2)
    reporter.end_epoch(2, 3, _stats(1.0), _val(), 4.0, 20.0)
    reporter.close()
    with (tmp_path / "results.csv").open() as f:
        assert f.readline().strip() == ",".join(RESULTS_HEADER)
    rows = read_results(tmp_path / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["loss"] == "0.5" and rows[0]["data_wait_s"] == ""
    assert rows[2]["data_wait_s"] == "1.0" and rows[2]["loss"] == "6.0"
    assert (tmp_path / "results.png").is_file()  # plots the old rows too


# ---------------------------------------------------------------- choosing trackers


def test_tracker_not_installed_is_one_line(make_shapes_data, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    data = make_shapes_data(n_train=2, n_val=1)
    code = train_script.main(train_argv(data, tmp_path / "run", "--tracker", "mlflow"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: --tracker mlflow needs the mlflow-skinny package")
    assert "requirements-trackers.txt" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "run").exists()  # refused before a run folder was claimed


def test_check_trackers():
    assert check_trackers(["mlflow", "mlflow"]) == ["mlflow"]
    assert check_trackers(["none"]) == [] == check_trackers(None)
    with pytest.raises(ConfigError, match="--tracker none cannot be combined with none, mlflow"):
        check_trackers(["none", "mlflow"])
    with pytest.raises(ConfigError, match="--tracker 'comet' is not one of"):
        check_trackers(["comet"])  # e.g. from an edited checkpoint's run


def test_no_tracker_package_is_imported_without_tracker():
    """MLflow and W&B are imported by their tracker modules only, and those only by
    ``open_trackers`` (importlib, when asked for): a run without ``--tracker`` pays nothing."""
    tracker_modules = {"mlflow_tracker.py", "wandb_tracker.py"}
    heavy = ("mlflow", "wandb", "train_utils.trackers.mlflow_tracker", "train_utils.trackers.wandb")
    files = [*REPO_ROOT.glob("*.py")]
    for package in ("build_utils", "models", "train_utils", "tools"):
        files += (REPO_ROOT / package).rglob("*.py")
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            if any(n.startswith(heavy) for n in names) and path.name not in tracker_modules:
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert offenders == []


def test_other_ranks_start_no_tracker(tmp_path):
    reporter = make_reporter(False, tmp_path / "run", 0, trackers=["mlflow", "wandb"])
    assert isinstance(reporter, SilentReporter)
    assert list(tmp_path.iterdir()) == []  # no store, no record, no run folder files


def test_other_ranks_word_an_interruption_as_rank_0_does(tmp_path, caplog):
    """Was: "interrupted in iteration 60" beside rank 0's "interrupted after iteration 60,
    which is complete and saved"."""
    reporter = make_reporter(False, tmp_path / "run", 0, unit="iteration")
    reporter.interrupted(60, completed=True)
    reporter.interrupted(61)
    assert caplog.messages == ["interrupted after iteration 60", "interrupted in iteration 61"]


class _Failing(Tracker):
    name = "flaky"

    def __init__(self):
        self.calls = 0

    def log_epoch(self, epoch, metrics):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def finish(self, status):
        self.status = status


def test_a_failing_tracker_is_one_warning_and_the_run_goes_on(tmp_path, caplog):
    reporter = EpochReporter(tmp_path, 0)
    flaky = _Failing()
    reporter.external = [GuardedTracker(flaky)]
    reporter.trackers += reporter.external
    with caplog.at_level(logging.WARNING):
        for epoch in range(3):
            reporter.end_epoch(epoch, 3, _stats(0.0), _val(), 1.0, 1.0)
        reporter.interrupted(2)
    reporter.close()
    assert flaky.calls == 1  # dropped after its first failure
    warnings = [r.getMessage() for r in caplog.records if "flaky" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    assert [r["epoch"] for r in read_results(tmp_path / "results.csv")] == ["0", "1", "2"]
    assert reporter.status == KILLED
    assert flaky.status == KILLED  # its run is still ended (an MLflow run would stay RUNNING)


def test_a_tracker_that_cannot_start_stops_before_training(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    (tmp_path / "file").write_text("a file where the store's folder should be")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/file/mlflow.db")
    (tmp_path / "run").mkdir()
    with pytest.raises(OutputError, match="--tracker mlflow could not start .*--tracker none"):
        EpochReporter(tmp_path / "run", 0, trackers=["mlflow"], experiment="x")
    assert not (tmp_path / "run" / RECORD_NAME).exists()


def test_a_tracker_error_of_several_lines_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from train_utils.trackers import mlflow_tracker

    def fail(self, params, resume_id):
        raise RuntimeError("(sqlite3.OperationalError) duplicate column name: step\n(Background)")

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(mlflow_tracker.MlflowTracker, "start", fail)
    (tmp_path / "run").mkdir()
    with pytest.raises(OutputError) as raised:
        EpochReporter(tmp_path / "run", 0, trackers=["mlflow"], experiment="x")
    message = str(raised.value)
    assert "\n" not in message
    assert (
        "(RuntimeError: (sqlite3.OperationalError) duplicate column name: step (Background))"
        in message
    )


def test_resuming_a_run_missing_from_the_mlflow_store_says_so(tmp_path, monkeypatch, caplog):
    """The store was deleted (or MLFLOW_TRACKING_URI changed) since the run recorded its MLflow
    run: the resumed run starts a new MLflow run, with a warning naming the old one."""
    pytest.importorskip("mlflow")
    from train_utils.trackers.mlflow_tracker import MlflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "exp").mkdir()
    tracker = MlflowTracker(tmp_path / "exp", "shapes")
    with caplog.at_level(logging.WARNING):
        new_id = tracker.start({"epochs": 2}, "0123456789abcdef0123456789abcdef")
    tracker.finish(FINISHED)
    assert new_id and new_id != "0123456789abcdef0123456789abcdef"
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "run 0123456789abcdef0123456789abcdef" in line and "new MLflow run" in line
    assert str(tmp_path / "mlflow.db") in line


def _start_mlflow_run(out: Path, barrier, failures, uri: str | None = None) -> None:
    """A forked child: start an MLflow run for ``out`` at the same moment as its siblings."""
    from train_utils.trackers.mlflow_tracker import MlflowTracker

    if uri is not None:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    out.mkdir(parents=True)
    barrier.wait()
    try:
        tracker = MlflowTracker(out, "shapes")
        tracker.start({"name": out.name}, None)
        tracker.finish(FINISHED)
    except Exception as e:
        failures.put(f"{type(e).__name__}: {e}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("named", [False, True], ids=["own-store", "MLFLOW_TRACKING_URI-sqlite"])
def test_runs_started_together_share_a_new_mlflow_store(tmp_path, monkeypatch, named):
    """Runs of one project started at once (a sweep) on a project with no mlflow.db yet: each
    gets its run in the one store and the one experiment; without the store lock both created
    MLflow's tables and one stopped with a two-line SQLAlchemy error."""
    pytest.importorskip("mlflow")
    import multiprocessing

    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    ctx = multiprocessing.get_context("fork")  # mlflow is imported once, here
    n = 3
    barrier, failures = ctx.Barrier(n), ctx.Queue()
    runs = [tmp_path / "runs" / f"exp{i}" for i in range(n)]
    store = tmp_path / "runs" / "mlflow.db"
    uri = f"sqlite:///{store}" if named else None
    procs = [ctx.Process(target=_start_mlflow_run, args=(r, barrier, failures, uri)) for r in runs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    errors = [failures.get() for _ in range(failures.qsize())]
    assert [p.exitcode for p in procs] == [0] * n, errors
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "shapes"]
    found = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in found) == ["exp0", "exp1", "exp2"]
    assert {r.info.status for r in found} == {FINISHED}
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "exp0",
        "exp1",
        "exp2",
        "mlflow.db",
    ]  # the lock leaves no file behind


# ---------------------------------------------------------------- MLflow and W&B, for real


def _flags(data: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(data, out, *extra, epochs=2, img=SIDE, nbs=4, plots=True)


def _interrupt_epoch_1(monkeypatch):
    real = trainer_module.train_one_epoch

    def interrupt(*args, **kwargs):
        if args[2] == 1:  # the epoch argument
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_one_epoch", interrupt)
    return real


@pytest.mark.slow
def test_mlflow_records_params_metrics_and_artifacts_across_a_resume(
    make_shapes_data, tmp_path, monkeypatch
):
    """Epoch 0, Ctrl-C in epoch 1, --resume: one MLflow run in the sqlite store beside the run
    folder holds the run's params, every results.csv column per epoch with results.csv's
    values, the pictures and best.pt; it ends FINISHED."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    data = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 96))
    out = tmp_path / "runs" / "exp"
    real = _interrupt_epoch_1(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_training(_flags(data, out, "--tracker", "mlflow"))
    monkeypatch.setattr(trainer_module, "train_one_epoch", real)
    run_training(_flags(data, out, "--tracker", "mlflow", "--resume"))

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(data.stem)
    (run,) = client.search_runs([experiment.experiment_id])
    assert json.loads((out / RECORD_NAME).read_text()) == {"mlflow": run.info.run_id}
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["batch_size"] == "4" and params["img_size"] == str(SIDE)
    assert float(params["hyp.lr0"]) == load_hyp(REPO_ROOT / "cfg" / "hyp.yaml")["lr0"]
    assert params["data.path"] == str(data) and params["tracker"] == "['mlflow']"

    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert all(0 <= float(r["data_wait_share"]) <= 1 for r in rows)
    for column in RESULTS_HEADER[1:]:
        history = client.get_metric_history(run.info.run_id, column)
        assert [(m.step, m.value) for m in history] == [
            (int(r["epoch"]), float(r[column])) for r in rows
        ], column

    def listed(path: str) -> set[str]:
        return {a.path for a in client.list_artifacts(run.info.run_id, path)}

    assert {"pictures/results.png", "pictures/labels.png", "pictures/PR_curve.png"} <= listed(
        "pictures"
    )
    assert {"run/results.csv", "run/args.yaml", "run/model.cfg"} <= listed("run")
    assert listed("weights") == {"weights/best.pt"}
    local = Path(client.download_artifacts(run.info.run_id, "weights/best.pt", str(tmp_path)))
    assert local.read_bytes() == (out / "best.pt").read_bytes()
    assert (tmp_path / "runs" / "mlartifacts").is_dir()  # beside the run folder, not in ./


def _wandb_records(path: Path) -> list:
    """The records of an offline run's ``.wandb`` file: W&B's protobuf ``Record`` messages in
    LevelDB log framing (a 7-byte file header, 32 KiB blocks, each chunk with a 7-byte header:
    crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


@pytest.mark.slow
def test_wandb_offline_records_params_and_metrics(make_shapes_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))  # artifacts staged here, not ~/
    data = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 96))
    out = tmp_path / "run"
    run_training(_flags(data, out, "--tracker", "wandb"))

    run_id = json.loads((out / RECORD_NAME).read_text())["wandb"]
    (path,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.project == data.stem and run.display_name == "run"
    assert config["batch_size"] == 4 and config["data"]["path"] == str(data)
    history: dict[int, dict[str, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.nested_key[0]: json.loads(i.value_json) for i in r.history.item}
            history.setdefault(items["_step"], {}).update(items)
    for row in read_results(out / "results.csv"):
        logged = history[int(row["epoch"])]
        for column in RESULTS_HEADER[1:]:
            assert logged[column] == pytest.approx(float(row[column]), rel=1e-12), column
    assert any(k.startswith("pictures/") for k in history[1])
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [(a.type, [c.path for c in a.manifest.contents]) for a in artifacts] == [
        ("model", ["best.pt"])
    ]
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]


def test_timing_columns_are_the_ones_results_csv_has():
    assert set(TIMING_COLUMNS) <= set(RESULTS_HEADER)


@pytest.mark.slow
def test_a_run_from_before_trackers_resumes_with_its_old_results_csv(
    make_shapes_data, tmp_path, monkeypatch
):
    """A checkpoint whose run arguments have no ``tracker`` and a results.csv without the
    data-wait columns, as an older version left them: ``--resume PATH`` alone continues it with
    no tracker, keeps the old row and upgrades the header. Its epoch, fed by a loader that
    sleeps, records the wait and warns with the knobs."""
    monkeypatch.chdir(tmp_path)
    data = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 96))
    out = tmp_path / "runs" / "old"
    assert train_script.main(train_argv(data, out, epochs=1, img=SIDE, nbs=4)) == 0
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    del ckpt["config"]["tracker"]
    ckpt["config"]["epochs"] = 2
    torch.save(ckpt, out / "last.pt")
    (row,) = read_results(out / "results.csv")
    old_header = [c for c in RESULTS_HEADER if c not in NEW_COLUMNS]
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_header, extrasaction="ignore")
        w.writeheader()
        w.writerow(row)

    real_iter = StopPoints.__iter__

    def slow_iter(self):  # the resumed epoch's loader starves the model
        for batch in real_iter(self):
            time.sleep(STARVED_S)
            yield batch

    monkeypatch.setattr(StopPoints, "__iter__", slow_iter)
    assert train_script.main(["--resume", str(out / "last.pt")]) == 0
    with (out / "results.csv").open() as f:
        assert f.readline().strip() == ",".join(RESULTS_HEADER)
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert rows[0]["loss"] == row["loss"] and rows[0]["data_wait_s"] == ""
    assert float(rows[1]["train_seconds"]) == pytest.approx(
        float(rows[1]["data_wait_s"]) + float(rows[1]["compute_s"]), abs=2e-3
    )
    assert float(rows[1]["data_wait_s"]) >= STARVED_S  # one batch per epoch here
    assert float(rows[1]["data_wait_share"]) > DATA_WAIT_WARN_SHARE
    log = (out / "train.log").read_text()
    assert "epoch 1 waited for data" in log and "more --workers (now 0)" in log
    resumed = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    assert resumed["epoch"] == 1 and resumed["config"]["tracker"] == []
    assert not (out / RECORD_NAME).exists() and not (out / "wandb").exists()


@pytest.mark.slow
def test_under_ddp_only_rank_0_records(make_shapes_data, tmp_path):
    """Two gloo processes with both trackers: one MLflow run with one value per epoch and
    metric, one W&B run: the other rank records nothing."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    data = make_shapes_data(n_train=8, n_val=2, img_size_range=(64, 96))
    out = tmp_path / "runs" / "ddp"
    env = {k: v for k, v in script_env().items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update({f"WANDB_{d}_DIR": str(tmp_path / d) for d in ("DATA", "CACHE", "CONFIG")})
    argv = _flags(data, out, "--tracker", "mlflow", "wandb", "--nproc-per-node", "2")
    cmd = [sys.executable, str(REPO_ROOT / "train_multi_GPU.py"), *argv]
    proc = warm_python.run(cmd, cwd=REPO_ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(data.stem).experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [0, 1]
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


def test_darknet_rounds_are_iterations_and_have_no_loss_parts(tmp_path, caplog):
    """Was (--recipe darknet): 'loss 17.37 (box nan obj nan cls nan)', NaN in results.csv, and
    Ctrl-C said 'interrupted after epoch 8' of iteration 8."""
    reporter = EpochReporter(tmp_path, 0, plots=False, unit="iteration")
    nan = float("nan")
    stats = EpochStats(nan, nan, nan, 17.5, lr=0.01, images=8, data_wait_s=0.0)
    with caplog.at_level(logging.INFO):
        reporter.end_epoch(7, 24, stats, _val(), 1.0, 1.0)
        (tmp_path / "last.pt").write_bytes(b"saved")
        reporter.interrupted(8, completed=True)
        reporter.interrupted(9)
        # Was: 'interrupted after iteration 0, which is complete and saved' when Ctrl-C came
        # before the first round ended and the start's part-trained weights were saved.
        reporter.interrupted(0, unfinished_saved=True, completed=True)
    reporter.close()
    [row] = read_results(tmp_path / "results.csv")
    assert (row["box_loss"], row["obj_loss"], row["cls_loss"], row["loss"]) == ("", "", "", "17.5")
    text = caplog.text
    assert "loss 17.5000, lr" in text and "nan" not in text.lower()
    assert f"interrupted after iteration 8, which is complete and saved in {tmp_path}" in text
    assert "interrupted in iteration 9; the last round is in" in text
    assert (
        "interrupted before the first round of iterations (--eval-iterations) completed; its "
        f"part-trained weights are saved in {tmp_path / 'last.pt'}; continue with --resume "
        f"{tmp_path / 'last.pt'} (that round is trained again from them)"
    ) in text
    assert "after iteration 0" not in text
    assert "epoch" not in "".join(
        r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()
    )
