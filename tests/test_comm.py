"""Tests for train_utils/distributed_utils.py: no-group behaviour in-process, collectives in
real 2-process gloo groups launched by torchrun, by hand with SLURM variables, and with the
legacy ``--local_rank`` argument."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from build_utils.errors import ConfigError
from train_utils.distributed import comm, node, process_group

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 90

# Launcher variables that must not leak from the test runner's environment into the checks.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID",
    "LOCAL_WORLD_SIZE",
)

WORKER = textwrap.dedent(
    """
    import argparse
    import json
    import logging
    import os
    import time
    from pathlib import Path

    import torch

    from train_utils.distributed import comm, process_group

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    out = Path(args.out)

    info = process_group.init_distributed_mode(args, timeout_s=60)
    r = info.rank
    res = {
        "rank": r,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "backend": info.backend,
        "device": str(info.device),
        "distributed": info.distributed,
        "is_main": info.is_main,
        "get_rank": comm.get_rank(),
        "get_world_size": comm.get_world_size(),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "env_rank": os.environ.get("RANK"),
        "root_level": logging.getLogger().level,
    }
    # Keys inserted in different orders on the two ranks: reduction must match by name.
    losses = {"box": torch.tensor(float(r + 1)), "obj": torch.tensor(10.0 * r)}
    if r == 1:
        losses = dict(reversed(list(losses.items())))
    res["reduce_avg"] = {k: v.item() for k, v in comm.reduce_dict(losses).items()}
    res["reduce_sum"] = {k: v.item() for k, v in comm.reduce_dict(losses, False).items()}
    res["reduce_int"] = comm.reduce_dict({"n": torch.tensor(r + 1)})["n"].item()
    res["gather"] = comm.all_gather({"rank": r, "items": list(range(r + 1))})
    res["broadcast"] = comm.broadcast_object(f"from rank {r}", src=1)
    rows = torch.arange(3.0 * (r + 1), dtype=torch.float64).reshape(-1, 3) + 100 * r
    gathered = comm.gather_rows_to_main(rows)
    res["rows"] = None if gathered is None else gathered.tolist()
    res["flag_none"] = comm.all_reduce_flag(False)
    res["flag_one"] = comm.all_reduce_flag(r == 1)

    marker = out / "marker.txt"
    with comm.torch_distributed_zero_first(r):
        if r == 0:
            # Rank 1 would read a missing file if it did not wait for this block.
            time.sleep(1.0)
            marker.write_text("written by rank 0")
        else:
            res["marker"] = marker.read_text()
    comm.barrier()
    process_group.cleanup()
    res["initialised_after_cleanup"] = comm.is_dist_avail_and_initialized()
    (out / f"rank{r}.json").write_text(json.dumps(res))
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two ranks share two cores with other test runs
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _pair_envs(variables: dict[str, str]) -> list[dict[str, str]]:
    """Environments of ranks 0 and 1 of a one-node group: ``variables`` (values may name
    ``{rank}`` and ``{port}``, a free loopback port shared by both) over :func:`_base_env`."""
    port = str(_free_port())
    return [
        {**_base_env(), **{k: v.format(rank=rank, port=port) for k, v in variables.items()}}
        for rank in range(2)
    ]


def _rank_envs(**extra: str) -> list[dict[str, str]]:
    """torchrun's variables for ranks 0 and 1 of a one-node group on a free loopback port;
    ``extra`` values may name ``{rank}``."""
    torchrun = {
        "RANK": "{rank}",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "{rank}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "{port}",
    }
    return _pair_envs({**torchrun, **extra})


def _write_worker(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def _run_pair(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    """Start one process per command at once and fail with their stderr if any fails."""
    procs = [
        subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LAUNCH_TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, f"{p.args} failed:\n{stdout.decode()}\n{stderr.decode()}"


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
        assert got["reduce_avg"] == {"box": 1.5, "obj": 5.0}
        assert got["reduce_sum"] == {"box": 3.0, "obj": 10.0}
        assert got["reduce_int"] == 1.5
        assert got["gather"] == [{"rank": 0, "items": [0]}, {"rank": 1, "items": [0, 1]}]
        assert got["broadcast"] == "from rank 1"
        # Rank 0 alone receives every rank's rows (1 and 2 of them), in rank order.
        expected_rows = [[0, 1, 2], [100, 101, 102], [103, 104, 105]] if r == 0 else None
        assert got["rows"] == expected_rows
        assert got["flag_none"] is False
        assert got["flag_one"] is True
        assert got["initialised_after_cleanup"] is False
    assert res[1]["marker"] == "written by rank 0"


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path: Path) -> None:
    script, out = _write_worker(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(script),
        str(out),
    ]
    _run_pair([cmd], [_base_env()])
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]


@pytest.mark.slow
def test_slurm_variables(tmp_path: Path) -> None:
    script, out = _write_worker(tmp_path)
    envs = _pair_envs(
        {
            "SLURM_PROCID": "{rank}",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "{rank}",
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": "{port}",
        }
    )
    _run_pair([[sys.executable, str(script), str(out)]] * 2, envs)
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]
    # MASTER_ADDR came from SLURM_JOB_NODELIST; RANK was exported for env:// init.
    assert [r["master_addr"] for r in res] == ["localhost"] * 2
    assert [r["env_rank"] for r in res] == ["0", "1"]


@pytest.mark.slow
def test_legacy_local_rank_argument(tmp_path: Path) -> None:
    """torch.distributed.launch without --use_env: RANK/WORLD_SIZE in env, local rank as arg."""
    script, out = _write_worker(tmp_path)
    envs = _pair_envs(
        {"RANK": "{rank}", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}
    )
    # Older torch spells it --local_rank, newer --local-rank: one rank each.
    cmds = [
        [sys.executable, str(script), str(out), f"{flag}={rank}"]
        for rank, flag in enumerate(["--local_rank", "--local-rank"])
    ]
    _run_pair(cmds, envs)
    res = _results(out)
    _check_collectives(res)
    assert [r["local_rank"] for r in res] == [0, 1]


NONFINITE_WORKER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import torch

    from train_utils.distributed import process_group
    from train_utils.engine import NonFiniteLossError, _check_finite

    out = Path(sys.argv[1])
    info = process_group.init_distributed_mode(None, timeout_s=60)
    r = info.rank
    # Three logged iterations; rank 1's second loss is NaN.
    flags = [torch.tensor(True), torch.tensor(r != 1), torch.tensor(True)]
    paths = [[f"r{r}_a.jpg"], [f"r{r}_b.jpg", f"r{r}_c.jpg"], [f"r{r}_d.jpg"]]
    res = {"clean": None, "error": None}
    _check_finite([torch.tensor(True)], [["ok.jpg"]], 3)  # nobody bad: nobody raises
    res["clean"] = "passed"
    try:
        _check_finite(flags, paths, 3)
    except NonFiniteLossError as e:
        res["error"] = str(e)
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))
    """
)


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "nonfinite.py"
    script.write_text(NONFINITE_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    envs = _rank_envs()
    _run_pair([[sys.executable, str(script), str(out)]] * 2, envs)
    res = _results(out)
    assert [r["clean"] for r in res] == ["passed", "passed"]
    # The rank that saw it names the offending batch; the other stops at the same step.
    assert res[1]["error"] == (
        "non-finite loss in epoch 3; offending batch: r1_b.jpg, r1_c.jpg. "
        "Lower lr0, check these images' labels, or disable --amp"
    )
    assert res[0]["error"] == "non-finite loss on another rank in epoch 3; stopping"


# ---------------------------------------------------------------- in-process, no process group


@pytest.fixture
def clean_env():
    """Remove launcher variables for the test and restore the whole environment afterwards."""
    saved = dict(os.environ)
    for name in _LAUNCH_VARS:
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


def test_helpers_without_group() -> None:
    assert comm.get_rank() == 0 and comm.get_world_size() == 1
    d = {"a": torch.tensor(2.0)}
    assert comm.reduce_dict(d) == d
    assert comm.all_gather({"x": 1}) == [{"x": 1}]
    assert comm.broadcast_object("obj") == "obj"
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


def test_distinfo() -> None:
    info = process_group.DistInfo.single("cpu")
    assert info == process_group.DistInfo(0, 1, 0, torch.device("cpu"), None)
    assert not info.distributed and info.is_main
    with pytest.raises(AttributeError):
        info.rank = 1  # type: ignore[misc]
    assert process_group.DistInfo(1, 2, 1, torch.device("cpu"), "gloo").distributed
    assert not process_group.DistInfo(1, 2, 1, torch.device("cpu"), "gloo").is_main
    assert process_group.DistInfo(0, 1, 0, torch.device("cpu"), "gloo").distributed
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert process_group.DistInfo.single().device.type == expected


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


FAILURE_WORKER = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    from build_utils.errors import CheckpointError
    from train_utils.distributed import comm, process_group

    out = Path(sys.argv[1])
    info = process_group.init_distributed_mode(None, timeout_s=60)
    r = info.rank
    res = {}
    comm.raise_if_any_rank_failed(None, "nothing")  # nobody failed: nobody raises
    error = CheckpointError("cannot read", "/node1/last.pt") if r == 1 else None
    try:
        comm.raise_if_any_rank_failed(error, "--resume")
    except CheckpointError as e:
        res["error"] = str(e)
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))
    """
)


@pytest.mark.slow
def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "failure.py"
    script.write_text(FAILURE_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    envs = _rank_envs(SLURMD_NODENAME="node{rank}")
    _run_pair([[sys.executable, str(script), str(out)]] * 2, envs)
    errors = [r["error"] for r in _results(out)]
    assert errors == ["--resume failed on rank 1 (node1): /node1/last.pt: cannot read"] * 2


def test_raise_if_any_rank_failed_without_group() -> None:
    comm.raise_if_any_rank_failed(None, "x")
    with pytest.raises(ConfigError, match="^bad$"):
        comm.raise_if_any_rank_failed(ConfigError("bad"), "x")


@pytest.mark.parametrize(
    ("cpus", "procs", "expected"),
    [(16, 1, 8), (16, 2, 8), (16, 4, 4), (6, 4, 1), (2, 4, 0), (1, 1, 1), (64, 0, 8)],
)
def test_default_workers(cpus: int, procs: int, expected: int) -> None:
    assert node.default_workers(cpus, procs) == expected


def test_processes_per_node() -> None:
    assert node.processes_per_node({}) == 1
    assert node.processes_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert node.processes_per_node({"LOCAL_WORLD_SIZE": "x"}) == 1
    slurm = {"SLURM_PROCID": "5", "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}
    assert node.processes_per_node(slurm) == 3
    assert node.processes_per_node({**slurm, "LOCAL_WORLD_SIZE": "2"}) == 2
    # SLURM variables of an enclosing allocation do not count for a process SLURM did not start.
    assert node.processes_per_node({"SLURM_NTASKS_PER_NODE": "4"}) == 1


def test_resolve_workers(monkeypatch, caplog) -> None:
    assert node.resolve_workers(3) == 3 and node.resolve_workers(0) == 0  # explicit wins
    for name in ("SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(node, "usable_cpus", lambda: 12)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger=node.__name__):
        assert node.resolve_workers(None) == 6
    assert "--workers 6 (default: 12 usable CPU(s) / 2 process(es)" in caplog.text
    # Under SLURM the task's own CPUs are its share already.
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    with caplog.at_level(logging.INFO, logger=node.__name__):
        assert node.resolve_workers(None) == 4
    assert "SLURM_CPUS_PER_TASK=4" in caplog.text
    assert node.slurm_cpus_per_task({"SLURM_CPUS_PER_TASK": "4"}) is None  # not started by SLURM


def test_usable_cpus() -> None:
    assert 1 <= node.usable_cpus() <= (os.cpu_count() or 1)
