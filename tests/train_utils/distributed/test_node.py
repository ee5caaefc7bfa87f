"""train_utils/distributed/node.py: the DataLoader workers and processes of a node, from its CPUs
and the launcher's variables."""

from __future__ import annotations

import logging
import os

import pytest

from train_utils.distributed import node


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
    for name in ("SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(node, "usable_cpus", lambda: 12)
    assert node.resolve_workers(3) == 3 and node.resolve_workers(0) == 0  # explicit wins
    # ... up to the CPUs (was: --workers 100000 started processes until memory ran out).
    with caplog.at_level(logging.WARNING, logger=node.__name__):
        assert node.resolve_workers(100000) == 12
    assert "--workers 100000: this process has 12 usable CPU(s); using 12" in caplog.text
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
