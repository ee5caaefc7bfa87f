"""Tests for train_utils/plan.py and the trainer's --time-budget and --patience: the epoch
estimate against a brute-force count, the stretched cosine schedule, rank agreement in a real
2-process gloo group, and budgeted training runs that stop on time and resume."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import rank_envs, read_results, run_pair, run_training, train_argv, worker_cmd

from build_utils.errors import CheckpointError, ConfigError
from train_utils import rounds
from train_utils.checkpoint import load_checkpoint
from train_utils.config import build_config, get_args_parser
from train_utils.evaluation.coco_eval import STAT_NAMES
from train_utils.optim import build_scheduler, lr_lambda
from train_utils.plan import FITNESS_KEY, EpochPlan, epochs_within_budget, evaluated


def _brute_force(epoch, remaining, epoch_s, eval_s, interval, notest, max_epochs=None):
    """Walk the totals one by one, pricing every epoch and evaluation separately."""
    best = epoch + 1
    for total in range(epoch + 2, 10_000):
        cost = eval_s * evaluated(epoch, total, interval, notest)
        for e in range(epoch + 1, total):
            cost += epoch_s + eval_s * evaluated(e, total, interval, notest)
        if cost > remaining:
            break
        best = total
    return best if max_epochs is None else min(best, max_epochs)


def test_budget_estimate_matches_a_brute_force_count() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        case = (
            rng.randrange(0, 30),
            rng.uniform(0, 400),
            rng.uniform(0.5, 30),
            rng.uniform(0, 12),
            rng.randrange(1, 7),
            rng.random() < 0.2,
            rng.choice([None, rng.randrange(1, 40)]),
        )
        assert epochs_within_budget(*case) == _brute_force(*case), case


def test_budget_estimate_by_hand() -> None:
    # 100 s left after epoch 4; epochs 10 s, evaluations 5 s, every 2nd epoch evaluated.
    # Total 9 (epochs 5..8): 40 s + evaluations of epochs 5, 7, 8 (+ none for 4) = 55 s;
    # total 11: 60 s + evals 5, 7, 9, 10 = 80 s; total 12: 70 s + evals 5, 7, 9, 11 = 90 s;
    # total 13: 80 s + evals 5, 7, 9, 11, 12 = 105 s > 100.
    assert epochs_within_budget(4, 100.0, 10.0, 5.0, eval_interval=2) == 12
    assert epochs_within_budget(4, 100.0, 10.0, 5.0, eval_interval=2, max_epochs=7) == 7
    # Nothing left: this epoch is the last.
    assert epochs_within_budget(4, 0.0, 10.0, 5.0) == 5
    assert epochs_within_budget(4, -30.0, 10.0, 5.0) == 5


def test_a_budget_of_years_is_planned_at_once() -> None:
    # 10^7 minutes over half-second epochs: 1.2e9 totals, which a loop over them took minutes
    # to walk after every epoch (10^9 minutes: hours).
    t0 = time.perf_counter()
    assert epochs_within_budget(0, 1e9 * 60, 0.5, 0.0) == 120_000_000_001
    assert epochs_within_budget(0, 1e7 * 60, 0.5, 0.1, eval_interval=3) == 1_125_000_000
    assert time.perf_counter() - t0 < 1.0


def test_plan_without_budget_is_fixed() -> None:
    plan = EpochPlan(epochs=7, eval_interval=3)
    assert [e for e in range(7) if plan.evaluates(e)] == [2, 5, 6]


def test_plan_uses_recent_epochs_and_the_measured_evaluation() -> None:
    plan = EpochPlan(epochs=30, budget_s=100.0, started=time.time(), eval_share=0.5)
    # 10 s spent; the first epoch took 10 s and no evaluation was timed yet (guessed 5 s, half
    # the epoch as val/train = 0.5). Every epoch is evaluated: a total of T costs
    # (T - 1) * 10 s of training + T * 5 s of evaluation; 90 s left buy T = 6 (80 s), not 7.
    assert plan.budget_epochs(0, 10.0, spent_s=10.0) == 6
    plan.after_epoch(10.0, 1.0)  # evaluations turn out to take 1 s
    # 79 s left: 1 s for epoch 1's own evaluation, then 11 s per further epoch: 7 more.
    assert plan.budget_epochs(1, 10.0, spent_s=21.0) == 9
    assert plan.epochs == 30, "a pure decision: the trainer stores (and broadcasts) the answer"


def test_one_slow_epoch_does_not_move_the_plan() -> None:
    def plan_after(times: list[float]) -> int:
        plan = EpochPlan(epochs=30, budget_s=1000.0)
        for t in times[:-1]:
            plan.after_epoch(t, 1.0)
        return plan.budget_epochs(len(times) - 1, times[-1], spent_s=100.0)

    steady = plan_after([10.0, 10.0, 10.0, 10.0])
    assert plan_after([10.0, 10.0, 10.0, 25.0]) == steady  # the median of the last five
    assert plan_after([10.0, 25.0, 10.0, 10.0]) == steady
    assert plan_after([20.0, 20.0, 20.0, 20.0]) < steady


def _resumed_plan(budget_min: float, saved_budget_min: float, planned: int, start: int) -> int:
    """The epochs of a resume with ``--time-budget budget_min`` of a checkpoint that planned
    ``planned`` epochs under ``saved_budget_min``, spent 100 s of it at 30 s an epoch."""
    ckpt = {
        "budget_spent_s": 100.0,
        "planned_epochs": planned,
        "epoch_seconds": [30.0] * start,
        "eval_seconds": 5.0,
        "config": {"time_budget": saved_budget_min},
    }
    plan = EpochPlan(epochs=99, budget_s=budget_min * 60.0)
    plan.load_state_dict(ckpt, start_epoch=start)
    return plan.epochs


def test_a_resume_follows_the_budget_it_is_given() -> None:
    # 120 s, 100 s spent: the run stopped where a 4th epoch would not fit. The same budget again
    # trains nothing (it trained one more epoch, past the budget: the plan's 'at least one').
    assert _resumed_plan(2.0, 2.0, planned=3, start=3) == 3
    # Interrupted within the same budget: its plan stands.
    assert _resumed_plan(2.0, 2.0, planned=5, start=3) == 5
    # A larger budget: planned anew from the measured times (260 s left: epoch 2 evaluated
    # (5 s), then 7 epochs of 30 s each evaluated).
    assert _resumed_plan(6.0, 2.0, planned=3, start=3) == 3 + 7


def test_stretched_cosine_ends_at_lrf() -> None:
    total = [10]
    f = lr_lambda(lambda: total[0], 0.1)
    assert f(0) == 1.0 and f(10) == pytest.approx(0.1)
    before = f(3)
    total[0] = 5  # the budget turned out shorter: the curve shrinks from here on
    assert f(3) < before and f(5) == pytest.approx(0.1)
    assert lr_lambda(10, 0.1)(5) == pytest.approx(0.55)
    # The closure is not saved in the scheduler's state (resume follows the new plan).
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert build_scheduler(opt, lambda: 3, 0.1).state_dict()["lr_lambdas"] == [None]


def test_patience_counts_epochs_since_the_best() -> None:
    plan = EpochPlan(epochs=50, patience=3)
    assert not plan.out_of_patience(5, best_epoch=3)
    assert plan.out_of_patience(6, best_epoch=3)
    assert not plan.out_of_patience(6, best_epoch=None)
    assert not EpochPlan(epochs=50).out_of_patience(60, best_epoch=0)


def test_budget_and_patience_flags_are_checked(shapes_data, repo_root) -> None:
    base = ["--data", str(shapes_data), "--cfg", str(repo_root / "cfg" / "yolov3-spp-nano.cfg")]
    for bad in ("0", "nan", "inf", "1e308"):  # 1e308 minutes: inf seconds (was a traceback)
        with pytest.raises(ConfigError, match="--time-budget must be a positive, finite"):
            build_config(get_args_parser().parse_args([*base, "--time-budget", bad]))
    with pytest.raises(ConfigError, match="--patience must be >= 0"):
        build_config(get_args_parser().parse_args([*base, "--patience", "-1"]))
    config = build_config(get_args_parser().parse_args([*base, "--time-budget", "2.5"]))
    assert config.epochs is None and config.time_budget == 2.5
    assert build_config(get_args_parser().parse_args(base)).epochs == 30


@pytest.mark.slow
def test_every_rank_follows_rank_zeros_plan(tmp_path: Path) -> None:
    run_pair([worker_cmd("plan_worker", tmp_path)] * 2, rank_envs())
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Rank 0: 90 s left, 10 s epochs, evaluations guessed at 2 s: 7 more epochs (84 s).
    assert [{"total": r["total"], "stop": r["stop"]} for r in res] == [
        {"total": 8, "stop": True}
    ] * 2
    assert res[1]["mine"] == [1, False], "rank 1 alone would have decided otherwise"


# ---------------------------------------------------------------- budgeted training runs

# 12 s: several one-batch epochs of the tiny data even on a busy CI machine (at 9 s, with two
# other jobs on the 2 cores, the set-up and one epoch took it all: 1 epoch, no resume to test).
BUDGET_MIN = 0.2
EXTRA_MIN = 0.1  # what the resumed run adds


def _budget_flags(data: Path, out: Path, minutes: float, *extra: str) -> list[str]:
    """test_train's run (batch 8, nbs 8) with a time budget instead of an epoch count, at 64 px."""
    budget = ["--time-budget", str(minutes), "--eval-interval", "2", "--log-interval", "1"]
    # The memory format is given, not timed: the timing's seconds would come out of the budget.
    budget.append("--no-channels-last")
    return train_argv(data, out, *budget, *extra, epochs=None, batch=8, nbs=8, img=64)


def _check_schedule_ended(ckpt: dict, epochs_total: int) -> None:
    """The run's last epoch is the planned one and the cosine schedule reached lr0 * lrf."""
    assert ckpt["epoch"] == epochs_total - 1
    assert ckpt["planned_epochs"] == epochs_total
    sched = ckpt["scheduler"]
    assert sched["last_epoch"] == epochs_total
    lr0, lrf = ckpt["hyp_scaled"]["lr0"], ckpt["hyp_scaled"]["lrf"]
    assert sched["_last_lr"] == pytest.approx([lr0 * lrf] * len(sched["_last_lr"]))


@pytest.fixture
def one_thread():
    """One intra-op thread: the budget is wall time, and with two threads on the 2-core CI
    machine a step waits for whichever thread the other worker's processes have descheduled
    (2.9 s instead of 0.1 s per batch: one epoch filled the whole budget)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_time_budget_stops_on_time_and_resumes(shapes_data, tmp_path, one_thread) -> None:
    out = tmp_path / "run"
    t0 = time.time()
    summary = run_training(_budget_flags(shapes_data, out, BUDGET_MIN))
    wall = time.time() - t0
    rows = read_results(out / "results.csv")
    ckpt = load_checkpoint(out / "last.pt")
    epochs = summary.epochs_run
    assert epochs >= 2, "the tiny data trains several epochs in 12 s"
    _check_schedule_ended(ckpt, epochs)
    # Ends within about one epoch of the budget (epoch time measured from the run itself).
    epoch_s = wall / epochs
    assert abs(wall - BUDGET_MIN * 60) < 2 * epoch_s + 3.0, (wall, epoch_s)
    # The last epoch is evaluated; the others every 2nd epoch.
    assert [int(r["epoch"]) for r in rows] == sorted(
        {e for e in range(epochs) if (e + 1) % 2 == 0} | {epochs - 1}
    )
    assert ckpt["budget_spent_s"] == pytest.approx(wall, abs=3.0)

    # A larger budget continues the same run: no epoch twice, the budget spent so far counts.
    spent = ckpt["budget_spent_s"]
    t1 = time.time()
    budget2 = BUDGET_MIN + EXTRA_MIN
    more = run_training(_budget_flags(shapes_data, out, budget2, "--resume"))
    resumed_wall = time.time() - t1
    ckpt2 = load_checkpoint(out / "last.pt")
    total = epochs + more.epochs_run
    assert more.epochs_run >= 1
    _check_schedule_ended(ckpt2, total)
    assert ckpt2["budget_spent_s"] == pytest.approx(spent + resumed_wall, abs=3.0)
    assert ckpt2["budget_spent_s"] < budget2 * 60 + 2 * resumed_wall / more.epochs_run + 3
    epochs_in_csv = [int(r["epoch"]) for r in read_results(out / "results.csv")]
    assert epochs_in_csv == sorted(set(epochs_in_csv)) and epochs_in_csv[-1] == total - 1

    # The same budget again: already spent, nothing is trained.
    again = run_training(_budget_flags(shapes_data, out, budget2, "--resume"))
    assert again.epochs_run == 0


@pytest.mark.slow
def test_patience_stops_a_run_that_does_not_improve(shapes_data, tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    # The evaluation reports mAP@0.5:0.95 falling after epoch 0 (the real one is near 0 and
    # could tie or wobble on this tiny data).
    fitness = iter([0.5, 0.4, 0.45, 0.6, 0.7])

    def evaluate(*args, **kwargs):
        stats, per_class, detections = real_evaluate(*args, **kwargs)
        stats = list(stats)
        stats[STAT_NAMES.index(FITNESS_KEY)] = next(fitness)
        return stats, per_class, detections

    real_evaluate = rounds.evaluate
    monkeypatch.setattr(rounds, "evaluate", evaluate)
    flags = _budget_flags(shapes_data, out, 10.0, "--epochs", "20", "--patience", "2")
    flags[flags.index("--eval-interval") + 1] = "1"
    summary = run_training(flags)
    # Best at epoch 0 (first evaluation), no improvement at 1 and 2: stop after epoch 2.
    assert summary.epochs_run == 3
    assert load_checkpoint(out / "last.pt")["best_epoch"] == 0


def test_a_finished_budget_given_more_time_is_planned_anew_at_resume() -> None:
    """A 5-minute run that used its budget in 5 epochs of 60 s (+10 s evaluation), resumed with
    10 minutes: the plan for the remaining 300 s is made at resume from the measured times, so
    the first resumed epoch already trains on the longer schedule (was: one more epoch, that is
    the end of a 6-epoch curve, then a jump)."""
    plan = EpochPlan(epochs=30, budget_s=600.0, started=time.time())
    ckpt = {
        "planned_epochs": 5,
        "budget_spent_s": 300.0,
        "epoch_seconds": [60.0] * 5,
        "eval_seconds": 10.0,
        "config": {"time_budget": 5.0},
    }
    EpochPlan.check_state(ckpt)
    plan.load_state_dict(ckpt, start_epoch=5)
    # Epochs 5..8 (4 x 60 s) and their evaluations (4 x 10 s) fit in 300 s; epoch 9 does not.
    assert plan.epochs == 9
    assert plan.spent_before_s == 300.0 and plan.eval_s == 10.0


def test_an_interrupted_budget_run_keeps_its_plan_and_times() -> None:
    plan = EpochPlan(epochs=30, budget_s=600.0, started=time.time())
    ckpt = {"planned_epochs": 7, "budget_spent_s": 120.0, "epoch_seconds": [50.0, 60.0]}
    plan.load_state_dict({**ckpt, "config": {"time_budget": 10.0}}, start_epoch=2)
    assert plan.epochs == 7 and plan.epoch_s == [50.0, 60.0]
    assert plan.state_dict()["epoch_seconds"] == [50.0, 60.0]


@pytest.mark.parametrize(
    "key, value", [("epoch_seconds", ["x"]), ("epoch_seconds", 3), ("eval_seconds", -1.0)]
)
def test_damaged_plan_times_are_one_line(key, value) -> None:
    with pytest.raises(CheckpointError, match=f"the checkpoint is damaged: {key} "):
        EpochPlan.check_state({key: value}, "last.pt")


def test_a_budget_run_stopped_by_its_epochs_cap_trains_on_with_a_higher_cap() -> None:
    """Was: ``--time-budget 10 --epochs 1``, then ``--resume --epochs 3``: "the checkpoint
    already spent the --time-budget; nothing to do" after 6 s of the 10 minutes."""
    ckpt = {
        "planned_epochs": 1,
        "budget_spent_s": 6.0,
        "epoch_seconds": [5.0],
        "eval_seconds": 1.0,
        "config": {"time_budget": 10.0, "epochs": 1},
    }
    # No cap now: what the 594 s left fit at 5 s an epoch and 1 s its evaluation (98 more).
    for cap, epochs in ((3, 3), (1, 1), (None, 99)):
        plan = EpochPlan(epochs=cap or 300, budget_s=600.0, max_epochs=cap)
        plan.load_state_dict(ckpt, start_epoch=1)
        assert plan.epochs == epochs, cap
