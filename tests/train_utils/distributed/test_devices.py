"""train_utils/distributed/devices.py: the device policy, as a pure function of request, GPUs
and rank."""

from __future__ import annotations

import pytest
import torch

from build_utils.errors import ConfigError
from train_utils.distributed.devices import choose_device, parse_device_list, select_device

CPU = torch.device("cpu")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


@pytest.mark.parametrize(
    ("spec", "count", "local_rank", "expected"),
    [
        # one process
        ("", 0, None, CPU),
        ("cpu", 0, None, CPU),
        ("CPU ", 4, None, CPU),
        ("", 2, None, cuda(0)),
        ("cuda", 2, None, cuda(0)),
        ("1", 2, None, cuda(1)),
        ("cuda:1", 2, None, cuda(1)),
        # under a launcher: the local rank's GPU ...
        ("", 4, 0, cuda(0)),
        ("", 4, 3, cuda(3)),
        ("cuda", 4, 2, cuda(2)),
        # ... unless the process sees exactly one (SLURM --gpus-per-task=1, --gpu-bind)
        ("", 1, 0, cuda(0)),
        ("", 1, 5, cuda(0)),
        ("cpu", 4, 1, CPU),
        ("", 0, 3, CPU),
    ],
)
def test_choose_device(spec: str, count: int, local_rank: int | None, expected) -> None:
    choice = choose_device(spec, count, local_rank)
    assert choice.device == expected and choice.note is None


def test_an_explicit_gpu_under_a_launcher_is_overridden_with_a_note() -> None:
    choice = choose_device("cuda:1", 4, 0)
    assert choice.device == cuda(0)
    assert "CUDA_VISIBLE_DEVICES" in choice.note and "cuda:0" in choice.note
    # Asking for the GPU the rank would get anyway says nothing.
    assert choose_device("cuda:2", 4, 2).note is None


@pytest.mark.parametrize(
    ("spec", "count", "local_rank", "message"),
    [
        ("cuda", 0, None, "asks for CUDA but no CUDA device is visible"),
        ("0", 0, None, "asks for CUDA"),
        ("cuda:3", 0, 1, "asks for CUDA"),
        ("cuda:2", 2, None, r"only 2 CUDA device\(s\) are visible"),
        ("", 2, 2, "local rank 2 but 2 CUDA devices are visible"),
        ("gpu", 1, None, "'gpu' is not a device"),
        ("mps", 1, None, "only CPU and CUDA devices are supported"),
    ],
)
def test_choose_device_refuses(spec: str, count: int, local_rank: int | None, message: str):
    with pytest.raises(ConfigError, match=message):
        choose_device(spec, count, local_rank)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("0", None),
        ("", None),
        ("cuda:1", None),
        ("0,1", [0, 1]),
        (" 2, 3 ", [2, 3]),
        ("1,0", [1, 0]),
    ],
)
def test_parse_device_list(spec: str, expected: list[int] | None) -> None:
    assert parse_device_list(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [("0,0", "lists a GPU twice"), ("cpu,cpu", "GPU indices only"), ("0,", "GPU indices only")],
)
def test_parse_device_list_refuses(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_device_list(spec)


@pytest.mark.parametrize(
    ("spec", "count", "local_rank", "expected"),
    [
        # local rank i -> the i-th listed GPU, not GPU i (no CUDA_VISIBLE_DEVICES needed)
        ("2,3", 4, 0, cuda(2)),
        ("2,3", 4, 1, cuda(3)),
        ("1,0", 2, 0, cuda(1)),
        ("3", 4, None, cuda(3)),  # a one-entry list is that GPU
    ],
)
def test_choose_device_from_a_gpu_list(spec, count, local_rank, expected) -> None:
    choice = choose_device(spec, count, local_rank)
    assert choice.device == expected and choice.note is None


@pytest.mark.parametrize(
    ("spec", "count", "local_rank", "message"),
    [
        ("0,1", 0, 0, "asks for CUDA but no CUDA device is visible; use --device cpu"),
        ("0,2", 2, 0, r"GPU 2 does not exist; only 2 CUDA device\(s\) are visible"),
        ("0,1", 2, None, "lists 2 GPUs, one process each"),
        ("0,1", 4, 2, r"local rank 2 but --device 0,1 lists 2 GPU\(s\)"),
    ],
)
def test_choose_device_from_a_gpu_list_refuses(spec, count, local_rank, message) -> None:
    with pytest.raises(ConfigError, match=message):
        choose_device(spec, count, local_rank)


def test_select_device_on_this_machine() -> None:
    assert select_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device("").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            select_device("cuda:0")


@pytest.mark.cuda
def test_select_device_makes_the_gpu_current() -> None:
    last = torch.cuda.device_count() - 1
    assert select_device(str(last)) == cuda(last)
    assert torch.cuda.current_device() == last


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend this process sees ``n`` GPUs; records the devices made current."""
    from train_utils.distributed import devices

    current: list[torch.device] = []

    def install(n: int) -> list[torch.device]:
        monkeypatch.setattr(devices, "cuda_device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
        return current

    return install


@pytest.mark.parametrize(("spec", "expected"), [("cuda:1", cuda(1)), ("1", cuda(1)), ("", cuda(0))])
def test_select_device_makes_the_chosen_gpu_current(fake_gpus, spec, expected) -> None:
    """train.py --device cuda:1 / --device 1: pinned memory and the CUDA context follow."""
    current = fake_gpus(2)
    assert select_device(spec) == expected
    assert current == [expected]


def test_one_visible_gpu_per_task_is_used_by_every_local_rank(fake_gpus, caplog) -> None:
    """SLURM --gpus-per-task=1: local rank 3 sees one GPU, its own, as cuda:0."""
    current = fake_gpus(1)
    assert select_device("", local_rank=3) == cuda(0)
    assert current == [cuda(0)]
    with caplog.at_level("WARNING"):
        assert select_device("cuda:1", local_rank=3) == cuda(0)
    assert "CUDA_VISIBLE_DEVICES" in caplog.text


def test_an_existing_nccl_group_still_sets_the_device(fake_gpus, monkeypatch) -> None:
    from train_utils.distributed import comm, process_group

    current = fake_gpus(4)
    monkeypatch.setattr(comm.dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(process_group, "get_rank", lambda: 2)
    monkeypatch.setattr(process_group, "get_world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    info = process_group._describe_existing_group(None)
    assert (info.rank, info.local_rank, info.device, info.backend) == (2, 2, cuda(2), "nccl")
    assert current == [cuda(2)]
    with pytest.raises(ConfigError, match="uses NCCL"):
        process_group._describe_existing_group(
            type("Args", (), {"device": "cpu", "local_rank": -1})()
        )


@pytest.mark.parametrize(
    ("spec", "count", "local_rank", "nodes", "expected"),
    [
        ("", 1, 0, 1, cuda(0)),  # torchrun --nproc_per_node=1 on one GPU
        ("", 4, 3, 4, cuda(3)),
        ("", 1, 3, None, cuda(0)),  # SLURM --gpus-per-task=1: each task sees its own GPU
        ("cpu", 1, 1, 2, CPU),  # CPU processes: gloo, no GPU to share
        ("", 0, 1, 2, CPU),
    ],
)
def test_processes_that_share_the_gpus_fit_them(spec, count, local_rank, nodes, expected) -> None:
    assert choose_device(spec, count, local_rank, nodes).device == expected


@pytest.mark.parametrize(("count", "local_rank", "nodes"), [(1, 0, 2), (1, 1, 2), (2, 0, 3)])
def test_more_torchrun_processes_than_gpus_is_one_line_on_every_rank(count, local_rank, nodes):
    # Was: with one GPU every rank took cuda:0 and NCCL failed with "Duplicate GPU detected";
    # with two GPUs and three processes only rank 2 said why.
    message = (
        rf"^{nodes} processes on this node \(torchrun --nproc_per_node\) but only {count} CUDA "
        r"device\(s\) are visible: start at most one process per GPU, or use --device cpu"
    )
    with pytest.raises(ConfigError, match=message):
        choose_device("", count, local_rank, nodes)


def test_torchrun_processes_share_the_gpus_and_slurm_tasks_may_not() -> None:
    from train_utils.distributed.process_group import processes_sharing_gpus

    env = {"LOCAL_WORLD_SIZE": "2"}
    assert processes_sharing_gpus("torchrun", env) == 2
    assert processes_sharing_gpus("torch.distributed.launch", env) == 2
    assert processes_sharing_gpus("SLURM", env) is None
    assert processes_sharing_gpus("torchrun", {}) is None
    assert processes_sharing_gpus("torchrun", {"LOCAL_WORLD_SIZE": "x"}) is None


def test_select_device_refuses_two_torchrun_processes_on_one_gpu(fake_gpus) -> None:
    current = fake_gpus(1)
    with pytest.raises(ConfigError, match="2 processes on this node"):
        select_device("", local_rank=1, node_processes=2)
    assert current == []  # nothing made current


def test_torchrun_with_two_processes_on_one_gpu_stops_before_the_process_group(
    fake_gpus, monkeypatch
) -> None:
    """`torchrun --nproc_per_node=2` on a one-GPU machine: the line, before NCCL is reached."""
    from train_utils.distributed import process_group

    fake_gpus(1)

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group was initialised")

    monkeypatch.setattr(process_group, "_init_process_group", reached)
    variables = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="2 processes on this node .* only 1 CUDA device"):
        process_group.init_distributed_mode(None)


@pytest.mark.cuda
def test_more_processes_than_the_visible_gpus_are_refused_here() -> None:
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"{n + 1} processes on this node"):
        select_device("", local_rank=0, node_processes=n + 1)
    assert select_device("", local_rank=n - 1, node_processes=n) == cuda(n - 1)
