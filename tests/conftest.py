"""Shared fixtures and helpers: tiny generated datasets, the repository root, the optional
../shared folder, the command lines of short training and validation runs, and the launch of
two-rank gloo groups running a worker program of tests/workers/.

Test modules import the helpers with ``from conftest import ...`` (pytest puts tests/ on the
path); the fixtures need no import. Scripts that a test runs as processes of their own start
through ``warm_python`` (forked from an interpreter that has imported torch once: the suite's
start-up seconds), except launchers such as torchrun and tests about start-up itself.
"""

from __future__ import annotations

import os

# Every test, and every process a test starts, computes as on an AVX2-only CPU (the one the
# suite's figures were made on), whatever CPU runs it: oneDNN's AVX-512/AMX kernels would round
# differently, and on a CPU with bf16 arithmetic `--amp auto` could time bf16 faster and train
# in it (train_utils/precision.py honours this cap). tests/train_utils/test_cpu_bf16.py covers
# the bf16 policy by stating the CPU it assumes.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import csv
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_python
from cuda_marker import pytest_runtest_setup  # noqa: F401 (the cuda marker's hook)

from data.make_shapes import make_dataset
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.launch import free_port
from train_utils.distributed.process_group import DistInfo
from train_utils.trainer import run

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
NANO_CFG = REPO_ROOT / "cfg" / "yolov3-spp-nano.cfg"
HYP_YAML = REPO_ROOT / "cfg" / "hyp.yaml"
LAUNCH_TIMEOUT_S = 90  # one two-rank worker run, set-up included
# Launcher variables that must not leak from the test runner's environment into launched ranks.
LAUNCH_VARS = (
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


# ---------------------------------------------------------------- the order files are handed out

# The files that take longest, first: ``--dist loadfile`` with ``--no-loadscope-reorder``
# (pyproject.toml) hands files to the pytest workers in collection order, so a long file
# collected last keeps one worker busy while the other idles (longest first is the classic
# schedule for this). A file missing here, or one that has
# become quick, only costs that order its benefit, never a test. Paths from the repository
# root, longest first (pytest --durations=0, summed per file; two CI runs of 2026-11-27).
SLOWEST_FILES = (
    "tests/models/test_darknet_opencv.py",
    "tests/scenarios/test_evolve.py",
    "tests/scripts/test_gpu_check.py",
    "tests/scripts/test_bench_smoke.py",
    "tests/scenarios/test_evolve_ray.py",
    "tests/project/test_readme_commands.py",
    "tests/train_utils/test_trackers.py",
    "tests/scenarios/test_darknet_training.py",
    "tests/scenarios/test_ddp_launches.py",
    "tests/scripts/test_yolov5_flags.py",
    "tests/scenarios/test_offline.py",
    "tests/scenarios/test_ddp_exact_eval.py",
    "tests/scenarios/test_resume_changes.py",
    "tests/scenarios/test_reliability_data.py",
    "tests/project/test_warm_python.py",
    "tests/scripts/test_train.py",
    "tests/scenarios/test_reliability_checkpoints.py",
    "tests/scenarios/test_ddp.py",
    "tests/models/test_darknet.py",
    "tests/train_utils/test_plan.py",
    "tests/scripts/test_export_formats.py",
    "tests/build_utils/test_shared_images.py",
    "tests/scenarios/test_darknet_recipe_runs.py",
    "tests/scripts/test_demo.py",
    "tests/scripts/test_validation_cli.py",
    "tests/scripts/test_self_describing.py",
    "tests/scenarios/test_hostile_input.py",
    "tests/models/test_darknet_loss.py",
    "tests/scenarios/test_reliability_config.py",
    "tests/models/test_budget.py",
    "tests/scenarios/test_reliability_interrupt.py",
    "tests/project/test_suite_guards.py",
    "tests/scripts/test_tools_model.py",
    "tests/train_utils/distributed/test_launch.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOWEST_FILES' tests first, in that order; every other file after them, as collected
    (a stable sort: the order within a file never changes)."""
    rank = {path: k for k, path in enumerate(SLOWEST_FILES)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(rank))

    items.sort(key=key)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A report's captured output naming a file whose name is not UTF-8 (the byte 0xe9 read as
    the lone surrogate U+DCE9) carries it escaped (``\\udce9``): pytest-xdist sends reports to
    the controller as UTF-8, and a lone surrogate in one stopped the whole run (INTERNALERROR)."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, _utf8(text)) for title, text in report.sections]


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------- command lines of short runs


def run_with_model_cfg(folder: Path, cfg_text: str) -> Path:
    """A training run's folder (results.csv and last.pt) holding ``model.cfg``; its path."""
    folder.mkdir()
    (folder / "results.csv").write_text("epoch,mAP50\n0,0.5\n")
    (folder / "last.pt").write_bytes(b"checkpoint")
    (folder / "model.cfg").write_text(cfg_text)
    return folder / "model.cfg"


def give_non_utf8_name(image: Path) -> Path:
    """Rename ``image`` and its label file (``images`` -> ``labels``, ``.txt``) to ``bad\\xe9name``:
    a name that is not UTF-8, as Python sees it (``bad\\udce9name``). Skips the test where the
    file system refuses such names (macOS, Windows)."""
    stem = os.fsdecode(b"bad\xe9name")
    label = image.parent.parent / "labels" / f"{image.stem}.txt"
    new = image.with_name(stem + image.suffix)
    try:
        image.rename(new)
    except OSError as e:
        pytest.skip(f"this file system refuses names that are not UTF-8 ({e})")
    label.rename(label.with_name(f"{stem}.txt"))
    return new


def train_argv(
    data: Path,
    out: Path | None,
    *extra: str,
    cfg: Path | str = NANO_CFG,
    hyp: Path | str | None = HYP_YAML,
    epochs: int | None = 1,
    batch: int | None = 4,
    img: int | str | None = 128,
    nbs: int | None = None,
    multi_scale: bool | None = False,
    workers: int | None = 0,
    device: str | None = "cpu",
    plots: bool = False,
    channels_last: bool | None = False,
) -> list[str]:
    """``train.py``'s arguments for a short CPU run of ``cfg`` on ``data`` into ``out``.

    The defaults are the tests' common run: yolov3-spp-nano, cfg/hyp.yaml, 1 epoch, batch 4 at
    128 px, no multi-scale, no DataLoader workers, no pictures (``--noplots``: drawing them is
    most of such a run's time, see bench/README.md "Test suite"; ``plots=True`` for the tests
    that look at them), contiguous memory (``--no-channels-last``: the timed choice is not
    cached on a busy machine, so two runs that tests compare bit for bit could each choose
    another format, whose rounding differs; ``channels_last=None`` for the timed choice). A keyword
    set to None leaves its flag out (the parser's default). ``extra`` comes last, so a flag there
    also wins over an earlier one.
    """
    argv = ["--data", str(data), "--cfg", str(cfg)]
    if out is not None:  # None: the run folder comes from ``extra`` (--project/--name)
        argv += ["--output-dir", str(out)]
    flags = {
        "--hyp": hyp,
        "--epochs": epochs,
        "--batch-size": batch,
        "--img-size": img,
        "--nbs": nbs,
        "--workers": workers,
        "--device": device,
    }
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, str(value)]
    if multi_scale is not None:
        argv.append("--multi-scale" if multi_scale else "--no-multi-scale")
    if channels_last is not None:
        argv.append("--channels-last" if channels_last else "--no-channels-last")
    if not plots:
        argv.append("--noplots")
    return [*argv, *extra]


def validation_argv(
    cfg: Path | str,
    data: Path,
    weights: Path,
    *extra: str,
    img: int | str = 128,
    batch: int | None = 4,
    workers: int = 0,
    device: str = "cpu",
    plots: bool = False,
) -> list[str]:
    """``validation.py``'s arguments for scoring ``weights`` on ``data``'s validation split on the
    CPU; ``batch=None`` leaves ``--batch-size`` out; no pictures unless ``plots`` (as
    :func:`train_argv`). ``extra`` comes last."""
    argv = ["--cfg", str(cfg), "--data", str(data), "--weights", str(weights)]
    argv += ["--img-size", str(img), "--device", device, "--workers", str(workers)]
    if batch is not None:
        argv += ["--batch-size", str(batch)]
    if not plots:
        argv.append("--no-plots")
    return [*argv, *extra]


def run_training(argv: list[str]):
    """Train in this process as ``train.py argv`` would on one CPU process; the run's summary."""
    config = build_config(get_args_parser().parse_args(argv))
    return run(config, DistInfo.single(torch.device("cpu")))


def read_results(path: Path) -> list[dict[str, str]]:
    """The rows of a run's ``results.csv``, one dict per evaluated epoch."""
    with path.open() as f:
        return list(csv.DictReader(f))


def script_env() -> dict[str, str]:
    """This environment for a script run as a process: one OpenMP thread, unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def validate_run(data: Path, out: Path, tmp_path: Path, img: int = 64) -> dict[str, float]:
    """``validation.py`` (a process of its own) on the run in ``out`` (its model.cfg and last.pt)
    over ``data``'s validation split; the stats it writes with ``--json-out``."""
    stats = tmp_path / "stats.json"
    argv = validation_argv(out / "model.cfg", data, out / "last.pt", img=img)
    argv += ["--save-dir", str(tmp_path / "val"), "--json-out", str(stats)]
    cmd = [sys.executable, str(REPO_ROOT / "validation.py"), *argv]
    proc = warm_python.run(cmd, cwd=REPO_ROOT, env=script_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(stats.read_text())


# ---------------------------------------------------------------- two-rank gloo groups


def worker_cmd(name: str, *args: str | Path) -> list[str]:
    """The command that runs the worker program ``tests/workers/<name>.py`` as a module (from the
    repository root, or with it on PYTHONPATH, as :func:`base_env` sets)."""
    return [sys.executable, "-m", f"tests.workers.{name}", *map(str, args)]


def base_env() -> dict[str, str]:
    """This environment without launcher variables, one thread, no GPU, the repository on
    PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two ranks share two cores with other test runs
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def pair_envs(variables: Mapping[str, str]) -> list[dict[str, str]]:
    """Environments of ranks 0 and 1 of a one-node group: ``variables`` (values may name
    ``{rank}`` and ``{port}``, a free loopback port shared by both) over :func:`base_env`."""
    port = str(free_port())
    return [
        {**base_env(), **{k: v.format(rank=rank, port=port) for k, v in variables.items()}}
        for rank in range(2)
    ]


def rank_envs(**extra: str) -> list[dict[str, str]]:
    """torchrun's variables for ranks 0 and 1 of a one-node group on a free loopback port;
    ``extra`` values may name ``{rank}``."""
    torchrun = {
        "RANK": "{rank}",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "{rank}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "{port}",
    }
    return pair_envs({**torchrun, **extra})


def wait_all(procs: list[warm_python.WarmProcess], timeout: float) -> None:
    """Wait for ``procs`` together, ``timeout`` seconds in all; kill whatever is left then."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# Operators that make the host wait for a CUDA device: a value read back, or an output whose
# size depends on the data (boolean-mask indexing runs nonzero inside the kernel).
_SYNCING_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select"}
_INDEXING_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def host_syncs(fn) -> list[str]:
    """The operators of ``fn()`` that would make the host wait for the device on CUDA, in call
    order, recorded where it runs (the CPU): a GPU-only cost checked without a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            bool_index = name in _INDEXING_OPS and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in leaves[1:]
            )
            if name in _SYNCING_OPS or bool_index:
                found.append(name)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return found


def run_fresh_ranks(
    cmd: list[str], envs: list[dict[str, str]], timeout: float = LAUNCH_TIMEOUT_S
) -> list[tuple[int, str, str]]:
    """``cmd`` as one fresh interpreter per rank environment (from the repository root, not
    forked warm: for what start-up itself decides), together; (exit status, stdout, stderr) of
    each. Whatever is left at ``timeout`` is killed."""
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def run_warm_ranks(
    commands: list[list[str]], envs: list[dict[str, str]], timeout: float = LAUNCH_TIMEOUT_S
) -> list[tuple[int, str, str]]:
    """One process per command and environment, forked warm (from the repository root),
    together; (exit status, stdout, stderr) of each. Whatever is left at ``timeout`` is killed."""
    procs = [
        warm_python.start(cmd, cwd=REPO_ROOT, env=env)
        for cmd, env in zip(commands, envs, strict=True)
    ]
    wait_all(procs, timeout)
    return [(p.returncode, *p.output()) for p in procs]


def run_pair(
    commands: list[list[str]], envs: list[dict[str, str]], timeout: float = LAUNCH_TIMEOUT_S
) -> None:
    """Start one process per command at once (from the repository root) and fail with their
    output if any fails."""
    results = run_warm_ranks(commands, envs, timeout)
    for cmd, (code, stdout, stderr) in zip(commands, results, strict=True):
        assert code == 0, f"{cmd} failed:\n{stdout}\n{stderr}"


# ---------------------------------------------------------------- launchers (scenarios/test_ddp*)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# torchrun with warm ranks: the launcher is forked warm (tests/warm_python.py) and forks each
# rank from itself (--start-method fork), which runs the script, given by its absolute path, in
# that interpreter (--run-path). A fresh rank spends ~5 CPU-s importing torch and torchvision
# before the script's first line; this one does not (bench/README.md "Test suite"). For tests
# whose subject is what the ranks do; those about how a launch starts its processes
# (rendezvous, a killed launch, the launcher's environment) use TORCHRUN.
WARM_TORCHRUN = [*TORCHRUN, "--run-path", "--start-method", "fork"]


def _starts_warm(cmd: list[str]) -> bool:
    """Whether ``cmd`` is started forked warm: a script, or a launch with warm ranks."""
    return cmd[1].endswith(".py") or cmd[: len(WARM_TORCHRUN)] == WARM_TORCHRUN


def run_command(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``cmd`` run from the repository root with :func:`script_env`, forked warm where
    :func:`_starts_warm` says so, else a process of its own."""
    if _starts_warm(cmd):
        return warm_python.run(cmd, cwd=REPO_ROOT, env=script_env(), timeout=timeout)
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout
    )


def torchrun(
    script: str,
    args: list[str],
    nproc: int = 2,
    extra: list[str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc <repo>/script args`` on a free port, from the
    repository root, its ranks warm (:data:`WARM_TORCHRUN`)."""
    cmd = [
        *WARM_TORCHRUN,
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        *(extra or []),
        str(REPO_ROOT / script),
        *args,
    ]
    return run_command(cmd, timeout)


def run_script(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python <script> args`` from the repository root (forked warm: tests/warm_python.py)."""
    return run_command([sys.executable, str(REPO_ROOT / script), *args])


def child_pids(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (a launcher's workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_process(
    cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.Popen | warm_python.WarmProcess:
    """``cmd`` started from the repository root, stderr into stdout: forked warm where
    :func:`_starts_warm` says so (tests/warm_python.py), else a process of its own."""
    env = env or script_env()
    if _starts_warm(cmd):
        return warm_python.start(cmd, cwd=REPO_ROOT, env=env, merge_stderr=True)
    return subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish_all(
    procs: list[subprocess.Popen | warm_python.WarmProcess], timeout: float = 400
) -> list[str]:
    """Wait for ``procs`` (killing what is left at ``timeout``); their logs, each asserted to
    have exited 0."""
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(p, warm_python.WarmProcess):
                p.wait(left)
                logs.append(p.output()[0])
            else:
                logs.append(p.communicate(timeout=left)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return logs


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True, scope="session")
def _few_threads() -> None:
    # The cores shared out among the pytest workers (PYTEST_XDIST_WORKER_COUNT, set by xdist),
    # at most 2: with more threads than its share, a step waits for whichever thread the other
    # workers' processes have descheduled (2.9 s instead of 0.1 s per batch; bench/README.md
    # "Shared cores"). Tests are small: more threads only add scheduling noise.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(min(2, share, torch.get_num_threads()))
    # The processes tests start get the same share unless the test gives its own count (most
    # helpers here do; make gpu-check's steps, launched by the product, inherit this): with
    # OpenMP's default of one thread per core, gpu_check's CPU steps beside another busy core
    # used 205 CPU-s instead of 89 (bench/README.md "Test suite").
    os.environ.setdefault("OMP_NUM_THREADS", str(min(2, share)))
    # A fixed count in this process: the adaptive one (train_utils/threads.py) would follow the
    # other pytest worker's load, and results that tests compare bit for bit depend on it.
    from train_utils import threads

    threads._controllers["cpu"] = None


@pytest.fixture(autouse=True, scope="session")
def _memory_format_cache(tmp_path_factory: pytest.TempPathFactory):
    """Training's memory-format decisions go to a cache of the session (also for the training
    processes tests start), never to the user's ~/.cache."""
    from train_utils.memory_format import CACHE_ENV

    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("yolo_cache")))
    yield
    mp.undo()


@pytest.fixture
def single_thread():
    """One intra-op thread for the test: small forwards gain little from a second one, and on a
    busy 2-core machine a thread waiting for a core makes them 10-30x slower (measured: a
    yolov4.cfg forward at 128 px took 0.36 s on one thread, 9.8 s on two under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout (present for the developers and in CI, not for users)."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"{SHARED_DIR} is absent (it only exists beside the development checkout)")
    return SHARED_DIR


@pytest.fixture(scope="session")
def darknet_harness() -> Path:
    """The C harness linked against Darknet's own objects (tests/darknet_ref/), built once per
    checkout into ``.cache-darknet/`` (under a lock: xdist workers share the build); skips where
    ``../shared/darknet`` or a C compiler is absent."""
    from tests.darknet_ref.build import DarknetUnavailable, harness_path

    try:
        return harness_path()
    except DarknetUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def darknet_harness_fixed(darknet_harness) -> Path:
    """The harness linked with AlexeyAB/darknet#7320 fixed (tests/darknet_ref/build.py)."""
    from tests.darknet_ref.build import harness_path

    return harness_path(fixed=True)


@pytest.fixture(scope="session")
def darknet_program(darknet_harness) -> Path:
    """Darknet's own ``darknet`` program, built with the harness (same skips)."""
    from tests.darknet_ref.build import darknet_path

    return darknet_path()


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny shapes dataset (24 train, 10 val images, 160-256 px), shared by the session.

    Tests must not modify it; use ``make_shapes_data`` for a private copy.
    """
    root = tmp_path_factory.mktemp("shapes")
    return make_dataset(
        root,
        n_train=24,
        n_val=10,
        img_size_range=(160, 256),
        seed=0,
        obj_size_range=(16.0, 0.5),
        workers=1,
    )


@pytest.fixture
def make_shapes_data(tmp_path: Path):
    """Factory for a private shapes dataset: ``make_shapes_data(n_train=8, n_val=4, **kw)``."""

    def _make(n_train: int = 8, n_val: int = 4, **kwargs) -> Path:
        kwargs.setdefault("img_size_range", (160, 256))
        kwargs.setdefault("workers", 1)
        return make_dataset(tmp_path / "shapes", n_train, n_val, **kwargs)

    return _make


def _drop_console_handlers() -> None:
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_yolo_console", False)]:
        root.removeHandler(h)


@pytest.fixture(autouse=True)
def _no_console_handler_outlives_its_test():
    """A script's ``main`` adds the console handler once per process, bound to the sys.stderr of
    that moment: in a test, pytest's capture of that test, closed when it ends. Left in place, a
    later test's log line went to the closed stream ("Logging error ... I/O operation on closed
    file" in its captured stderr) whenever the files happened to run in that order."""
    yield
    _drop_console_handlers()


@pytest.fixture
def console(capsys):
    """The scripts' console handler bound to this test's captured stderr, removed after."""
    _drop_console_handlers()
    yield capsys
    _drop_console_handlers()


class CountingArray(np.ndarray):
    """An array that counts the elements numpy operations on it read (ufuncs, reductions and
    fancy indexing) in the class attribute ``read``, so that a test can check how many passes an
    algorithm makes over its input (not quadratic on a small input) instead of timing it."""

    read = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        CountingArray.read += sum(np.size(x) for x in inputs if isinstance(x, CountingArray))
        plain = [x.view(np.ndarray) if isinstance(x, CountingArray) else x for x in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)

    def __getitem__(self, key):
        CountingArray.read += np.size(key) if isinstance(key, np.ndarray) else 1
        return self.view(np.ndarray)[key]
