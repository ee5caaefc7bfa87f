"""Steps for tests/scripts/test_gpu_check.py's orchestrator tests, each run the way
``make gpu-check`` runs its own: in a child process, ``bench/gpu_check.py --run-step
tests.workers.gpu_check_steps:NAME``."""

from __future__ import annotations

import time

from bench.gpu_check import StepContext, StepFailed, StepSkipped, table

HANG_S = 600


def crashes(ctx: StepContext) -> None:
    ctx.record(before_the_crash=1)
    raise RuntimeError("boom: the step crashed")


def finds_a_problem(ctx: StepContext) -> None:
    ctx.record(measured=2)
    raise StepFailed("the figures disagree")


def skips(ctx: StepContext) -> None:
    raise StepSkipped("nothing to check here")


def passes(ctx: StepContext) -> None:
    """Records the names of the steps whose figures it was handed."""
    ctx.record(earlier=sorted(ctx.earlier), table=table(["a", "b"], [[1, "x|y"]]))


def hangs(ctx: StepContext) -> None:
    ctx.record(started=True)
    time.sleep(HANG_S)
