"""``train.py --evolve N``: YOLOv5's hyperparameter evolution, each candidate a normal run.

The search owns a run folder (locked, numbered as runs are; default ``runs/evolve``) holding
``search.yaml`` (what it searches: the flags, the base hyp, the space, the seed), ``evolve.csv``
(one row per finished candidate), ``hyp_evolve.yaml``, ``evolve.png``, ``evolve.log`` and one
run folder per candidate, ``candidate-000``, ``candidate-001``, ... trained by the same
:func:`train_utils.trainer.run` as any run.

Continuing (``--resume <search folder>``) needs nothing but those files: a candidate with a row
is done; one whose folder holds a ``last.pt`` continues from it as ``--resume`` would; the others
train from the start. Candidate ``i``'s hyp depends only on the seed, ``i`` and the rows before
it (:func:`~train_utils.evolve.space.next_candidate`), so the continued search trains the
candidates an uninterrupted one would have.

Under DDP (``train_multi_GPU.py --evolve``) every rank runs each candidate; rank 0 decides the
candidate and writes the search's files, and sends the decision to the others (marked
``# Collective:``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build_utils.atomic import write_text
from build_utils.checks import is_int
from build_utils.errors import ConfigError, OutputError, RunStopped, YoloError
from build_utils.safe_yaml import dump_yaml, load_yaml
from train_utils import trainer
from train_utils.checkpoint import load_checkpoint, to_plain
from train_utils.cli import take_from_run
from train_utils.config import (
    HYP_SPECS,
    TrainConfig,
    build_config,
    check_hyp_value,
    get_args_parser,
    load_hyp,
    repo_default,
    run_folder_of,
)
from train_utils.distributed.comm import broadcast_object, raise_if_any_rank_failed
from train_utils.distributed.devices import select_device
from train_utils.distributed.process_group import DistInfo
from train_utils.evolve import record
from train_utils.evolve.record import Row
from train_utils.evolve.space import DEFAULT_SPACE, SearchSpace, fitness, load_space, next_candidate
from train_utils.reporting import logging_to, read_results, run_log_handler
from train_utils.resume import latest_run_checkpoint
from train_utils.run_folder import RUNS_DIR, SEARCH_RECORD, RunFolder, claim_run_folder
from train_utils.stop_signals import StopSignals

logger = logging.getLogger(__name__)

DEFAULT_NAME = "evolve"  # runs/evolve, runs/evolve2, ... (YOLOv5: runs/evolve/exp)
SCHEMA = 1
# The flags of a search alone (without one they would do nothing).
SEARCH_FLAGS = ("evolve_space", "evolve_backend", "address", "trial_resources")
# What a continued search may be given anew: where and how long it runs, how it is reported.
RESUME_MAY_CHANGE = frozenset(
    {"time_budget", "device", "workers", "tracker", "log_interval", "trial_resources"}
)
# Flags that belong to this invocation, not to the search a --resume continues (a requeued
# job's Ray head has another --address).
OWN_FLAGS = frozenset(
    {"resume", "exist_ok", "output_dir", "project", "name", "given", "local_rank", "evolve"}
    | {"address"}
)
RAY_REQUIREMENTS = "requirements-ray.txt"
MIN_SHARE_S = 1.0  # a candidate's share of --time-budget below this: the search stops


@dataclass
class Search:
    """A search as this process runs it (the files live on rank 0)."""

    folder: Path
    config: TrainConfig  # the candidates' common settings; hyp is the base hyp
    space: SearchSpace
    total: int  # candidates to train
    backend: str
    rows: list[Row] = field(default_factory=list)
    record_text: str | None = None  # search.yaml of a new search; None when continued
    address: str | None = None  # --address: the Ray cluster (ray backend)
    trial_resources: list[float] | None = None  # --trial-resources: CPUs, GPUs per candidate

    @property
    def hyp_keys(self) -> list[str]:
        return list(self.config.hyp)

    def candidate_folder(self, index: int) -> Path:
        return self.folder / f"candidate-{index:03d}"

    def scored(self, before: int) -> list[tuple[Mapping[str, Any], float]]:
        """(hyp, fitness) of the candidates before ``before``, in order (failed: NaN)."""
        return [
            (r.hyp, r.fitness)
            for r in sorted(self.rows, key=lambda r: r.candidate)
            if r.candidate < before
        ]

    def hyp_of(self, index: int) -> dict[str, Any]:
        """Candidate ``index``'s hyp: the one it started with when an earlier attempt saved a
        ``last.pt`` (its run's hyp.yaml: it continues with it), else a new one."""
        folder = self.candidate_folder(index)
        if (folder / "last.pt").is_file() and (folder / "hyp.yaml").is_file():
            return load_hyp(folder / "hyp.yaml")
        return next_candidate(
            self.config.hyp, self.scored(index), self.space, self.config.seed, index
        )

    def add(self, row: Row) -> None:
        """Record ``row`` in every file of the search (rank 0)."""
        self.rows = [r for r in self.rows if r.candidate != row.candidate] + [row]
        record.write_rows(self.folder / record.CSV_NAME, self.rows, self.hyp_keys)
        self.write_summaries()

    def write_summaries(self) -> None:
        """hyp_evolve.yaml and evolve.png from the rows (rank 0). Also at the end of a
        continued search: a stop between a row and its picture left them a row behind."""
        best = record.best_row(self.rows)
        if best is not None:
            record.write_best_hyp(self.folder / record.BEST_HYP_NAME, best, self.folder)
            record.plot_search(self.folder / record.PLOT_NAME, self.rows, self.space)


def is_search(args: argparse.Namespace) -> bool:
    """Whether ``args`` start or continue a search.

    Raises:
        ConfigError: a search's own flag given to a run that is not one (it would do nothing).
    """
    if args.evolve is not None or _resumed_search_folder(args) is not None:
        return True
    typed = [flag for flag in SEARCH_FLAGS if flag in getattr(args, "given", ())]
    if typed:
        raise ConfigError(
            f"{_flag_names(typed)} {'applies' if len(typed) == 1 else 'apply'} only to a "
            f"search: add --evolve N (or --resume a "
            f"search's folder)"
        )
    return False


def _flag_names(dests: list[str]) -> str:
    return " and ".join(f"--{d.replace('_', '-')}" for d in dests)


def _resumed_search_folder(args: argparse.Namespace) -> Path | None:
    """The search folder ``--resume`` names (PATH, a file in it, or --name/--output-dir), if it
    is one."""
    if args.resume is None:
        return None
    if args.resume == "auto":
        if not (args.name or args.output_dir or getattr(args, "project", "")):
            return _newest_search(RUNS_DIR)
        path = run_folder_of(args)[0]
    else:
        path = Path(args.resume)
        path = path if path.is_dir() else path.parent
    return path if (path / SEARCH_RECORD).is_file() else None


def _newest_search(runs: Path) -> Path | None:
    """Bare ``--resume``: the search under ``runs`` written to last, when that was after the
    newest ``runs/*/last.pt`` of a plain run (which bare ``--resume`` continues otherwise)."""
    times: dict[Path, float] = {}
    for mark in (f"*/{SEARCH_RECORD}", f"*/{record.CSV_NAME}", "*/candidate-*/last.pt"):
        for path in runs.glob(mark):
            folder = path.parent.parent if path.name == "last.pt" else path.parent
            if (folder / SEARCH_RECORD).is_file():
                times[folder] = max(times.get(folder, 0.0), path.stat().st_mtime)
    if not times:
        return None
    folder = max(times, key=times.__getitem__)
    latest_run = latest_run_checkpoint(runs)
    if latest_run is not None and latest_run.stat().st_mtime > times[folder]:
        return None
    return folder


def check_flags(args: argparse.Namespace) -> None:
    """What ``--evolve`` cannot be combined with, as one line before anything is written."""
    if args.evolve is not None and args.evolve < 1:
        raise ConfigError(f"--evolve takes a number of candidates >= 1, got {args.evolve}")
    if args.recipe == "darknet":
        raise ConfigError(
            "--evolve searches the --hyp file's keys; --recipe darknet takes its settings from "
            "the cfg instead: drop one of them"
        )
    if args.notest:
        raise ConfigError("--evolve scores each candidate by its last evaluation: drop --notest")
    if args.evolve_backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            f"--evolve-backend ray needs Ray Tune, which is not installed: pip install -r "
            f"{RAY_REQUIREMENTS}"
        )
    if args.trial_resources is not None and (
        min(args.trial_resources) < 0 or args.trial_resources[0] <= 0
    ):
        raise ConfigError(
            f"--trial-resources takes CPUS > 0 and GPUS >= 0, got {args.trial_resources}"
        )
    ray_only = [d for d in ("address", "trial_resources") if d in getattr(args, "given", ())]
    if ray_only and args.evolve_backend != "ray":
        raise ConfigError(
            f"{_flag_names(ray_only)} are the Ray backend's: add --evolve-backend ray"
        )


def _record_of(args: argparse.Namespace, config: TrainConfig, space: SearchSpace) -> dict:
    flags = {k: v for k, v in vars(args).items() if k not in OWN_FLAGS}
    return to_plain(
        {
            "schema": SCHEMA,
            "evolve": args.evolve,
            "args": flags,
            "hyp": config.hyp,
            "space": space.to_dict(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    )


def _take_search_settings(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """``--resume <search>``: the search's flags for every flag not typed; its record."""
    saved = load_yaml(folder / SEARCH_RECORD, "search record")
    parts = ("args", "hyp", "space")
    if (
        not isinstance(saved, dict)
        or saved.get("schema") != SCHEMA
        or not all(isinstance(saved.get(k), dict) for k in parts)
        or not is_int(saved.get("evolve"))
    ):
        raise ConfigError(
            f"not a search record of this version (schema {SCHEMA}: {', '.join(parts)}, evolve)",
            folder / SEARCH_RECORD,
        )
    parser = get_args_parser()
    fields = {
        a.dest: a.default for a in parser._actions if a.dest not in OWN_FLAGS and a.dest != "help"
    }
    _refuse_changed_flags(args, saved["args"], folder)
    take_from_run(args, saved["args"], fields, f"--resume {folder}")
    if args.evolve is None:
        args.evolve = saved.get("evolve")
    args.output_dir, args.resume, args.exist_ok = str(folder), None, False
    if hasattr(args, "project"):
        args.project, args.name = "", None
    return saved


def _refuse_changed_flags(args: argparse.Namespace, saved: Mapping[str, Any], folder: Path) -> None:
    """A continued search trains its candidates as it trained the others (they are compared by
    fitness): a typed flag that differs from the search's is refused, except those that only
    say where and how long it runs and how it is reported (RESUME_MAY_CHANGE)."""
    changed = [
        f"--{d.replace('_', '-')} {to_plain(getattr(args, d))} (the search has {saved.get(d)})"
        for d in sorted(getattr(args, "given", ()))
        if d not in OWN_FLAGS | RESUME_MAY_CHANGE and to_plain(getattr(args, d)) != saved.get(d)
    ]
    if changed:
        raise ConfigError(
            f"--resume {folder} continues a search, whose candidates all train with its flags "
            f"(search.yaml): {', '.join(changed)}; drop them, or start a new search"
        )


def settle(args: argparse.Namespace) -> Search:
    """Check everything and decide the search (nothing written yet)."""
    folder = _resumed_search_folder(args)
    saved = _take_search_settings(args, folder) if folder is not None else None
    if saved is None and args.resume is not None and args.evolve is not None:
        named = "" if args.resume == "auto" else f"{args.resume} is not a search folder; "
        raise ConfigError(
            f"--evolve with --resume continues a search: {named}give its folder (--resume "
            f"runs/evolve)"
        )
    check_flags(args)
    if folder is None and not (args.output_dir or args.name or getattr(args, "project", "")):
        args.name = DEFAULT_NAME
    config = build_config(args)
    if saved is None:
        space = load_space(repo_default(args.evolve_space, DEFAULT_SPACE))
        record_text = dump_yaml(_record_of(args, config, space))
    else:
        space = SearchSpace.from_dict(saved["space"])
        record_path = config.output_dir / SEARCH_RECORD
        config.hyp = {
            k: check_hyp_value(k, saved["hyp"][k], record_path, None) if k in saved["hyp"] else v
            for k, v in config.hyp.items()
        }
        record_text = None
    search = Search(config.output_dir, config, space, args.evolve, args.evolve_backend)
    search.record_text = record_text
    search.address, search.trial_resources = args.address, args.trial_resources
    return search


def claim(search: Search, exist_ok: bool, dist: DistInfo) -> RunFolder | None:
    """Claim the search folder and read its rows (rank 0); every rank learns the folder."""
    held, error = None, None
    if dist.is_main:
        try:
            held = claim_run_folder(
                search.folder, resume=search.record_text is None, exist_ok=exist_ok
            )
            search.folder = held.path
            if search.record_text is not None:
                write_text(search.folder / SEARCH_RECORD, search.record_text)
            else:
                _record_size(search)
            search.rows = record.read_rows(
                search.folder / record.CSV_NAME, {k: HYP_SPECS[k].kind for k in search.hyp_keys}
            )
            # A search extended once (--evolve 16 --resume) keeps its size when continued.
            search.total = max(search.total, len(search.rows))
        except YoloError as e:
            error = e
            if held is not None:
                held.release()
                held = None
    # Collective: a search folder rank 0 cannot claim or read stops every rank with its line.
    raise_if_any_rank_failed(error, "claiming the search folder")
    # Collective: every rank writes its candidates under the folder rank 0 claimed.
    search.folder = Path(broadcast_object(str(search.folder)))
    return held


def _record_size(search: Search) -> None:
    """A continued search extended (``--evolve 16 --resume``) records its new size at once, so
    that a bare ``--resume`` after a stop trains all of them (was: the earlier size, the rest
    forgotten without a word)."""
    path = search.folder / SEARCH_RECORD
    saved = load_yaml(path, "search record")  # checked by settle(): a dict with an int evolve
    if saved["evolve"] < search.total:
        write_text(path, dump_yaml({**saved, "evolve": search.total}))


def evolve(args: argparse.Namespace, dist: DistInfo | None) -> None:
    """Run (or continue) the search ``args`` describe on this process's share of the work
    (``dist`` None: one process, on the search's ``--device``)."""
    exist_ok = bool(args.exist_ok)
    search = settle(args)
    if dist is not None and dist.distributed and search.backend == "ray":
        raise ConfigError(
            "--evolve-backend ray starts its own processes (--trial-resources): run it from "
            "train.py alone, not under torchrun/SLURM ranks"
        )
    if dist is None:
        dist = DistInfo.single(select_device(search.config.device))
    held = claim(search, exist_ok, dist)
    try:
        handler = run_log_handler(search.folder / record.LOG_NAME) if dist.is_main else None
        with logging_to(handler):
            if held is not None:
                held.log()
            try:
                if search.backend == "ray":
                    from train_utils.evolve.ray_backend import search_with_ray

                    search_with_ray(search)
                else:
                    _search_here(search, dist)
            except (KeyboardInterrupt, RunStopped):
                if dist.is_main:  # the candidate's own line names its folder, not the search's
                    logger.warning(
                        "--evolve: stopped; continue the search with: python train.py --resume %s",
                        search.folder,
                    )
                raise
            if dist.is_main:
                _log_end(search)
    finally:
        if held is not None:
            held.release()


def _search_here(search: Search, dist: DistInfo) -> None:
    """The missing candidates, one after another; rank 0 decides each from the search's files
    and every rank trains it."""
    if dist.is_main and search.rows:
        logger.info(
            "--evolve: continuing %s: %d of %d candidates done",
            search.folder,
            len(search.rows),
            search.total,
        )
    signals = StopSignals()
    with signals.installed():
        while True:
            # A Ctrl-C that reached a candidate but that Python swallowed (see StopSignals)
            # stops the search here instead of training every candidate left.
            signals.raise_if_interrupted()
            step = _next_step(search) if dist.is_main else None
            # Collective: the candidate (its number, hyp and share of --time-budget) is rank
            # 0's, from its files and clock; every rank trains the same one, or stops with it.
            step = broadcast_object(step)
            if step is None:
                return
            index, hyp, share = step
            row = train_candidate(search, index, hyp, share, dist, signals)
            if dist.is_main:
                search.add(row)
                log_row(search, row)


def _next_step(search: Search) -> tuple[int, dict[str, Any], float | None] | None:
    """The next candidate to train (its number, hyp, seconds it may take); None when the
    search is done or its --time-budget spent."""
    done = {r.candidate for r in search.rows}
    index = next((i for i in range(search.total) if i not in done), None)
    if index is None:
        return None
    share = _budget_share(search, index)
    if share is not None and share < MIN_SHARE_S:
        logger.warning(
            "--evolve: --time-budget is spent after %d candidates; --resume with a larger "
            "--time-budget continues",
            len(done),
        )
        return None
    return index, search.hyp_of(index), share


def _budget_share(search: Search, index: int) -> float | None:
    """Seconds candidate ``index`` may take: what is left of ``--time-budget`` shared equally
    by the candidates not yet done (a candidate that ends early leaves its rest to the later
    ones). None without a budget."""
    if search.config.time_budget is None:
        return None
    done = {r.candidate for r in search.rows}
    spent = sum(r.seconds for r in search.rows)
    spent += _seconds_so_far(search.candidate_folder(index))
    left = sum(1 for i in range(index, search.total) if i not in done)
    return (search.config.time_budget * 60 - spent) / max(left, 1)


def _seconds_so_far(run: Path) -> float:
    """Seconds a candidate's earlier attempts took (its results.csv), 0 for a new one."""
    rows = read_results(run / "results.csv")
    return float(rows[-1].get("elapsed_seconds") or 0) if rows else 0.0


def candidate_config(
    search: Search, index: int, hyp: Mapping[str, Any], share_s: float | None
) -> TrainConfig:
    """Candidate ``index``'s run settings: the search's with its hyp and folder, continuing
    from the folder's ``last.pt`` when an earlier attempt saved one."""
    folder = search.candidate_folder(index)
    last = folder / "last.pt"
    resume = _finished_an_epoch(last)
    return dataclasses.replace(
        search.config,
        hyp=dict(hyp),
        output_dir=folder,
        auto_named=False,
        resume=str(last) if resume else None,
        # A start stopped before its first epoch ended is moved aside, never mixed.
        exist_ok=not resume,
        plots=False,  # YOLOv5's evolve draws no per-run pictures either
        time_budget=None if share_s is None else share_s / 60,
    )


def _finished_an_epoch(last: Path) -> bool:
    """Whether ``last`` is a checkpoint a candidate continues exactly: one saved at the end of
    an epoch. A stop inside the first epoch saves its part-trained weights as "epoch -1"; a run
    continued from them is not the uninterrupted one, so such a candidate starts over (an
    unreadable last.pt too: the trainer would refuse it)."""
    if not last.is_file():
        return False
    try:
        epoch = load_checkpoint(last).get("epoch")
    except YoloError:
        return False
    return is_int(epoch) and epoch >= 0


def train_candidate(
    search: Search,
    index: int,
    hyp: Mapping[str, Any],
    share_s: float | None,
    dist: DistInfo,
    signals: StopSignals,
) -> Row:
    """Train candidate ``index`` (or finish its earlier attempt) and score it. Its failure (a
    loss that became NaN, a model that does not fit) is its row; a stop request, Ctrl-C or an
    output that cannot be written stops the search, resumable. ``signals``: the search's, which
    the run then handles signals with."""
    config = candidate_config(search, index, hyp, share_s)
    name = config.output_dir.name
    logger.info(
        "--evolve: candidate %d of %d (%s)%s",
        index + 1,
        search.total,
        name,
        ", continuing its last.pt" if config.resume else "",
    )
    try:
        trainer.run(config, dist, signals)
    except (KeyboardInterrupt, RunStopped, OutputError):
        raise
    except Exception as e:  # any failure of one candidate is that candidate's result
        reason = str(e) if isinstance(e, YoloError) else f"{type(e).__name__}: {e}"
        logger.warning("--evolve: %s failed: %s", name, reason)
        return _failed_row(index, hyp, config.output_dir, reason.splitlines()[0])
    return scored_row(index, hyp, config.output_dir)


def evaluated_epochs(run: Path) -> list[dict[str, str]]:
    """The rows of a candidate's ``results.csv`` whose epoch was evaluated."""
    return [r for r in read_results(run / "results.csv") if r.get("mAP50-95")]


def epoch_metrics(row: Mapping[str, str]) -> dict[str, float]:
    """The metrics fitness is made of, from one ``results.csv`` row."""
    return {k: float(row[k]) for k in record.METRICS}


def scored_row(index: int, hyp: Mapping[str, Any], run: Path) -> Row:
    """A trained candidate's row, from its ``results.csv``: the last evaluated epoch."""
    rows = read_results(run / "results.csv")
    evaluated = [r for r in rows if r.get("mAP50-95")]
    if not evaluated:
        return _failed_row(index, hyp, run, "no epoch was evaluated")
    metrics = epoch_metrics(evaluated[-1])
    return Row(
        index,
        record.DONE,
        dict(hyp),
        fitness=fitness(metrics),
        metrics=metrics,
        epochs=int(rows[-1]["epoch"]) + 1,
        seconds=float(rows[-1].get("elapsed_seconds") or 0),
        run=run.name,
    )


def _failed_row(index: int, hyp: Mapping[str, Any], run: Path, reason: str) -> Row:
    """A candidate's row when it has no fitness: ``reason``, and the seconds it took."""
    return Row(
        index, record.FAILED, dict(hyp), run=run.name, reason=reason, seconds=_seconds_so_far(run)
    )


def log_row(search: Search, row: Row) -> None:
    """One line per scored candidate: its fitness and the best so far."""
    if math.isnan(row.fitness):
        logger.info("--evolve: %s %s (%s)", row.run, row.status, row.reason)
        return
    best = record.best_row(search.rows)
    logger.info(
        "--evolve: %s %s, fitness %.5f (mAP@0.5 %.4f, mAP@0.5:0.95 %.4f); best so far: %s",
        row.run,
        row.status,
        row.fitness,
        row.metrics["mAP50"],
        row.metrics["mAP50-95"],
        "none" if best is None else f"{best.run} {best.fitness:.5f}",
    )


def _log_end(search: Search) -> None:
    search.write_summaries()
    best = record.best_row(search.rows)
    done = len(search.rows)
    if best is None:
        logger.warning("--evolve: %d candidates, none scored (see evolve.csv's reasons)", done)
        return
    best_hyp = search.folder / record.BEST_HYP_NAME
    logger.info(
        "--evolve: %d of %d candidates in %s; the best, %s, fitness %.5f. Results: %s, %s. "
        "Train with it: python train.py --hyp %s and the search's other flags (its "
        "search.yaml's args)",
        done,
        search.total,
        search.folder,
        best.run,
        best.fitness,
        record.CSV_NAME,
        record.PLOT_NAME,
        best_hyp,
    )
