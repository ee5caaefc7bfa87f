"""``--evolve-backend ray``: the same search with its candidates as Ray Tune trials.

Ray Tune runs the trials (each on the CPUs/GPUs ``--trial-resources`` asks for, as many at once
as the cluster holds), retries one whose process died, and stops the unpromising ones early with
ASHA, which compares the candidates' fitness after each epoch. The search itself stays ours:
:class:`EvolutionSearcher` makes each candidate with the same mutation as the local backend
(from the candidates scored when it is asked) and writes the same ``evolve.csv``; each trial
trains the same run folder (``candidate-NNN``) with the same :func:`train_utils.trainer.run`.

Continuing a search whose driver was killed needs only the search folder, as locally: rows are
done; a candidate folder with a ``last.pt`` continues with the hyp it started with; Ray's own
experiment state is not used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import Searcher

from build_utils.errors import ConfigError
from train_utils import trainer
from train_utils.config import REPO_ROOT
from train_utils.distributed.devices import select_device
from train_utils.distributed.process_group import DistInfo
from train_utils.evolve import record
from train_utils.evolve.record import Row
from train_utils.evolve.search import (
    Search,
    candidate_config,
    epoch_metrics,
    evaluated_epochs,
    log_row,
    scored_row,
)
from train_utils.evolve.space import fitness

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a trial looks for a new epoch in its results.csv
MAX_TRIAL_RETRIES = 2  # a trial whose process dies is started again (continuing its last.pt)


class EvolutionSearcher(Searcher):
    """Ray Tune's search algorithm, made from ours: each suggestion is the next candidate
    number with its hyp; each completed trial (finished, stopped early by ASHA, or failed) is a
    row of the search, written at once (this runs in the driver, beside the search's files)."""

    def __init__(self, search: Search) -> None:
        super().__init__(metric="fitness", mode="max")
        self.search = search
        done = {r.candidate for r in search.rows}
        self.todo = [i for i in range(search.total) if i not in done]
        self.trials: dict[str, tuple[int, dict[str, Any]]] = {}

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if not self.todo:
            return Searcher.FINISHED
        index = self.todo.pop(0)
        hyp = self.search.hyp_of(index)
        self.trials[trial_id] = (index, hyp)
        return {"candidate": index, "hyp": hyp}

    def on_trial_complete(
        self, trial_id: str, result: dict | None = None, error: bool = False
    ) -> None:
        index, hyp = self.trials.pop(trial_id)
        row = trial_row(self.search, index, hyp, result, error)
        self.search.add(row)
        log_row(self.search, row)


def trial_row(
    search: Search, index: int, hyp: Mapping[str, Any], result: Mapping | None, error: bool
) -> Row:
    """The row of a completed trial: scored from its results.csv when it trained all its
    epochs, its last reported fitness when ASHA stopped it, its error when it failed."""
    folder = search.candidate_folder(index)
    if error:
        reason = (result or {}).get("error") or "the trial failed (see its train.log)"
        return Row(index, record.FAILED, dict(hyp), run=folder.name, reason=str(reason))
    row = scored_row(index, hyp, folder)
    planned = search.config.epochs if search.config.time_budget is None else None
    finished = row.epochs >= planned if planned else bool(result and result.get("finished"))
    if not finished and not math.isnan(row.fitness):
        row.status = f"{record.STOPPED_EARLY} (ASHA, after epoch {row.epochs})"
    return row


def run_trial(params: dict[str, Any], search: Search, share_s: float | None) -> None:
    """One trial, in a Ray worker: train candidate ``params['candidate']`` and report the
    fitness of each evaluated epoch as it appears in its results.csv (ASHA's input); the last
    report says ``finished`` when the candidate trained to its end."""
    index, hyp = params["candidate"], params["hyp"]
    config = candidate_config(search, index, hyp, share_s)
    dist = DistInfo.single(select_device("0" if ray.get_gpu_ids() else "cpu"))
    failure: list[BaseException] = []

    def train() -> None:
        try:
            trainer.run(config, dist)
        except BaseException as e:  # raised by the trial, below, for Ray to record
            failure.append(e)

    worker = threading.Thread(target=train, name=f"candidate-{index:03d}")
    worker.start()
    reported = 0
    while worker.is_alive():
        worker.join(POLL_S)
        evaluated = evaluated_epochs(config.output_dir)
        for row in evaluated[reported:]:
            tune.report(_report(row, finished=False))
        reported = len(evaluated)
    if failure:
        raise failure[0]
    evaluated = evaluated_epochs(config.output_dir)
    if not evaluated:
        raise RuntimeError("the candidate finished without an evaluated epoch")
    # The last epoch again, now known to be the last (ASHA keeps the higher-epoch record).
    tune.report(_report(evaluated[-1], finished=True))


def _report(row: Mapping[str, str], finished: bool) -> dict[str, Any]:
    fit = fitness(epoch_metrics(row))
    return {"fitness": fit, "epoch": int(row["epoch"]) + 1, "finished": finished}


def search_with_ray(search: Search) -> None:
    """Run the search's missing candidates as Ray Tune trials on the cluster at
    ``search.address`` (None: a Ray of this machine alone)."""
    address, resources = search.address, search.trial_resources
    todo = search.total - len({r.candidate for r in search.rows})
    if todo <= 0:
        return
    search.folder = search.folder.resolve()
    search.config = _absolute_paths(search.config)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # relative paths stay the driver's
    try:
        ray.init(
            address=address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=False,  # each candidate's output is in its train.log
            runtime_env={"env_vars": env},
        )
    except Exception as e:  # Ray's own: a cluster that is not there, a node that did not start
        where = f"the Ray cluster at {address}" if address else "a Ray of this machine"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        with contextlib.suppress(Exception):  # whatever part of it did start
            ray.shutdown()
        raise ConfigError(
            f"--evolve-backend ray: {where} did not start or answer ({first}); nothing was "
            "trained (--resume continues the search once it does)"
        ) from None
    try:
        cpus, gpus = resources or (1.0, 1.0 if ray.cluster_resources().get("GPU") else 0.0)
        at_once = trials_at_once(cpus, gpus, todo)
        share = _budget_share(search.config.time_budget, todo, at_once)
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, search=search, share_s=share),
            {"cpu": cpus, "gpu": gpus},
        )
        epochs = search.config.epochs or 1
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(
                search_alg=EvolutionSearcher(search),
                scheduler=ASHAScheduler(
                    time_attr="epoch", metric="fitness", mode="max", max_t=epochs, grace_period=1
                ),
                num_samples=todo,
            ),
            run_config=tune.RunConfig(
                name="ray",
                storage_path=str(search.folder),
                failure_config=tune.FailureConfig(max_failures=MAX_TRIAL_RETRIES),
                verbose=0,
            ),
        )
        logger.info(
            "--evolve-backend ray: %d candidates on %s, %g CPU and %g GPU each, up to %d at once",
            todo,
            address or "a Ray of this machine",
            cpus,
            gpus,
            at_once,
        )
        tuner.fit()
    finally:
        ray.shutdown()


def trials_at_once(cpus: float, gpus: float, todo: int) -> int:
    """How many trials of ``cpus`` CPUs and ``gpus`` GPUs the cluster runs at once (at most
    ``todo``, at least 1)."""
    total = ray.cluster_resources()
    slots = total.get("CPU", 1) // cpus
    if gpus > 0:
        slots = min(slots, total.get("GPU", 0) // gpus)
    return max(1, min(int(slots), todo))


def _budget_share(minutes: float | None, todo: int, at_once: int) -> float | None:
    """Seconds each trial may train so that ``todo`` candidates, ``at_once`` at a time, fit
    ``--time-budget`` (None without one)."""
    return None if minutes is None else minutes * 60 * at_once / todo


def _absolute_paths(config: Any) -> Any:
    """The settings with the files they name as absolute paths: a trial may run in another
    working folder (another machine: the same paths must exist there)."""
    return dataclasses.replace(
        config,
        cfg=Path(config.cfg).resolve(),
        weights=str(Path(config.weights).resolve()) if config.weights else config.weights,
        output_dir=Path(config.output_dir).resolve(),
    )
