"""train_utils/evolve/ray_backend.py without a cluster: a completed trial's row (done, stopped
early by ASHA, failed) and the time each trial may take under --time-budget."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest

from train_utils.evolve import record
from train_utils.evolve.search import Search
from train_utils.evolve.space import SearchSpace

pytest.importorskip("ray.tune", reason="needs Ray Tune (pip install -r requirements-ray.txt)")

from train_utils.evolve import ray_backend  # after the skip: it imports Ray

HEADER = "epoch,mAP50-95,mAP50,elapsed_seconds\n"


def search_with_epochs(tmp_path: Path, epochs: int) -> Search:
    config = types.SimpleNamespace(epochs=epochs, time_budget=None, hyp={"lr0": 0.01})
    return Search(tmp_path, config, SearchSpace({}), total=3, backend="ray")


def write_results(folder: Path, rows: list[tuple[int, float, float, float]]) -> None:
    folder.mkdir(parents=True)
    lines = [f"{e},{m},{m50},{s}\n" for e, m, m50, s in rows]
    (folder / "results.csv").write_text(HEADER + "".join(lines))


def test_a_trial_that_trained_every_epoch_is_done_one_asha_stopped_is_not(tmp_path) -> None:
    search = search_with_epochs(tmp_path, epochs=3)
    write_results(
        search.candidate_folder(0), [(0, 0.1, 0.2, 5.0), (1, 0.2, 0.4, 9.0), (2, 0.3, 0.5, 13.0)]
    )
    write_results(search.candidate_folder(1), [(0, 0.05, 0.1, 4.0)])
    done = ray_backend.trial_row(search, 0, {"lr0": 0.01}, {"finished": True}, error=False)
    assert (done.status, done.epochs, done.seconds) == (record.DONE, 3, 13.0)
    assert done.fitness == pytest.approx(0.1 * 0.5 + 0.9 * 0.3)
    stopped = ray_backend.trial_row(search, 1, {"lr0": 0.02}, {"finished": False}, error=False)
    assert stopped.status == "stopped early (ASHA, after epoch 1)"
    assert stopped.fitness == pytest.approx(0.1 * 0.1 + 0.9 * 0.05)
    # The best of the search is one trained to its end, never one ASHA stopped.
    assert record.best_row([stopped, done]) is done
    failed = ray_backend.trial_row(search, 2, {"lr0": 0.03}, {"error": "boom"}, error=True)
    assert (failed.status, failed.reason) == (record.FAILED, "boom") and math.isnan(failed.fitness)


def test_time_budget_per_trial_counts_the_trials_that_run_at_once(monkeypatch) -> None:
    monkeypatch.setattr(ray_backend.ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    # 8 CPUs, 2 per trial: 4 at once; one GPU per trial: 2; fewer candidates than slots: those.
    assert ray_backend.trials_at_once(2, 0, 10) == 4
    assert ray_backend.trials_at_once(1, 1, 10) == 2
    assert ray_backend.trials_at_once(1, 0, 3) == 3
    assert ray_backend.trials_at_once(16, 0, 3) == 1  # a trial larger than the cluster: one
    assert ray_backend._budget_share(None, 10, 4) is None
    # 10 candidates, 4 at a time, in 60 minutes: each 60 * 4 / 10 minutes.
    assert ray_backend._budget_share(60, 10, 4) == pytest.approx(60 * 60 * 4 / 10)
