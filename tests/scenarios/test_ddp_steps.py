"""What DDP costs per training step, in a real 2-process gloo group: every rank trains at the
same multi-scale size at each step, gradient accumulation all-reduces once per optimizer step
(``no_sync`` on the other micro-batches) with the same result as all-reducing each one, and a
non-finite loss on one rank stops every rank at the same step. The ranks run
tests/workers/ddp_steps_worker.py and tests/workers/nonfinite_worker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import rank_envs, run_pair, worker_cmd

from train_utils.engine import multi_scale_size

TIMEOUT_S = 240


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_multi_scale_size_depends_on_seed_epoch_and_step_only() -> None:
    sizes = [multi_scale_size((64, 192), 0, 1, step) for step in range(200)]
    assert sizes == [multi_scale_size((64, 192), 0, 1, step) for step in range(200)]
    assert set(sizes) == {64, 96, 128, 160, 192}
    assert sizes != [multi_scale_size((64, 192), 0, 2, step) for step in range(200)]
    assert sizes != [multi_scale_size((64, 192), 1, 1, step) for step in range(200)]


@pytest.mark.slow
def test_ranks_share_sizes_and_all_reduce_once_per_optimizer_step(tmp_path: Path) -> None:
    run_pair([worker_cmd("ddp_steps_worker", tmp_path)] * 2, rank_envs(), timeout=TIMEOUT_S)
    res = _results(tmp_path)
    # 9: the same size on both ranks at every step, constant within an accumulation window.
    assert res[0]["sizes"] == res[1]["sizes"]
    assert res[0]["sizes"] == [multi_scale_size((64, 128), 7, 1, i // 3) for i in range(6)]
    # 10: 6 micro-batches, accumulate 3: 2 gradient all-reduces instead of 6, same weights.
    for got in res:
        assert got["allreduces_no_sync"] == 2
        assert got["allreduces_every_batch"] == 6
        assert got["max_param_diff"] <= 1e-6 * max(1.0, got["param_scale"])


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    run_pair([worker_cmd("nonfinite_worker", tmp_path)] * 2, rank_envs())
    res = _results(tmp_path)
    assert [r["clean"] for r in res] == ["passed", "passed"]
    # The rank that saw it names the offending batch; the other stops at the same step.
    assert res[1]["error"] == (
        "non-finite loss in epoch 3; offending batch: r1_b.jpg, r1_c.jpg. "
        "Lower lr0, check these images' labels, or disable --amp"
    )
    assert res[0]["error"] == "non-finite loss on another rank in epoch 3; stopping"
