"""train_utils/distributed/slurm.py: SLURM's compressed node and task lists."""

from __future__ import annotations

import pytest

from build_utils.errors import ConfigError
from train_utils.distributed.slurm import expand_nodelist, expand_tasks_per_node, tasks_on_this_node


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("10.0.0.5", ["10.0.0.5"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("gpu[09-11]", ["gpu09", "gpu10", "gpu11"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("n[8-10]-ib", ["n8-ib", "n9-ib", "n10-ib"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("login1, gpu[1,3]", ["login1", "gpu1", "gpu3"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-04", "gpu01-04]", "gpu[a-b]", "gpu[4-1]", "", " , "])
def test_expand_nodelist_refuses(bad: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


@pytest.mark.parametrize(
    ("tasks", "counts"),
    [("8", [8]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2])],
)
def test_expand_tasks_per_node(tasks: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(tasks) == counts


@pytest.mark.parametrize("bad", ["", "2(3)", "x2", "2(x)"])
def test_expand_tasks_per_node_refuses(bad: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(bad)


def test_tasks_on_this_node() -> None:
    assert tasks_on_this_node({}) is None
    assert tasks_on_this_node({"SLURM_NTASKS_PER_NODE": "8"}) == 8
    uneven = {"SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert tasks_on_this_node(uneven) == 2  # node 0 when SLURM_NODEID is missing
    assert tasks_on_this_node({**uneven, "SLURM_NODEID": "3"}) == 1
    # --ntasks-per-node wins over the derived list.
    assert tasks_on_this_node({**uneven, "SLURM_NTASKS_PER_NODE": "4"}) == 4
