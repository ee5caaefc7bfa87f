"""``make gpu-check``: what only a GPU can check and measure, in one command, into one report.

Steps, in this order (``--steps`` picks some; ``train`` names every ``train-<size>``): ``env``,
``cuda-tests``, ``eval``, ``ddp``, ``train-416``, ``train-608``, ``data``, and with ``--compile``
``cuda-slow-tests`` and ``compile-416``. What each runs, measures and checks: bench/README.md
"make gpu-check" (its table); the tolerances and targets are this module's constants.

The checks come first and the measurements after, so that a short budget leaves out a
measurement. Each step runs in a child process with its own time limit, so that a step that
fails, crashes the CUDA context or hangs is recorded with its status, duration, figures so far
and the last lines of its output while the others still run. The limits add up within the
default ``--budget-s`` (``plan_fits``); with a smaller budget a step gets what is left, and one
stopped there is reported as cut by the budget (``skipped``), not as failed. The report is one
JSON and one markdown file, ``bench/results/gpu-check-<UTC date-time>-<gpu>.json`` and ``.md``,
written atomically and never over an existing report. Exit status: 0 when no step failed, 1
with a one-line summary of the failed steps, 2 with one line when no CUDA device is visible
(checked before anything else).

Usage, from the repository root::

    make gpu-check                                  # the whole check, at most --budget-s
    make gpu-check GPU_CHECK_ARGS='--quick'         # 416 only, shorter runs
    make gpu-check GPU_CHECK_ARGS='--compile --budget-s 800'   # and torch.compile
    make gpu-check PY=python3                       # a python with torch, no venv (no network)
    python bench/gpu_check.py --steps env cuda-tests eval
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from build_utils.atomic import atomic_write, make_output_dir, write_text
from build_utils.checks import check_real
from build_utils.errors import ConfigError
from train_utils.distributed.node import usable_cpus
from train_utils.precision import autocast_context, cuda_has_native_bf16, dtype_name, resolve_amp

REPO = common.REPO
RESULTS_DIR = REPO / "bench" / "results"
# The plan's targets (bench/README.md "GPU plan"): YOLOv3-SPP train step with AMP and
# channels_last, img/s on one H100 SXM, and AMP's gain over fp32 (TF32 convolutions).
PLAN_TARGETS = {416: 1000.0, 608: 450.0}
PLAN_AMP_SPEEDUP = 1.8
# The plan puts an H100 PCIe (756 TFLOP/s, 2.0 TB/s) at about this fraction of the SXM figures.
PCIE_FACTOR = 0.7
# The loader sizes the data step measures are paired with the nearest train-step size.
DATA_SIZES = (416, 640)
# Training-time evaluation and validation.py of the same weights agree within this, absolute, on
# each COCO stat. On the CPU they agree to 1e-6 (tests/scenarios/test_ddp_exact_eval.py); on a
# GPU the two processes may pick different cuDNN algorithms (cudnn.benchmark times them anew) and
# autocast rounds to 8 (bf16) or 11 (fp16) bits, so a few scores move by ~1e-3 relative, which can
# swap the order of nearly equal detections or move one across a threshold: with the eval step's
# ~400 validation objects one such change moves an AP by ~1/400 = 0.0025 at most per class.
# 0.01 allows a few of them and still catches a real disagreement (other weights, another
# precision, images scored twice or not at all), which moves mAP by much more.
MAP_TOLERANCE = 0.01
# Decoded box centres of the same raw outputs, autocast against float32, at DECODE_SIDE px: the
# head decodes in float32 (float32 rounding alone is ~1e-4 px); bf16 decoding was up to 2 px off.
DECODE_TOLERANCE_PX = 0.05
DECODE_SIDE = 608
# A step is not started with less time than this left in the budget.
MIN_STEP_S = 15
# The whole check within a 10-minute lease; the steps' limits add up to at most this less
# ORCHESTRATION_S (starting the children, the machine summary, the report).
DEFAULT_BUDGET_S = 570.0
ORCHESTRATION_S = 20.0
# Processes of the ddp step: two where two GPUs are visible (one on a single GPU, which still
# exercises NCCL, the DDP wrapper, barriers and gathers), two gloo processes on the CPU.
DDP_PROCESSES = 2
# Lines of a failed step's output kept in the report: torchrun's own summary alone is ~25
# lines, and the rank's traceback comes before it.
TAIL_LINES = 60
STATUSES = ("passed", "failed", "skipped")
AMP_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
PYTEST = "pytest"
# Packages (import names) the steps that train or evaluate need beyond torch: the trainer
# imports pycocotools at start-up.
TRAINING_NEEDS = ("pycocotools", "cv2", "yaml", "tensorboard", "matplotlib")


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """What the steps run; the defaults are the full check on one H100 with 16 cores."""

    device: str = "cuda"
    train_cfg: str = "cfg/yolov3-spp.cfg"
    train_sizes: tuple[int, ...] = (416, 608)
    train_batch: int = 64  # the plan's; halved until it fits
    train_warmup: int = 3
    train_steps: int = 10
    compile: bool = False  # the compile-<size> step (--compile)
    data_sizes: tuple[int, ...] = DATA_SIZES
    data_images: int = 3072
    data_batch: int = 32
    data_workers: int | None = None  # None: one per usable core
    data_repeat: int = 2
    run_cfg: str = "cfg/yolov3-spp-nano.cfg"
    run_hyp: str = "cfg/hyp_demo.yaml"
    run_img: int = 128
    run_batch: int = 16
    run_epochs: int = 10
    run_train_images: int = 1024
    run_val_images: int = 128
    run_workers: int = 4
    ddp_epochs: int = 2
    ddp_batch: int = 8
    # Seconds per step (each train-<size> gets "train"): with both train sizes they add up to
    # DEFAULT_BUDGET_S - ORCHESTRATION_S (tests/scripts/test_gpu_check.py checks it); compile
    # comes on top. Set from the steps' times on a GPU (bench/README.md "First runs on a GPU").
    limits_s: dict[str, int] = dataclasses.field(
        default_factory=lambda: {
            "env": 10,
            "cuda-tests": 75,
            "eval": 95,
            "ddp": 80,
            "train": 130,
            "data": 30,
            "cuda-slow-tests": 80,
            "compile": 150,
        }
    )

    def quick(self) -> Settings:
        """416 only, no compile, fewer timed steps and a shorter run: about half the time."""
        return dataclasses.replace(
            self,
            train_sizes=(416,),
            train_steps=5,
            data_sizes=(416,),
            data_repeat=1,
            run_epochs=5,
        )

    def tiny(self) -> Settings:
        """The steps' real code at toy sizes on the CPU, for the test suite."""
        return dataclasses.replace(
            self,
            train_cfg="cfg/yolov3-spp-nano.cfg",
            train_sizes=(64,),
            train_batch=2,
            train_warmup=1,
            train_steps=1,
            data_sizes=(64,),
            data_images=32,
            data_batch=4,
            data_workers=1,
            data_repeat=1,
            run_img=64,
            run_batch=4,
            run_epochs=1,
            run_train_images=8,
            run_val_images=4,
            run_workers=0,
            ddp_epochs=1,
            ddp_batch=2,
            # A 2-core CI machine running other tests: each child's start-up (torch, imports)
            # alone can take a minute there.
            limits_s=dict.fromkeys(self.limits_s, 900),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in d.items()})


# ---------------------------------------------------------------------------- verdicts


def plan_target(size: int, gpu_name: str | None) -> float | None:
    """The plan's AMP + channels_last img/s for ``size`` on this GPU: the H100 SXM figure,
    x ``PCIE_FACTOR`` for an H100 PCIe; None where the plan has no figure for the size."""
    target = PLAN_TARGETS.get(size)
    if target is None:
        return None
    if gpu_name and "h100" in gpu_name.lower() and "pcie" in gpu_name.lower():
        target *= PCIE_FACTOR
    return target


def verdict(value: float | None, target: float | None) -> str:
    """``met``, ``x% of target``, or ``-`` without a figure or a target."""
    if value is None or target is None or target <= 0:
        return "-"
    if value >= target:
        return "met"
    return f"{value / target:.0%} of target"


def workers_needed(gpu_img_s: float, per_worker_img_s: float) -> int:
    """DataLoader workers that deliver ``gpu_img_s`` when each delivers ``per_worker_img_s``
    (the measured rate divided by the workers that gave it; they scale about linearly while
    each has a core of its own)."""
    if per_worker_img_s <= 0:
        raise ValueError(f"per-worker rate must be positive, got {per_worker_img_s}")
    return max(1, math.ceil(gpu_img_s / per_worker_img_s - 1e-9))


def nearest(size: int, sizes: Sequence[int]) -> int | None:
    """The size of ``sizes`` closest to ``size`` (640 -> 608), or None when there is none."""
    return min(sizes, key=lambda s: abs(s - size)) if sizes else None


def fit_batch(
    fn: Callable[[int], dict[str, Any]], batch: int, free: Callable[[], None] | None = None
) -> tuple[dict[str, Any], list[int]]:
    """``fn(batch)``, halving ``batch`` after each CUDA out-of-memory error (the plan's 64 may
    not fit an fp32 step at 608 on 80 GB). Returns its result and the batches that did not fit.

    Raises:
        torch.cuda.OutOfMemoryError: even batch 1 does not fit.
    """
    too_big: list[int] = []
    while True:
        try:
            return fn(batch), too_big
        except torch.cuda.OutOfMemoryError:
            if batch <= 1:
                raise
        # Retried outside the handler: the exception's frames, which hold the failed attempt's
        # tensors, are released first.
        too_big.append(batch)
        batch //= 2
        gc.collect()
        if free is not None:
            free()


# ---------------------------------------------------------------------------- steps


class StepSkipped(Exception):
    """The step cannot run here (raised with the reason)."""


class StepFailed(Exception):
    """The step ran and found something wrong (its figures so far are kept)."""


@dataclass
class StepContext:
    """What a step function gets in its child process."""

    settings: Settings
    work: Path  # a folder of its own, removed after the check
    earlier: dict[str, dict[str, Any]]  # figures of the steps before it, by name
    result_path: Path
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return torch.device(self.settings.device)

    def record(self, **figures: Any) -> None:
        """Keep ``figures`` and write them at once, so that a step killed at its time limit
        still reports what it measured before."""
        self.figures.update(figures)
        self._write("running", None)

    def _write(self, status: str, reason: str | None) -> None:
        body = {"status": status, "reason": reason, "figures": self.figures}
        with atomic_write(self.result_path, "w") as f:
            json.dump(body, f, indent=1, default=str)


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """A table for the markdown report: column names and rows of plain values."""
    return {"columns": list(columns), "rows": [list(r) for r in rows]}


def _run_logged(
    cmd: Sequence[str | os.PathLike[str]], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repository root; its output goes to this step's output too (the
    orchestrator keeps the tail), and is returned."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
    )
    sys.stdout.write(proc.stdout[-20000:])
    sys.stdout.write(proc.stderr[-20000:])
    sys.stdout.flush()
    return proc


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


# A Python exception line ("RuntimeError: ...", "torch.OutOfMemoryError: ...", torchrun's ranks
# prefix theirs with "[rank0]: "). torchrun ends with its own ChildFailedError and a summary
# box, so its last line names no cause.
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b.*"
)
_WRAPPER_EXCEPTIONS = ("ChildFailedError",)


def _error_line(text: str) -> str:
    """The last exception line of ``text`` that is not a launcher's wrapper, else its last line:
    the reason a failed command gives in the report."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if _EXCEPTION_LINE.match(line) and not any(w in line for w in _WRAPPER_EXCEPTIONS):
            return line[:300]
    return _last_line(text)


def _gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def step_env(ctx: StepContext) -> None:
    """Versions, devices and missing packages."""
    device = ctx.device
    machine = machine_summary(device)
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        **{k: machine[k] for k in ("torch", "cuda", "cudnn", "cpu", "usable_cpus")},
        "cpu_count": os.cpu_count(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "gpus": [],
    }
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            figures["gpus"].append(
                {
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                    "multiprocessors": p.multi_processor_count,
                }
            )
        # Native bf16 (sm80+) decides --amp auto; emulated bf16 (T4, V100) does not count.
        figures["bf16"] = cuda_has_native_bf16()
        figures["bf16_emulated"] = torch.cuda.is_bf16_supported(including_emulation=True)
        figures["driver"] = _driver_version()
    figures["amp_auto"] = AMP_NAMES.get(resolve_amp("auto", device), "off")
    packages, missing = _requirements()
    figures["packages"] = packages
    figures["missing_packages"] = missing
    rows = [
        ["torch / CUDA / cuDNN", f"{figures['torch']} / {figures['cuda']} / {figures['cudnn']}"],
        ["driver", figures.get("driver") or "-"],
        ["python", figures["python"]],
        ["CPU", f"{figures['cpu']}, {figures['usable_cpus']} usable of {figures['cpu_count']}"],
        ["--amp auto", figures["amp_auto"]],
        ["missing packages", ", ".join(missing) or "none"],
    ]
    rows += [
        [f"GPU {i}", f"{g['name']}, {g['memory_gib']} GiB, sm {g['capability']}"]
        for i, g in enumerate(figures["gpus"])
    ]
    ctx.record(**figures, table=table(["what", "value"], rows))


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.split("\n")[0].strip() or None


def _requirements() -> tuple[dict[str, str | None], list[str]]:
    """requirements.txt's packages: installed version (None: missing) and the missing names."""
    found: dict[str, str | None] = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        name = re.split(r"[=<>!~\[; ]", line.strip(), maxsplit=1)[0]
        if not name or name.startswith("#"):
            continue
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found, [k for k, v in found.items() if v is None]


def cuda_test_files(tests: Path = REPO / "tests") -> list[Path]:
    """The test files that mark CUDA tests: collecting only these keeps the step quick and
    independent of the optional packages other test files need."""
    return sorted(p for p in tests.rglob("test_*.py") if "mark.cuda" in p.read_text())


def pytest_command(files: Sequence[Path], junit: Path, marks: str = "cuda") -> list[str]:
    """``pytest -m marks`` over ``files``, reporting failures and skips, results in ``junit``."""
    return [
        sys.executable,
        "-m",
        PYTEST,
        "-m",
        marks,
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *map(str, files),
    ]


def junit_counts(path: Path) -> dict[str, Any]:
    """Tests, failures (errors included), skips, and ``failures``: each failed test's name and
    the first line of its message, of a JUnit file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "skipped": 0, "failures": {}}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure")
            bad = case.find("error") if bad is None else bad
            if bad is not None:
                counts["failed"] += 1
                # The assertion's first line: the report says why without the traceback.
                message = (bad.get("message") or "").strip().splitlines()
                counts["failures"][name] = message[0][:300] if message else ""
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
    counts["passed"] = counts["tests"] - counts["failed"] - counts["skipped"]
    return counts


def step_cuda_tests(ctx: StepContext, which: str = "quick") -> None:
    """The CUDA tests: ``quick``, those not marked slow (seconds each); ``slow``, the others
    (torch.compile training: a minute), with ``--compile``."""
    if importlib.util.find_spec(PYTEST) is None:
        raise StepFailed("pytest is not installed: pip install -r requirements-dev.txt")
    files = cuda_test_files()
    junit = ctx.work / f"cuda-tests-{which}.xml"
    marks = "cuda and slow" if which == "slow" else "cuda and not slow"
    env = {**os.environ, "YOLO_REQUIRE_CUDA": "1", "PYTHONUNBUFFERED": "1"}
    proc = _run_logged(pytest_command(files, junit, marks), env)
    counts = junit_counts(junit) if junit.is_file() else {}
    ctx.record(
        files=[str(f.relative_to(REPO)) for f in files],
        returncode=proc.returncode,
        **counts,
        table=table(
            ["tests", "passed", "failed", "skipped"],
            [[counts.get(k, "-") for k in ("tests", "passed", "failed", "skipped")]],
        ),
    )
    if proc.returncode != 0:
        failures = counts.get("failures", {})
        failed = "; ".join(f"{n} ({m})" if m else n for n, m in list(failures.items())[:5])
        failed = failed or _last_line(proc.stdout)
        raise StepFailed(f"pytest -m '{marks}' exited {proc.returncode}: {failed}")


def _train_variants(amp_name: str | None, compiled: bool) -> list[tuple[str, str, bool]]:
    """(precision, memory format, compiled) of the train-step bench: fp32 both formats and AMP
    both formats; ``compiled``: the trainer's --compile configuration (AMP, channels_last)."""
    if compiled:
        return [(amp_name or "fp32", "channels_last", True)]
    variants = [("fp32", "contiguous", False), ("fp32", "channels_last", False)]
    if amp_name is not None:
        variants += [(amp_name, "contiguous", False), (amp_name, "channels_last", False)]
    return variants


def step_train(ctx: StepContext, size: int, which: str = "eager") -> None:
    """The YOLOv3-SPP train step at ``size``: each variant at the largest batch that fits;
    ``which="compile"``: the compiled one, beside the eager rows train-<size> measured."""
    from bench import bench_model
    from models.darknet import Darknet

    s, device = ctx.settings, ctx.device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed sizes, as the trainer sets it
    amp_name = AMP_NAMES.get(resolve_amp("auto", device))
    cfg = REPO / s.train_cfg
    flops = bench_model.count_flops(Darknet(cfg), size, train=True)
    gpu = _gpu_name(device)
    ctx.record(size=size, amp=amp_name or "off", gflop_per_img=round(flops / 1e9, 2), gpu=gpu)
    compiled = which == "compile"
    rows: list[dict[str, Any]] = (
        [dict(r) for r in ctx.earlier.get(f"train-{size}", {}).get("rows", [])] if compiled else []
    )

    def free() -> None:
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for variant in _train_variants(amp_name, compiled):

        def one(batch: int, v: tuple[str, str, bool] = variant) -> dict:
            args = argparse.Namespace(
                device=device,
                cfg=cfg,
                train_batch=batch,
                eval_batch=1,
                warmup=s.train_warmup,
                steps=s.train_steps,
                profile=False,
            )
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            (row,) = bench_model.bench_variants(args, "train", size, [v])
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
            return row

        try:
            row, too_big = fit_batch(one, s.train_batch, free)
        except Exception as e:
            if not compiled:
                raise
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            raise StepFailed(f"torch.compile failed: {why}") from e
        finally:
            free()
        row["label"] = bench_model.variant_label(row)
        row["tflop_per_s"] = round(flops * row["img_per_s"] / 1e12, 2)
        row["batches_out_of_memory"] = too_big
        rows.append(row)
        # After every variant: a step stopped at its time limit keeps the figures and verdicts
        # of the variants before.
        ctx.record(**train_figures(rows, amp_name, plan_target(size, gpu)))


def train_figures(
    rows: list[dict[str, Any]], amp_name: str | None, target: float | None
) -> dict[str, Any]:
    """The train step's figures from its rows: each variant against fp32/contiguous (``None``
    where that row was not measured, e.g. compile-<size> run without train-<size>), the AMP +
    channels_last figure against the plan's ``target`` and AMP's gain against
    ``PLAN_AMP_SPEEDUP``, the compiled figure against ``target`` and what compile adds, the
    fastest variant, and the report's table."""
    base = next((r["img_per_s"] for r in rows if r["label"] == "fp32/contiguous"), None)
    for r in rows:
        r["vs_fp32"] = round(r["img_per_s"] / base, 2) if base else None
    plan = next((r for r in rows if r["label"] == f"{amp_name}/channels_last"), None)
    compiled_row = next((r for r in rows if r["compile"]), None)
    figures: dict[str, Any] = {"rows": rows, "target_img_s": target}
    if plan is not None:
        figures["amp_channels_last_img_s"] = plan["img_per_s"]
        figures["verdict"] = verdict(plan["img_per_s"], target)
        figures["amp_speedup"] = plan["vs_fp32"]
        figures["amp_speedup_verdict"] = verdict(plan["vs_fp32"], PLAN_AMP_SPEEDUP)
    if compiled_row is not None:
        figures["compile_verdict"] = verdict(compiled_row["img_per_s"], target)
        if plan is not None:
            figures["compile_gain"] = round(compiled_row["img_per_s"] / plan["img_per_s"], 2)
    fastest = max(rows, key=lambda r: r["img_per_s"])
    figures["fastest"] = {"label": fastest["label"], "img_per_s": fastest["img_per_s"]}
    table_rows = []
    for r in rows:
        note, vs = "", "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}x"
        if r is plan:
            note = f"{verdict(r['img_per_s'], target)}; {vs} fp32: "
            note += verdict(r["vs_fp32"], PLAN_AMP_SPEEDUP)
        elif r is compiled_row:
            gain = figures.get("compile_gain")
            note = figures["compile_verdict"] + (f"; {gain:.2f}x eager" if gain else "")
        cells = [r["label"], r["batch"], r["img_per_s"], r["tflop_per_s"], vs]
        table_rows.append([*cells, r.get("peak_gib", "-"), r["first_call_s"], note])
    columns = ["variant", "batch", "img/s", "TFLOP/s", "vs fp32", "peak GiB", "first call s"]
    plan_column = f"plan: {target:.0f} img/s, {PLAN_AMP_SPEEDUP}x fp32" if target else "plan"
    figures["table"] = table([*columns, plan_column], table_rows)
    return figures


def _gpu_rate_for(size: int, earlier: dict[str, dict[str, Any]], gpu: str | None) -> tuple:
    """The img/s the GPU's train step consumes at the train size nearest to ``size``: the
    fastest variant of that train step, else the plan's target; and where it comes from."""
    measured = {
        f["size"]: f["fastest"]["img_per_s"]
        for name, f in earlier.items()
        if name.startswith("train-") and "fastest" in f
    }
    near = nearest(size, sorted(measured))
    if near is not None:
        return measured[near], f"train-{near} fastest"
    plan_size = nearest(size, sorted(PLAN_TARGETS))
    return plan_target(plan_size, gpu), f"plan at {plan_size} (no train step measured)"


def _make_shapes(root: Path, n_train: int, n_val: int, size_range: tuple[int, int]) -> Path:
    from data.make_shapes import make_dataset

    return make_dataset(root, n_train, n_val, img_size_range=size_range, workers=usable_cpus())


def step_data(ctx: StepContext) -> None:
    """The mosaic training loader with one worker per usable core (or ``data_workers``)."""
    from bench import bench_data
    from build_utils.datasets import LoadImagesAndLabels
    from train_utils.config import load_hyp

    s = ctx.settings
    workers = s.data_workers or usable_cpus()
    root = _make_shapes(ctx.work / "shapes", s.data_images, 4, (256, 480))
    hyp = load_hyp(REPO / "cfg" / "hyp.yaml")
    gpu = _gpu_name(ctx.device)
    rows, table_rows = [], []
    for size in s.data_sizes:
        ds = LoadImagesAndLabels(
            str(root.parent / "train.txt"), size, s.data_batch, augment=True, hyp=hyp
        )
        # Each worker's first batch arrives at about the same time: leave them all out.
        warmup = workers + 1
        runs = [
            bench_data.measure(ds, s.data_batch, workers, 1, warmup, True)
            for _ in range(s.data_repeat)
        ]
        rate, cpu_ms = max(r[0] for r in runs), min(r[1] for r in runs)
        per_worker = rate / workers
        gpu_rate, source = _gpu_rate_for(size, ctx.earlier, gpu)
        needed = workers_needed(gpu_rate, per_worker) if gpu_rate else None
        row = {
            "size": size,
            "workers": workers,
            "img_per_s": round(rate, 1),
            "img_per_s_per_worker": round(per_worker, 1),
            "cpu_ms_per_img": round(cpu_ms, 2),
            "img_per_s_per_core": round(1000 / cpu_ms, 1),
            "gpu_img_per_s": gpu_rate,
            "gpu_rate_from": source,
            "workers_needed": needed,
            "enough_cores": needed is not None and needed <= usable_cpus(),
        }
        rows.append(row)
        table_rows.append(
            [
                size,
                workers,
                row["img_per_s"],
                row["img_per_s_per_worker"],
                row["img_per_s_per_core"],
                f"{gpu_rate} ({source})",
                needed,
                "yes" if row["enough_cores"] else "no",
            ]
        )
        ctx.record(rows=rows)
    columns = ["size", "workers", "img/s", "per worker", "per CPU core", "GPU step img/s"]
    ctx.record(
        rows=rows,
        usable_cpus=usable_cpus(),
        table=table([*columns, "workers needed", "cores enough"], table_rows),
    )


def _train_flags(s: Settings, data: Path, out: Path, epochs: int, batch: int) -> list[str]:
    """The short training runs' flags: the demo's recipe (Adam, hyp_demo) on the nano cfg."""
    argv = common.as_argv(
        {
            "--data": data,
            "--cfg": REPO / s.run_cfg,
            "--hyp": REPO / s.run_hyp,
            "--optimizer": "adam",
            "--img-size": s.run_img,
            "--batch-size": batch,
            "--nbs": batch,
            "--epochs": epochs,
        }
    )
    # --notest: only the last epoch is evaluated, the one compared; --noplots: figures are
    # compared, not pictures.
    argv += ["--no-multi-scale", "--notest", "--noplots"]
    return argv + common.as_argv({"--amp": "auto", "--output-dir": out})


def compare_stats(
    logged: dict[str, str], validated: dict[str, float], tolerance: float = MAP_TOLERANCE
) -> dict[str, Any]:
    """The COCO stats a run logged (its results.csv row) against validation.py's, key by key.

    Returns the largest absolute difference, its key, whether every key agrees within
    ``tolerance``, and the keys validation.py reported that the row lacks.
    """
    diffs = {k: abs(float(logged[k]) - v) for k, v in validated.items() if logged.get(k)}
    missing = sorted(k for k in validated if not logged.get(k))
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "max_abs_diff": round(diffs[worst], 6) if worst else None,
        "worst_key": worst,
        "agree": bool(diffs) and not missing and diffs[worst] <= tolerance,
        "missing_keys": missing,
        "tolerance": tolerance,
    }


def _validate(ctx: StepContext, data: Path, out: Path, name: str, *flags: str) -> dict[str, float]:
    """validation.py (its own process) on ``out``/last.pt with ``flags``; the stats it writes."""
    stats = ctx.work / f"{name}-stats.json"
    cmd = [sys.executable, REPO / "validation.py", "--weights", out / "last.pt", "--no-plots"]
    cmd += flags
    cmd += ["--data", data, "--device", ctx.settings.device]
    cmd += ["--workers", str(ctx.settings.run_workers)]
    cmd += ["--save-dir", ctx.work / f"{name}-val", "--json-out", stats]
    proc = _run_logged(cmd)
    if proc.returncode != 0:
        raise StepFailed(f"validation.py exited {proc.returncode}: {_last_line(proc.stderr)}")
    return json.loads(stats.read_text())


MAP_KEYS = ("mAP50", "mAP50-95")


def _agreement(
    ctx: StepContext, out: Path, validated: dict[str, float], what: str
) -> dict[str, Any]:
    """Compare the run's last results.csv row with ``validated``; record; fail on disagreement."""
    import csv

    with (out / "results.csv").open() as f:
        row = list(csv.DictReader(f))[-1]
    cmp = compare_stats(row, validated)
    ctx.record(
        logged={k: float(row[k]) for k in MAP_KEYS if row.get(k)},
        validated={k: validated[k] for k in MAP_KEYS if k in validated},
        **cmp,
        table=table(
            ["stat", "training logged", "validation.py", "|diff|"],
            [
                [k, row.get(k, "-"), round(validated[k], 6), round(abs(float(row[k]) - v), 6)]
                for k, v in validated.items()
                if row.get(k)
            ],
        ),
    )
    if not cmp["agree"]:
        raise StepFailed(
            f"{what}: the run logged and validation.py differ by {cmp['max_abs_diff']} on "
            f"{cmp['worst_key']} (tolerance {MAP_TOLERANCE}; missing {cmp['missing_keys']})"
        )
    return cmp


def step_eval(ctx: StepContext) -> None:
    """A short training run under --amp auto, then validation.py of its last.pt: as the run
    replays it (autocast), and in float32; and the boxes last.pt decodes under autocast."""
    from train_utils.checkpoint import read_weights

    s = ctx.settings
    data = _make_shapes(ctx.work / "shapes", s.run_train_images, s.run_val_images, (160, 256))
    out = ctx.work / "run"
    cmd = [sys.executable, REPO / "train.py"]
    cmd += _train_flags(s, data, out, s.run_epochs, s.run_batch)
    cmd += ["--device", s.device, "--workers", str(s.run_workers)]
    t0 = time.perf_counter()
    proc = _run_logged(cmd)
    ctx.record(train_s=round(time.perf_counter() - t0, 1))
    if proc.returncode != 0:
        raise StepFailed(f"train.py exited {proc.returncode}: {_last_line(proc.stderr)}")
    precision = read_weights(out / "last.pt").precision
    amp = resolve_amp("auto", ctx.device)
    ctx.record(checkpoint_precision=precision)
    expected = dtype_name(amp)
    if precision.get("amp") != expected:
        raise StepFailed(f"last.pt records amp {precision.get('amp')}, --amp auto is {expected}")
    validated = _validate(ctx, data, out, "eval")
    _agreement(ctx, out, validated, "training-time evaluation")
    # Without autocast (the CPU under --amp auto) the first evaluation already ran in float32.
    fp32 = validated if amp is None else _validate(ctx, data, out, "eval-fp32", "--amp", "off")
    ctx.record(fp32_evaluated_again=amp is not None)
    worst = decode_difference(out / "last.pt", ctx.device, amp)
    ctx.record(**amp_figures(validated, fp32, worst, AMP_NAMES.get(amp, "off")))
    problems = amp_problems(validated, fp32, worst)
    if problems:
        raise StepFailed("; ".join(problems))


def amp_figures(
    autocast: dict[str, float], fp32: dict[str, float], decode_px: float, amp_name: str
) -> dict[str, Any]:
    """The autocast evaluation against float32's: mAP of each, the centre difference of the
    decoded boxes, and a table for the report."""
    rows = [[k, round(autocast[k], 6), round(fp32[k], 6), round(abs(autocast[k] - fp32[k]), 6)]
            for k in MAP_KEYS]  # fmt: skip
    rows.append([f"box centres at {DECODE_SIDE} px (max px)", "-", "-", round(decode_px, 6)])
    return {
        "amp_vs_fp32": {k: {"autocast": autocast[k], "fp32": fp32[k]} for k in MAP_KEYS},
        "decode_centre_diff_px": decode_px,
        "amp_table": table(["stat", f"validation.py ({amp_name})", "--amp off", "|diff|"], rows),
    }


def amp_problems(autocast: dict[str, float], fp32: dict[str, float], decode_px: float) -> list:
    """What the autocast evaluation gets wrong against float32's, one phrase each."""
    problems = [
        f"validation.py under autocast and with --amp off differ by "
        f"{abs(autocast[k] - fp32[k]):.4f} on {k} (tolerance {MAP_TOLERANCE})"
        for k in MAP_KEYS
        if abs(autocast[k] - fp32[k]) > MAP_TOLERANCE
    ]
    if not decode_px <= DECODE_TOLERANCE_PX:
        problems.append(
            f"box centres decoded under autocast differ from float32's by {decode_px:.3f} px at "
            f"{DECODE_SIDE} px (tolerance {DECODE_TOLERANCE_PX}): the head decodes in the "
            f"autocast dtype"
        )
    return problems


def decode_difference(weights: Path, device: torch.device, amp: torch.dtype | None) -> float:
    """Largest difference, in pixels, between the box centres ``weights`` decodes under autocast
    to ``amp`` at ``DECODE_SIDE`` px and those of the same raw outputs decoded in float32."""
    from train_utils.checkpoint import read_weights
    from train_utils.load_model import model_from_weights

    model = model_from_weights(read_weights(weights), None, None, DECODE_SIDE)
    model = model.to(device).eval()
    x = torch.rand(1, 3, DECODE_SIDE, DECODE_SIDE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with autocast_context(device, amp):
            det, raw = model(x.to(device))
        heads = [model.module_list[i] for i in model.yolo_layers]
        want = torch.cat([h.decode(r.float()).flatten(1, 3) for h, r in zip(heads, raw)], 1)
    return float((det[..., :2].float() - want[..., :2]).abs().max())


def ddp_processes(device: torch.device, gpus: int) -> int:
    """Processes of the ddp step: ``DDP_PROCESSES``, or as many GPUs as there are (at least 1:
    one process still initialises NCCL, wraps the model in DDP and gathers)."""
    if device.type != "cuda":
        return DDP_PROCESSES
    return max(1, min(DDP_PROCESSES, gpus))


def step_ddp(ctx: StepContext) -> None:
    """torchrun processes (NCCL + SyncBatchNorm on CUDA, gloo on the CPU path); one on a single
    GPU, since a 1-process group still runs NCCL, the DDP wrapper, barriers and gathers."""
    from train_utils.distributed.launch import free_port

    s, device = ctx.settings, ctx.device
    nproc = ddp_processes(device, torch.cuda.device_count() if device.type == "cuda" else 0)
    data = _make_shapes(ctx.work / "shapes", s.run_train_images, s.run_val_images, (160, 256))
    out = ctx.work / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += [f"--master_port={free_port()}", REPO / "train_multi_GPU.py"]
    cmd += _train_flags(s, data, out, s.ddp_epochs, s.ddp_batch)
    cmd += ["--workers", str(min(2, s.run_workers))]
    if device.type == "cpu":
        cmd += ["--device", "cpu"]
    proc = _run_logged(cmd)
    if proc.returncode != 0:
        raise StepFailed(f"torchrun exited {proc.returncode}: {_error_line(proc.stderr)}")
    log = (out / "train.log").read_text()
    backend = "nccl" if device.type == "cuda" else "gloo"
    sync_bn = "SyncBatchNorm skipped" not in log + proc.stderr
    ctx.record(backend=backend, processes=nproc, sync_batchnorm=sync_bn)
    if f"backend {backend}" not in log + proc.stderr:
        raise StepFailed(f"no {backend} process group was initialised (train.log, torchrun)")
    if f"x {nproc} process(es)" not in log:
        raise StepFailed(f"train.log does not show {nproc} process(es)")
    if device.type == "cuda" and not sync_bn:
        raise StepFailed("SyncBatchNorm was skipped on CUDA")
    # The ranks evaluated disjoint shards and rank 0 scored them together: the mAP it logged
    # equals one process's validation.py only if the ranks agreed on the weights and data.
    _agreement(ctx, out, _validate(ctx, data, out, "ddp"), f"{nproc}-process evaluation")


# ---------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class StepSpec:
    """A step: its name, the function its child runs (``module:function[:arg]``), its time
    limit, and the import names it needs (missing: skipped with the reason)."""

    name: str
    target: str
    limit_s: float
    needs: tuple[str, ...] = ()


def step_specs(settings: Settings) -> list[StepSpec]:
    """Every step, in the order they run."""
    lim = settings.limits_s
    here = "bench.gpu_check"
    # The checks first, then the measurements: when the budget runs short (a slow compile),
    # what is left out is a measurement. data comes after the train steps it is paired with.
    specs = [
        StepSpec("env", f"{here}:step_env", lim["env"]),
        StepSpec("cuda-tests", f"{here}:step_cuda_tests", lim["cuda-tests"], TRAINING_NEEDS),
        StepSpec("eval", f"{here}:step_eval", lim["eval"], TRAINING_NEEDS),
        StepSpec("ddp", f"{here}:step_ddp", lim["ddp"], TRAINING_NEEDS),
    ]
    specs += [
        StepSpec(f"train-{n}", f"{here}:step_train:{n}", lim["train"], ("cv2",))
        for n in settings.train_sizes
    ]
    specs.append(StepSpec("data", f"{here}:step_data", lim["data"], ("cv2", "yaml")))
    if settings.compile:  # last: the measurement a short budget leaves out first
        slow = f"{here}:step_cuda_tests:slow"
        specs.append(StepSpec("cuda-slow-tests", slow, lim["cuda-slow-tests"], TRAINING_NEEDS))
        n = settings.train_sizes[0]
        target = f"{here}:step_train:{n}:compile"
        specs.append(StepSpec(f"compile-{n}", target, lim["compile"], ("cv2",)))
    return specs


def plan_fits(specs: Sequence[StepSpec], budget_s: float) -> bool:
    """Whether every step of ``specs`` can run to its own limit within ``budget_s``, with
    ``ORCHESTRATION_S`` for starting the children and writing the report."""
    return sum(spec.limit_s for spec in specs) + ORCHESTRATION_S <= budget_s


def select_steps(specs: Sequence[StepSpec], names: Sequence[str] | None) -> list[StepSpec]:
    """``--steps``: the named steps in their order (``train`` names every train-<size>).

    Raises:
        ConfigError: a name that is no step.
    """
    if not names:
        return list(specs)
    wanted = {n for name in names for n in name.split(",") if n}
    known = {s.name for s in specs} | {"train"}
    unknown = sorted(wanted - known)
    if unknown:
        raise ConfigError(
            f"--steps: unknown step(s) {', '.join(unknown)}; choose from "
            f"{', '.join(s.name for s in specs)} (train: every train-<size>)"
        )
    return [
        s for s in specs if s.name in wanted or ("train" in wanted and s.name.startswith("train-"))
    ]


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of a step's output."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    # Progress bars redraw with carriage returns: keep each line's last state.
    kept = [ln.rsplit("\r", 1)[-1] for ln in text.split("\n")]
    return "\n".join([ln for ln in kept if ln.strip()][-lines:])


def run_step(
    spec: StepSpec,
    settings: Settings,
    work: Path,
    earlier: dict[str, dict[str, Any]],
    limit_s: float,
    cut: str | None = None,
) -> dict[str, Any]:
    """Run one step in a child process within ``limit_s``; its result record. ``cut``: why
    ``limit_s`` is below the step's own limit (the budget), which a time-out then reports as a
    cut (skipped) instead of a failure."""
    base = {"name": spec.name, "status": "skipped", "reason": None, "duration_s": 0.0}
    base.update({"figures": {}, "error_tail": None, "limit_s": round(limit_s)})
    missing = [n for n in spec.needs if importlib.util.find_spec(n) is None]
    if missing:
        base["reason"] = (
            f"needs {', '.join(missing)} (not installed; see bench/README.md 'make gpu-check' "
            "for carrying wheels to a machine without network)"
        )
        return base
    step_dir = work / spec.name
    step_dir.mkdir(parents=True, exist_ok=True)
    context = step_dir / "context.json"
    result = step_dir / "result.json"
    log = step_dir / "output.log"
    context.write_text(
        json.dumps(
            {"settings": dataclasses.asdict(settings), "earlier": earlier, "work": str(step_dir)}
        )
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-step", spec.target]
    cmd += ["--context", str(context), "--result", str(result)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    timed_out = False
    with log.open("w") as out:
        # A session of its own, so that a time-out ends the step with everything it started
        # (torchrun's ranks, DataLoader workers, pytest), and nothing else.
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    base["duration_s"] = round(time.perf_counter() - t0, 1)
    try:
        body = json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):  # OSError: the step wrote none
        body = {}
    base["figures"] = body.get("figures", {})
    tail = _tail(log)
    if timed_out and cut is not None:
        base.update(status="skipped", reason=f"cut after {limit_s:.0f} s: {cut}", error_tail=tail)
    elif timed_out:
        base.update(status="failed", reason=f"timed out after {limit_s:.0f} s", error_tail=tail)
    elif proc.returncode != 0:
        base.update(
            status="failed",
            reason=f"exited {proc.returncode}: {_error_line(tail)}",
            error_tail=tail,
        )
    elif body.get("status") in STATUSES:
        base.update(status=body["status"], reason=body.get("reason"))
        if body["status"] == "failed":
            base["error_tail"] = tail
    else:
        base.update(status="failed", reason="the step wrote no result", error_tail=tail)
    return base


def run_steps(
    specs: Sequence[StepSpec],
    settings: Settings,
    work: Path,
    budget_s: float,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> list[dict[str, Any]]:
    """Run ``specs`` in order, each within its limit and what is left of ``budget_s``."""
    deadline = time.monotonic() + budget_s
    results: list[dict[str, Any]] = []
    earlier: dict[str, dict[str, Any]] = {}
    for k, spec in enumerate(specs, 1):
        left = deadline - time.monotonic()
        progress(f"[{k}/{len(specs)}] {spec.name} ...")
        if left < MIN_STEP_S:
            r = {"name": spec.name, "status": "skipped", "duration_s": 0.0, "figures": {}}
            r.update(
                reason=f"not run: the check's --budget-s {budget_s:.0f} was spent",
                error_tail=None,
                limit_s=0,
            )
        else:
            cut = None
            if left < spec.limit_s:
                cut = (
                    f"the check's --budget-s {budget_s:.0f} ran out before the step's own "
                    f"{spec.limit_s:.0f} s (figures so far kept)"
                )
            r = run_step(spec, settings, work, earlier, min(spec.limit_s, left), cut)
        earlier[spec.name] = r["figures"]
        results.append(r)
        why = f" ({r['reason']})" if r["reason"] else ""
        progress(f"[{k}/{len(specs)}] {spec.name} {r['status']} in {r['duration_s']:.1f} s{why}")
    return results


def child_main(target: str, context_path: Path, result_path: Path) -> int:
    """A step in its child process: run ``target`` and write its result."""
    module_name, func_name, *arg = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    body = json.loads(context_path.read_text())
    ctx = StepContext(
        Settings.from_dict(body["settings"]), Path(body["work"]), body["earlier"], result_path
    )
    try:
        func(ctx, *(int(a) if a.isdigit() else a for a in arg))
    except StepSkipped as e:
        ctx._write("skipped", str(e))
        return 0
    except StepFailed as e:
        print(f"failed: {e}", file=sys.stderr)
        ctx._write("failed", str(e))
        return 0
    ctx._write("passed", None)
    return 0


# ---------------------------------------------------------------------------- reports


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def report_paths(out_dir: Path, stamp: str, device_slug: str) -> tuple[Path, Path]:
    """``gpu-check-<stamp>-<device>.json`` and ``.md`` in ``out_dir``, numbered ``-2``, ``-3``,
    ... when either name is taken: a report is never written over."""
    stem = f"gpu-check-{stamp}-{device_slug}"
    n = 1
    while True:
        name = stem if n == 1 else f"{stem}-{n}"
        paths = (out_dir / f"{name}.json", out_dir / f"{name}.md")
        if not any(p.exists() for p in paths):
            return paths
        n += 1


def summary_line(results: Sequence[dict[str, Any]]) -> str:
    """One line: the counts, and each failed step with its reason."""
    counts = {st: sum(r["status"] == st for r in results) for st in STATUSES}
    line = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    failed = [f"{r['name']} ({r['reason']})" for r in results if r["status"] == "failed"]
    if failed:
        line += ": failed " + "; ".join(failed)
    return line


# The figures a step shows as tables in the markdown report, in this order.
TABLE_KEYS = ("table", "amp_table")


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the machine, one row per step, each step's table, failures."""
    m = report["machine"]
    lines = [
        f"# make gpu-check, {report['started_utc']}",
        "",
        f"- device: {m['device']}",
        f"- torch {m['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}",
        f"- CPU: {m['cpu']}, {m['usable_cpus']} usable cores",
        f"- result: {report['summary']} (exit status {report['exit_status']})",
        f"- settings: {'quick' if report['quick'] else 'full'}; budget {report['budget_s']} s; "
        f"took {report['duration_s']} s",
        "",
        "| step | status | time s | limit s | note |",
        "|---|---|---|---|---|",
    ]
    for r in report["steps"]:
        lines.append(
            f"| {r['name']} | {r['status']} | {r['duration_s']} | {r['limit_s']} | "
            f"{_cell(r['reason'] or '')} |"
        )
    for r in report["steps"]:
        tables = [r["figures"][k] for k in TABLE_KEYS if r["figures"].get(k)]
        if tables:
            lines += ["", f"## {r['name']}"]
        for t in tables:
            lines.append("")
            lines.append("| " + " | ".join(map(_cell, t["columns"])) + " |")
            lines.append("|" + "---|" * len(t["columns"]))
            lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in t["rows"]]
    failed = [r for r in report["steps"] if r["status"] == "failed" and r["error_tail"]]
    for r in failed:
        lines += ["", f"## {r['name']}: last lines of its output", "", "```", r["error_tail"]]
        lines.append("```")
    lines += [
        "",
        "Targets: bench/README.md 'GPU plan' (one H100 SXM; an H100 PCIe at "
        f"{PCIE_FACTOR:.0%}); a figure below target is a measurement, not a failure.",
        "",
    ]
    return "\n".join(lines)


def write_reports(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """The report as JSON and markdown in ``out_dir`` (atomic writes, new names)."""
    make_output_dir(out_dir, "--out-dir")
    json_path, md_path = report_paths(out_dir, report["stamp"], report["machine"]["slug"])
    write_text(json_path, json.dumps(report, indent=2, default=str) + "\n", "--out-dir")
    write_text(md_path, markdown(report), "--out-dir")
    return json_path, md_path


def machine_summary(device: torch.device) -> dict[str, Any]:
    """The report header's machine: device names, versions, CPU."""
    info = common.machine_description(device)
    if device.type == "cuda":
        name = info["gpu"]
        described = f"{name} x {torch.cuda.device_count()}"
    else:
        name, described = "cpu", f"CPU only ({info['cpu']})"
    return {
        "device": described,
        "slug": slug(name),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu": info["cpu"],
        "usable_cpus": usable_cpus(),
    }


def require_cuda() -> None:
    """Raises ConfigError (one line, exit 2) when no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    else:
        why = (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!s})"
        )
    raise ConfigError(f"make gpu-check needs an NVIDIA GPU: {why}; nothing was run")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument(
        "--steps",
        nargs="+",
        default=None,
        help="run only these steps, comma or space separated: "
        + ", ".join(spec.name for spec in step_specs(Settings(compile=True)))
        + " ('train' names every train-<size>)",
    )
    p.add_argument("--quick", action="store_true", help="416 only, shorter runs")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also, last, the cuda-slow-tests step (training under --compile) and the "
        "compile-416 step (torch.compile of the AMP channels_last train step): about 230 s "
        "more, give --budget-s 800",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for the whole check; a step starts only with time left, and one the "
        f"budget stops is reported as cut (default: {DEFAULT_BUDGET_S:.0f}, within a 10-minute "
        f"lease; the steps' own limits fit it)",
    )
    p.add_argument(
        "--out-dir", type=Path, default=RESULTS_DIR, help="where the report goes (bench/results)"
    )
    p.add_argument("--keep-work", action="store_true", help="keep the steps' work folder")
    # Internal: the steps' real code on the CPU at toy sizes, for tests/scripts/test_gpu_check.py.
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    # Internal: one step in a child process.
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def check(args: argparse.Namespace, specs: Sequence[StepSpec] | None = None) -> int:
    """The whole check; returns the exit status."""
    settings = Settings()
    if args.quick:
        settings = settings.quick()
    if args.compile:
        settings = dataclasses.replace(settings, compile=True)
    if args.tiny:
        settings = settings.tiny()
    settings = dataclasses.replace(settings, device=args.device)
    # -1 ran nothing and passed; nan ran without a limit.
    check_real("--budget-s", args.budget_s, positive=True, unit="seconds")
    device = torch.device(args.device)
    if device.type == "cuda":
        require_cuda()
    specs = select_steps(specs or step_specs(settings), args.steps)
    # A folder the report cannot go to is one line now, not a traceback after the measurements.
    make_output_dir(args.out_dir, "--out-dir")
    started = datetime.now(UTC)
    machine = machine_summary(device)
    print(f"gpu-check on {machine['device']}: {', '.join(s.name for s in specs)}", file=sys.stderr)
    if not plan_fits(specs, args.budget_s):
        planned = sum(spec.limit_s for spec in specs) + ORCHESTRATION_S
        print(
            f"gpu-check: the steps' limits need up to {planned:.0f} s, --budget-s is "
            f"{args.budget_s:.0f}: the last steps may be cut",
            file=sys.stderr,
        )
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    t0 = time.perf_counter()
    try:
        results = run_steps(specs, settings, work, args.budget_s)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    failed = any(r["status"] == "failed" for r in results)
    report = {
        "schema": 1,
        "stamp": started.strftime("%Y%m%dT%H%M%SZ"),
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "quick": args.quick,
        "budget_s": args.budget_s,
        "machine": machine,
        "settings": dataclasses.asdict(settings),
        "steps": results,
        "summary": summary_line(results),
        "exit_status": 1 if failed else 0,
    }
    json_path, md_path = write_reports(report, args.out_dir)
    print(f"gpu-check: {report['summary']}; report {json_path} and {md_path.name}", file=sys.stderr)
    return report["exit_status"]


def command(args: argparse.Namespace) -> int:
    """The check, or (internal ``--run-step``) one step in its child process."""
    if args.run_step:
        # As bench.gpu_check, not __main__: the steps raise that module's StepSkipped/StepFailed.
        this = importlib.import_module("bench.gpu_check")
        return this.child_main(args.run_step, args.context, args.result)
    return check(args)


def main(argv: Sequence[str] | None = None) -> int:
    from train_utils.cli import run_script

    return run_script(get_parser(), command, argv)


if __name__ == "__main__":
    sys.exit(main())
