"""train_utils/distributed/comm.py: every collective in real 2-process gloo groups, launched by
torchrun, by hand with SLURM's variables and with the legacy ``--local_rank`` argument (so these
are also the launches of process_group.init_distributed_mode), one rank's failure raised on every
rank, and the helpers without a process group. The ranks run tests/workers/comm_worker.py and
tests/workers/rank_failure_worker.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from conftest import base_env, pair_envs, rank_envs, run_pair, worker_cmd

from build_utils.errors import ConfigError
from train_utils.distributed import comm, process_group
from train_utils.distributed.launch import free_port


def _out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_collectives(res: list[dict]) -> None:
    for r, got in enumerate(res):
        assert got["rank"] == r and got["get_rank"] == r
        assert got["world_size"] == 2 and got["get_world_size"] == 2
        assert got["backend"] == "gloo" and got["device"] == "cpu"
        assert got["distributed"] is True
        assert got["is_main"] is (r == 0)
        assert got["root_level"] == (logging.INFO if r == 0 else logging.WARNING)
        assert got["reduce_avg"] == [1.5, 5.0]
        assert got["reduce_int"] == 1.5
        assert got["gather"] == [{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]
        assert got["broadcast"] == "from rank 1"
        # Rank 0 alone receives every rank's rows (1 and 2 of them), in rank order.
        expected_rows = [[0, 1, 2], [100, 101, 102], [103, 104, 105]] if r == 0 else None
        assert got["rows"] == expected_rows
        assert got["tensors"] == [
            [[1.0] * 3] * 2,
            torch.arange(24.0).reshape(1, 2, 3, 4).add(10).tolist(),
            8,
        ]
        assert got["tensors_kept"] is True
        assert got["flag_none"] is False
        assert got["flag_one"] is True
        assert got["initialised_after_cleanup"] is False
    assert res[1]["marker"] == "written by rank 0"


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path: Path) -> None:
    out = _out_dir(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",  # torchrun runs the worker as a module, as worker_cmd does
        "tests.workers.comm_worker",
        str(out),
    ]
    run_pair([cmd], [base_env()])
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]


@pytest.mark.slow
def test_slurm_variables(tmp_path: Path) -> None:
    out = _out_dir(tmp_path)
    envs = pair_envs(
        {
            "SLURM_PROCID": "{rank}",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "{rank}",
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": "{port}",
        }
    )
    run_pair([worker_cmd("comm_worker", out)] * 2, envs)
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]
    # MASTER_ADDR came from SLURM_JOB_NODELIST; RANK was exported for env:// init.
    assert [r["master_addr"] for r in res] == ["localhost"] * 2
    assert [r["env_rank"] for r in res] == ["0", "1"]


@pytest.mark.slow
def test_legacy_local_rank_argument(tmp_path: Path) -> None:
    """torch.distributed.launch without --use_env: RANK/WORLD_SIZE in env, local rank as arg."""
    out = _out_dir(tmp_path)
    envs = pair_envs(
        {"RANK": "{rank}", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}
    )
    # Older torch spells it --local_rank, newer --local-rank: one rank each.
    cmds = [
        worker_cmd("comm_worker", out, f"{flag}={rank}")
        for rank, flag in enumerate(["--local_rank", "--local-rank"])
    ]
    run_pair(cmds, envs)
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    out = _out_dir(tmp_path)
    envs = rank_envs(SLURMD_NODENAME="node{rank}")
    run_pair([worker_cmd("rank_failure_worker", out)] * 2, envs)
    errors = [r["error"] for r in _results(out)]
    assert errors == ["--resume failed on rank 1 (node1): /node1/last.pt: cannot read"] * 2


# ---------------------------------------------------------------- without a process group


def test_helpers_without_group() -> None:
    assert comm.get_rank() == 0 and comm.get_world_size() == 1
    mean = torch.tensor([2.0])
    assert comm.all_reduce_mean(mean) is mean
    assert comm.all_gather({"x": 1}) == [{"x": 1}]
    assert comm.broadcast_object("obj") == "obj"
    t = torch.ones(3)
    comm.broadcast_tensors_([t])
    assert torch.equal(t, torch.ones(3))
    rows = torch.ones(2, 7)
    assert comm.gather_rows_to_main(rows) is rows
    assert comm.all_reduce_flag(True) is True and comm.all_reduce_flag(False) is False
    with comm.torch_distributed_zero_first(0):
        pass
    with comm.torch_distributed_zero_first(3):
        pass
    comm.barrier()
    process_group.cleanup()
    process_group.cleanup()


def test_raise_if_any_rank_failed_without_group() -> None:
    comm.raise_if_any_rank_failed(None, "x")
    with pytest.raises(ConfigError, match="^bad$"):
        comm.raise_if_any_rank_failed(ConfigError("bad"), "x")
