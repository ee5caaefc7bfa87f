"""train_utils/distributed/launch.py: torch.multiprocessing.spawn launching, its pure parts and
one CPU run."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import read_results, script_env, train_argv, validate_run

import train
from build_utils.errors import ConfigError
from train_utils.distributed import launch
from train_utils.distributed.launch import (
    SPAWN_MASTER_ADDR,
    free_port,
    processes_to_spawn,
    spawn_devices,
    spawn_env,
)

REPO = Path(__file__).resolve().parents[3]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind((SPAWN_MASTER_ADDR, port))


def test_spawn_env_is_what_torchrun_sets_on_one_node():
    assert spawn_env(1, 2, 29511) == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }


@pytest.mark.parametrize(
    ("nproc", "device", "expected"),
    [
        (None, "", 0),
        (None, "cpu", 0),
        (1, "cpu", 0),
        (2, "cpu", 2),
        (None, "0,1", 2),
        (2, "0,1", 2),
        (None, "0", 0),
        (None, "3,", None),  # not a list of indices: an error, see below
    ],
)
def test_processes_to_spawn(nproc, device, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="GPU indices only"):
            processes_to_spawn(nproc, device, {})
    else:
        assert processes_to_spawn(nproc, device, {}) == expected


def test_processes_to_spawn_refuses_under_a_launcher():
    with pytest.raises(ConfigError, match="started by torchrun, which already chose"):
        processes_to_spawn(2, "cpu", TORCHRUN_ENV)
    with pytest.raises(ConfigError, match="started by SLURM"):
        processes_to_spawn(4, "", {"SLURM_PROCID": "1"})
    # One process per node is what the launcher does anyway; a GPU list maps local ranks.
    assert processes_to_spawn(1, "cpu", TORCHRUN_ENV) == 0
    assert processes_to_spawn(None, "0,1", TORCHRUN_ENV) == 0


def test_processes_to_spawn_bad_counts(monkeypatch):
    with pytest.raises(ConfigError, match="--nproc-per-node must be >= 1, got 0"):
        processes_to_spawn(0, "cpu", {})
    # Was: 1000 gloo ranks started on 2 CPUs and hung.
    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    monkeypatch.setattr(launch, "cuda_device_count", lambda: 0)
    with pytest.raises(ConfigError, match="1000 is more than this machine has: 2 usable CPU"):
        processes_to_spawn(1000, "cpu", {})
    assert processes_to_spawn(2, "cpu", {}) == 2
    with pytest.raises(ConfigError, match="--nproc-per-node 3 but --device 0,1 lists 2 GPUs"):
        processes_to_spawn(3, "0,1", {})


def test_spawn_devices():
    cpu, cuda = torch.device("cpu"), torch.device
    assert spawn_devices("cpu", 2, 4) == [cpu, cpu]
    assert spawn_devices("", 2, 0) == [cpu, cpu]
    assert spawn_devices("", 2, 2) == [cuda("cuda", 0), cuda("cuda", 1)]
    assert spawn_devices("3,1", 2, 4) == [cuda("cuda", 3), cuda("cuda", 1)]
    with pytest.raises(ConfigError, match=r"only 1 CUDA device\(s\) are visible"):
        spawn_devices("", 2, 1)  # both would land on cuda:0
    with pytest.raises(ConfigError, match="local rank 2 but 2 CUDA devices"):
        spawn_devices("", 3, 2)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        spawn_devices("0,1", 2, 0)


def test_train_py_gpu_list_without_cuda_is_one_line(monkeypatch, tmp_path, console):
    monkeypatch.setattr("train_utils.distributed.launch.cuda_device_count", lambda: 0)
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    code = train.main(["--device", "0,1", "--output-dir", str(tmp_path / "x")])
    err = console.readouterr().err
    assert code == 2
    assert "error: --device 0,1 asks for CUDA but no CUDA device is visible" in err
    assert not (tmp_path / "x").exists()


def _spawn(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = script_env()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    cmd = [sys.executable, str(REPO / "train_multi_GPU.py"), "--nproc-per-node", "2", *args]
    return warm_python.run(cmd, cwd=REPO, env=env, timeout=timeout)


@pytest.mark.slow
def test_spawned_training_map_equals_validation(make_shapes_data, tmp_path):
    """2 spawned gloo processes train 1 epoch; the mAP in results.csv equals validation.py's
    on last.pt."""
    data = make_shapes_data(n_train=16, n_val=4)
    out = tmp_path / "spawned"
    proc = _spawn(train_argv(data, out, img=64))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spawning 2 processes on this node (cpu, cpu)" in proc.stderr
    assert "device cpu x 2 process(es)" in proc.stderr
    rows = read_results(out / "results.csv")
    assert [r["epoch"] for r in rows] == ["0"]
    single = validate_run(data, out, tmp_path)
    for key, value in single.items():
        assert float(rows[-1][key]) == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_a_child_error_comes_back_as_one_line(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=4, n_val=2)
    missing = tmp_path / "missing.cfg"
    proc = _spawn(train_argv(data, tmp_path / "out", cfg=missing))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == [f"error: {missing}: model cfg not found; pass an existing .cfg to --cfg"]
    assert "Traceback" not in proc.stderr


def test_spawned_processes_share_the_cpus(monkeypatch) -> None:
    monkeypatch.setattr(launch, "usable_cpus", lambda: 8)
    assert launch.threads_per_process(2, {}) == 4
    assert launch.threads_per_process(3, {}) == 2
    assert launch.threads_per_process(16, {}) == 1
    # The user's OMP_NUM_THREADS wins; nonsense is ignored.
    assert launch.threads_per_process(2, {"OMP_NUM_THREADS": "3"}) == 3
    assert launch.threads_per_process(2, {"OMP_NUM_THREADS": "x"}) == 4


@pytest.mark.parametrize(
    ("env", "joins"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True),  # torchrun, 2 processes
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, True),  # srun, 4 tasks
        ({"RANK": "0", "WORLD_SIZE": "1"}, False),  # a launcher with one process: as alone
        ({}, False),
    ],
)
def test_train_py_under_a_launcher_joins_its_ddp_run(monkeypatch, env, joins):
    """``torchrun --nproc_per_node 2 train.py`` (YOLOv5's DDP command) joins one DDP run, as
    train_multi_GPU.py does, instead of starting one separate run per process (which raced for
    one run folder: the second stopped at its run.lock)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(train, "train_distributed", lambda args: calls.append("ddp"))
    monkeypatch.setattr(train, "build_config", lambda args: calls.append("single") or args)
    monkeypatch.setattr(train, "run", lambda config, dist: None)
    monkeypatch.setattr(train, "select_device", lambda device: None)
    monkeypatch.setattr(train.DistInfo, "single", staticmethod(lambda device: None))
    assert train.main(["--device", "cpu"]) == 0
    assert calls == (["ddp"] if joins else ["single"])


def test_the_configuration_is_checked_before_spawning(tmp_path, monkeypatch, capsys):
    """Was: ``train_multi_GPU.py --nproc-per-node 2 --data missing.data`` started both ranks,
    each of which then reported the missing file. Now one line before any process starts."""
    import train_multi_GPU

    spawned = []
    monkeypatch.setattr(launch.mp, "start_processes", lambda *a, **k: spawned.append(a))
    argv = train_argv(tmp_path / "missing.data", tmp_path / "run", "--nproc-per-node", "2")
    assert train_multi_GPU.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.data" in err[0] and err[0].startswith("error: ")
    assert spawned == [] and not (tmp_path / "run").exists()


def test_a_rank_killed_by_a_signal_is_one_line(shapes_data, tmp_path, monkeypatch, capsys):
    """Was: a spawned rank killed (SIGKILL, the OOM killer) ended train_multi_GPU.py with torch's
    ProcessExitedException traceback. Now one line and exit status 1."""
    import train_multi_GPU

    class KilledRank:
        def join(self) -> bool:
            raise launch.mp.ProcessExitedException(
                "process 1 terminated with signal SIGKILL",
                error_index=1,
                error_pid=4242,
                exit_code=-9,
                signal_name="SIGKILL",
            )

    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    monkeypatch.setattr(launch.mp, "start_processes", lambda *a, **k: KilledRank())
    argv = train_argv(shapes_data, tmp_path / "run", "--nproc-per-node", "2", "--device", "cpu")
    assert train_multi_GPU.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "error: rank 1 (pid 4242) was killed by SIGKILL; the other ranks were stopped: "
        "--resume continues from the last saved epoch"
    )


def test_ranks_start_from_a_forkserver_that_imported_torch_else_spawn(monkeypatch) -> None:
    """Never a fork of the launching process; the forkserver (torch imported once for every
    rank) where the platform has one, spawn where it has not (Windows)."""
    assert launch._start_method() == "forkserver"
    assert {"torch", "torchvision"} <= set(launch.FORKSERVER_PRELOAD)
    monkeypatch.setattr(launch.mp, "get_all_start_methods", lambda: ["spawn"])
    assert launch._start_method() == "spawn"


@pytest.mark.parametrize("bad", ["-5", "0", "inf", "nan"])
def test_a_dist_timeout_that_is_no_positive_number_is_one_line(bad, capsys):
    import train_multi_GPU

    # Was: accepted, then c10d's and the spawn's tracebacks (exit 1).
    assert train_multi_GPU.main(["--dist-timeout", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        f"--dist-timeout must be a positive number of seconds, got {float(bad)}"
    )
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize(
    ("env", "restarted"),
    [
        ({}, False),
        ({"TORCHELASTIC_RESTART_COUNT": "1"}, True),
        ({"SLURM_RESTART_COUNT": "2"}, True),  # a requeue (scontrol requeue, a node failure)
        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, False),
        ({"SLURM_RESTART_COUNT": "x"}, False),
    ],
)
def test_a_slurm_requeue_counts_as_a_restart(monkeypatch, env, restarted):
    """A requeued job whose first attempt wrote a numbered folder resumes there, as a torchrun
    restart does (was: only torchrun's count was read)."""
    from train_utils.distributed import launch

    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch._restarted() is restarted
