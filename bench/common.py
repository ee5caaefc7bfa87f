"""What the benchmark scripts share: the ``--json`` flag and the checks of their flags, the
machine a figure was measured on, the JSON report and child processes.

Each script's ``main`` is ``run_script(parser, command, argv)`` (``train_utils/cli.py``): a bad
flag is one ``error:`` line and exit status 2, before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from build_utils.atomic import make_output_dir, write_text
from train_utils.distributed.node import usable_cpus
from train_utils.memory_format import cpu_model

REPO = Path(__file__).resolve().parents[1]
# A launcher's description of its process group: a child torchrun would join the caller's group
# with it instead of starting its own.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
OUTPUT_TAIL_CHARS = 4000  # of a failed child's stdout and stderr, shown in the error


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser, described by its docstring's first paragraph, with ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    return p


def check_json(path: Path | None) -> None:
    """``--json``'s folder exists or can be made, checked before the run rather than at its end.

    Raises:
        OutputError: it cannot be made (a file where a folder should be, a read-only place).
    """
    if path is not None:
        make_output_dir(path.parent, "--json")


def flags_of(args: argparse.Namespace, *dests: str) -> dict[str, Any]:
    """``{"--flag-name": args.flag_name}`` for each of ``dests``: the values a check names."""
    return {"--" + dest.replace("_", "-"): getattr(args, dest) for dest in dests}


def machine_description(device: torch.device) -> dict[str, Any]:
    """CPU model, the ISA flags that decide bf16 speed, what oneDNN reports, and the GPU."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    bf16_native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    info = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "mkldnn_bf16": bool(bf16_native()) if bf16_native is not None else None,
        "torch": torch.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def machine_info(**settings: Any) -> dict[str, Any]:
    """A report's ``info``: :func:`machine_description` of the CPU, usable cores, ``settings``."""
    machine = platform.processor() or platform.machine()
    cpu = machine_description(torch.device("cpu"))
    return {**cpu, "machine": machine, "cores": usable_cpus(), **settings}


def write_report(path: Path | None, report: Mapping[str, Any]) -> None:
    """``report`` as indented JSON at ``path`` (``--json``; None: nowhere), written atomically.

    Raises:
        OutputError: ``path`` cannot be written.
    """
    if path is not None:
        write_text(path, json.dumps(report, indent=2) + "\n", "--json")


def as_argv(flags: Mapping[str, Any]) -> list[str]:
    """``{"--flag": value}`` as command-line words: ``["--flag", "value", ...]``."""
    return [word for flag, value in flags.items() for word in (flag, str(value))]


def torchrun(nproc: int) -> list[str]:
    """The command that starts ``nproc`` processes of a script on this node (append the script
    and its flags), as ``torchrun --standalone`` does."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def child_env(threads: int) -> dict[str, str]:
    """This process's environment for a measurement's child: ``threads`` OpenMP/MKL threads per
    process, and no launcher's process group."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_child(
    cmd: Sequence[str], env: Mapping[str, str], what: str, timeout: float | None = None
) -> str:
    """Run a measurement's process(es) from the repository root; their stdout.

    Raises:
        RuntimeError: it failed; the message ends with the end of its output.
    """
    proc = subprocess.run(
        cmd, cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        tail = proc.stdout[-OUTPUT_TAIL_CHARS:] + proc.stderr[-OUTPUT_TAIL_CHARS:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout
