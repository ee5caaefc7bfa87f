"""train_utils/distributed/process_group.py in this process: no launcher gives a single process,
DistInfo, the launch hint, SLURM's variables exported for env:// initialisation, and bad
launcher variables. Real 2-process groups started by each launcher are in
tests/train_utils/distributed/test_comm.py."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from conftest import LAUNCH_VARS, rank_envs, run_fresh_ranks

from build_utils.errors import ConfigError
from train_utils.distributed import comm, process_group


@pytest.fixture
def clean_env():
    """Remove launcher variables for the test and restore the whole environment afterwards."""
    saved = dict(os.environ)
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_no_launcher_gives_single_process(clean_env, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=process_group.__name__):
        info = process_group.init_distributed_mode(None)
    assert info.world_size == 1 and info.rank == 0 and info.local_rank == 0
    assert info.backend is None
    assert not info.distributed and info.is_main
    assert not comm.is_dist_avail_and_initialized()
    assert "single process" in caplog.text


def test_no_launcher_device_cpu_forced(clean_env) -> None:
    class Args:
        device = "cpu"
        local_rank = -1

    assert process_group.init_distributed_mode(Args()).device == torch.device("cpu")


def test_distinfo() -> None:
    info = process_group.DistInfo.single("cpu")
    assert info == process_group.DistInfo(0, 1, 0, torch.device("cpu"), None)
    assert not info.distributed and info.is_main
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]
    assert process_group.DistInfo(1, 2, 1, torch.device("cpu"), "gloo").distributed
    assert not process_group.DistInfo(1, 2, 1, torch.device("cpu"), "gloo").is_main
    assert process_group.DistInfo(0, 1, 0, torch.device("cpu"), "gloo").distributed


def test_launch_hint() -> None:
    hint = process_group.launch_hint()
    assert "torchrun --nproc_per_node=" in hint and "train_multi_GPU.py" in hint


def test_slurm_env_exported(clean_env) -> None:
    clean_env.update(
        SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_JOB_ID="123",
        SLURM_LAUNCH_NODE_IPADDR="10.1.2.3", SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_TASKS_PER_NODE="2(x2)", SLURM_NODEID="1",
    )  # fmt: skip
    rank, world, local, launcher = process_group._read_launch_env(None)
    assert (rank, world, local, launcher) == (3, 4, 1, "SLURM")
    assert clean_env["RANK"] == "3" and clean_env["WORLD_SIZE"] == "4"
    assert clean_env["LOCAL_RANK"] == "1"
    # Rank 0's node, not the login node that ran sbatch/srun.
    assert clean_env["MASTER_ADDR"] == "gpu07"
    assert clean_env["LOCAL_WORLD_SIZE"] == "2"
    assert clean_env["MASTER_PORT"] == str(15000 + 123)


def test_slurm_keeps_given_master(clean_env) -> None:
    clean_env.update(
        SLURM_PROCID="0", SLURM_NTASKS="1", MASTER_ADDR="node7", MASTER_PORT="4242",
        SLURM_JOB_NODELIST="gpu01", SLURM_NTASKS_PER_NODE="8", LOCAL_WORLD_SIZE="3",
    )  # fmt: skip
    assert process_group._read_launch_env(None)[:3] == (0, 1, 0)
    assert clean_env["MASTER_ADDR"] == "node7" and clean_env["MASTER_PORT"] == "4242"
    assert clean_env["LOCAL_WORLD_SIZE"] == "3"


def test_slurm_without_a_node_list_uses_localhost(clean_env) -> None:
    clean_env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="4")
    process_group._read_launch_env(None)
    assert clean_env["MASTER_ADDR"] == "127.0.0.1"
    assert clean_env["LOCAL_WORLD_SIZE"] == "4"


def test_bad_launcher_variables(clean_env) -> None:
    clean_env.update(RANK="zero", WORLD_SIZE="2")
    with pytest.raises(ConfigError, match="RANK='zero' is not an integer"):
        process_group.init_distributed_mode(None)
    clean_env.update(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0")
    with pytest.raises(ConfigError, match="rank 2 outside world size 2"):
        process_group.init_distributed_mode(None)
    assert not comm.is_dist_avail_and_initialized()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun"),
        ({"RANK": "0"}, None),  # half a launch: init_distributed_mode ignores it too
        ({"SLURM_PROCID": "0"}, "SLURM"),
    ],
)
def test_launcher_name(env, expected):
    assert process_group.launcher_name(env) == expected


def test_launched_world_size_reads_the_launchers_variables() -> None:
    assert process_group.launched_world_size({}) == 1
    assert process_group.launched_world_size({"RANK": "1", "WORLD_SIZE": "2"}) == 2
    assert process_group.launched_world_size({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) == 4
    assert process_group.launched_world_size({"SLURM_PROCID": "0"}) == 1
    assert process_group.launched_world_size({"WORLD_SIZE": "3"}) == 1  # no RANK: not launched


# One rank: the group, then torch.distributed.nn (what torchvision imports through
# torch._dynamo: a script importing torchvision after the group was made), a collective,
# cleanup(); then the gloo threads still running (a group that cleanup() could not free keeps
# them into interpreter exit).
_GROUP_THEN_DISTRIBUTED_NN = """
import argparse, pathlib
import torch, torch.distributed as dist
from train_utils.distributed import process_group
process_group.init_distributed_mode(argparse.Namespace(device="cpu", local_rank=-1), timeout_s=60)
import torch.distributed.nn
dist.all_reduce(torch.ones(1))
process_group.cleanup()
names = [p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm")]
print(sorted(n for n in names if "gloo" in n))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_cleanup_frees_the_group_when_torch_distributed_nn_comes_after_it() -> None:
    # Fresh interpreters: the warm ones of tests/warm_python.py have torchvision already.
    ranks = run_fresh_ranks([sys.executable, "-c", _GROUP_THEN_DISTRIBUTED_NN], rank_envs())
    for code, out, err in ranks:
        assert code == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "[]", out
