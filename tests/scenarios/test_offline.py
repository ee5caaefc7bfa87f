"""Nothing reaches the network: an export to every format (OpenVINO's telemetry included),
a training run, a validation and a prediction, each a process of its own, open no outbound
connection.

Each runs under ``strace -f`` recording ``connect``, ``sendto`` and ``sendmsg`` of the process
and every process it starts, and, where this machine allows it (root, or user namespaces), in a
network namespace of its own (``unshare -n``: only a loopback device, down), so that an attempt
cannot leave the machine even while it is recorded. An address that is not loopback, not a unix
socket and not a kernel socket fails the test with the line strace wrote. The tracer is checked
first on a Python one-liner that does connect. Without strace, or where ptrace is not allowed
(some containers), the test is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NANO_CFG, REPO_ROOT, script_env, train_argv

pytestmark = pytest.mark.slow

TRACED = "trace=connect,sendto,sendmsg"
TIMEOUT_S = 300
# Address families that never leave the machine: unix sockets, the kernel's netlink (the
# C library asks it for interfaces), and AF_UNSPEC (how a UDP socket is disconnected).
LOCAL_FAMILIES = {"AF_UNIX", "AF_LOCAL", "AF_NETLINK", "AF_UNSPEC"}
_FAMILY = re.compile(r"sa_family=(AF_\w+)")
_INET = re.compile(r'inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)"')


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def tracer() -> list[str]:
    """The command prefix that runs a command traced (and isolated, where it can)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (apt-get install strace)")
    base = [strace, "-f", "-qq", "-e", TRACED]
    if _works([*base, "--seccomp-bpf", "true"]):
        base.append("--seccomp-bpf")  # only the traced calls stop the process
    elif not _works([*base, "true"]):
        pytest.skip("strace cannot trace here (ptrace not permitted)")
    can_isolate = shutil.which("unshare") is not None and _works(["unshare", "-n", "true"])
    return [*(["unshare", "-n"] if can_isolate else []), *base]


def outbound(log: Path) -> list[str]:
    """The lines of a strace log that send to, or connect to, an address off this machine."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        family = _FAMILY.search(line)
        if family is None or family.group(1) in LOCAL_FAMILIES:
            continue  # no address (a connected socket), or one that stays here
        inet = _INET.search(line)
        if inet is not None and ipaddress.ip_address(inet.group(1) or inet.group(2)).is_loopback:
            continue
        found.append(line.strip())
    return found


def run_traced(tracer: list[str], tmp_path: Path, name: str, cmd: list[str]) -> list[str]:
    """Run ``cmd`` under ``tracer``, expect exit 0, return its outbound lines."""
    log = tmp_path / f"{name}.strace"
    proc = subprocess.run(
        [*tracer, "-o", str(log), *cmd],
        cwd=REPO_ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    return outbound(log)


def script(name: str, *args: str | Path) -> list[str]:
    return [sys.executable, str(REPO_ROOT / name), *map(str, args)]


def test_the_tracer_sees_an_outbound_connection(tracer, tmp_path) -> None:
    code = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(0.5)\n"
        "try: s.connect(('192.0.2.1', 443))\n"  # TEST-NET-1: never routed
        "except OSError: pass\n"
    )
    found = run_traced(tracer, tmp_path, "probe", [sys.executable, "-c", code])
    assert len(found) == 1 and "192.0.2.1" in found[0], found


def test_export_train_validate_predict_stay_offline(tracer, make_shapes_data, tmp_path) -> None:
    data = make_shapes_data(n_train=4, n_val=2)
    run = tmp_path / "run"
    formats = ["torchscript"]
    formats += [f for f, m in (("onnx", "onnxruntime"), ("openvino", "openvino")) if _has(m)]
    image = sorted((data.parent / "val" / "images").glob("*.jpg"))[0]
    steps = {
        "train": script("train.py", *train_argv(data, run, "--tracker", "none", img=64)),
        "export": script(
            "tools/export.py", "--cfg", NANO_CFG, "--img-size", "64", "-o", tmp_path / "exports",
            "--include", *formats,
        ),
        "validation": script(
            "validation.py", "--weights", run / "last.pt", "--save-dir", tmp_path / "val",
            "--device", "cpu", "--workers", "0",
        ),
        "predict": script(
            "predict.py", "--weights", run / "last.pt", "--source", image,
            "--output", tmp_path / "pred", "--device", "cpu",
        ),
    }  # fmt: skip
    found = {name: run_traced(tracer, tmp_path, name, cmd) for name, cmd in steps.items()}
    assert found == {name: [] for name in steps}
    assert len(list((tmp_path / "exports").iterdir())) == len(formats)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
