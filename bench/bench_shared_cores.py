"""Shared cores: the demo's train step on an idle machine and beside one busy process.

Each variant (a thread policy: the adaptive default, a fixed count, OpenMP's passive wait) runs
the demo model's train step (``cfg/yolov3-spp-nano-newcoords.cfg``, 128 px, batch 16, the real
loss on synthetic targets, ``cfg/hyp_demo.yaml``) in a child process for ``--seconds``, once
alone and once while a single-threaded busy loop runs in a session of its own (as another user's
job would: the kernel's autogroups then share the cores between the two sessions). It reports
the median seconds per step in each case, their ratio, and the thread counts the child used.
The variants run in turn, so that the ratios in one run compare like with like.

    python bench/bench_shared_cores.py                         # auto, 2 threads, 1 thread, passive
    python bench/bench_shared_cores.py --variants auto fixed2 --seconds 40 --json shared.json

Thread policies are environment variables of the child: ``YOLO_THREADS`` (``auto`` or N, see
``train_utils/threads.py``) and ``OMP_WAIT_POLICY``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from build_utils.checks import check_at_least, check_real
from build_utils.errors import ConfigError
from train_utils.cli import check_img_size, run_script
from train_utils.distributed.node import usable_cpus
from train_utils.threads import MAX_THREADS, thread_count

DEMO_CFG = common.REPO / "cfg" / "yolov3-spp-nano-newcoords.cfg"
DEMO_CLASSES = 5
BUSY_LOOP = "while True: pass"


def variant_env(name: str) -> dict[str, str]:
    """The child's thread settings for a variant name: ``auto``, ``fixedN``, ``passive``."""
    if name == "auto":
        return {"YOLO_THREADS": "auto"}
    if name.startswith("fixed") and thread_count(name[5:]) is not None:
        if int(name[5:]) > MAX_THREADS:
            raise ConfigError(f"variant {name!r}: at most {MAX_THREADS} threads")
        return {"YOLO_THREADS": name[5:]}
    if name == "passive":
        return {"YOLO_THREADS": str(usable_cpus()), "OMP_WAIT_POLICY": "PASSIVE"}
    raise ConfigError(f"unknown variant {name!r}: auto, fixedN (e.g. fixed2) or passive")


def child(args: argparse.Namespace) -> None:
    """Train steps for ``--seconds``; prints one JSON line per step (seconds, threads)."""
    import torch

    from bench.bench_model import TrainStep, synthetic_batch
    from models.darknet import Darknet, model_blocks_for
    from train_utils.config import load_hyp
    from train_utils.threads import adapt_threads

    device, size = torch.device("cpu"), args.img_size
    adapt_threads(device)  # applies YOLO_THREADS, as a training run does at its start
    model = Darknet(model_blocks_for(DEMO_CFG, DEMO_CLASSES), img_size=(size, size))
    hyp = load_hyp(common.REPO / "cfg" / "hyp_demo.yaml")
    train_step = TrainStep(model, model, "fp32", "contiguous", size, hyp=hyp)
    imgs, targets = synthetic_batch(args.batch, size, DEMO_CLASSES, seed=0)
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        train_step(imgs, targets)
        adapt_threads(device)
        step = time.perf_counter() - t0
        print(json.dumps({"s": step, "threads": torch.get_num_threads()}), flush=True)


def run_variant(name: str, busy: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One child run of ``name``, alone or beside a busy loop; its step times."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(variant_env(name))
    neighbour = None
    if busy:
        # start_new_session: another session, as another user's job is (autogroups).
        neighbour = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
    try:
        flags = {"--seconds": args.seconds, "--img-size": args.img_size, "--batch": args.batch}
        cmd = [sys.executable, __file__, "--child", *common.as_argv(flags)]
        out = common.run_child(cmd, env, f"variant {name}")
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    timed = steps[args.skip :] or steps
    return {
        "variant": name,
        "busy": busy,
        "steps": len(steps),
        "median_s": statistics.median(s["s"] for s in timed),
        "mean_s": statistics.fmean(s["s"] for s in timed),
        "threads": sorted({s["threads"] for s in timed}),
    }


def check_args(args: argparse.Namespace) -> None:
    """The flags, before any child runs (a bad one was a child's traceback, or an empty
    measurement's; an unwritable ``--json`` a traceback at the end).

    Raises:
        ConfigError: an unknown variant, ``--seconds`` not a positive number, ``--batch``
            below 1, ``--skip`` below 0, an ``--img-size`` the model cannot take, a step that
            cannot fit in memory.
        OutputError: ``--json``'s folder cannot be made.
    """
    from models.budget import check_model_fits
    from models.darknet import model_blocks_for

    for name in args.variants:
        variant_env(name)  # every name checked before anything runs
    check_real("--seconds", args.seconds, positive=True)
    check_at_least({"--batch": args.batch}, 1)
    check_at_least({"--skip": args.skip}, 0)
    check_img_size(args.img_size)
    blocks = model_blocks_for(DEMO_CFG, DEMO_CLASSES)
    check_model_fits(blocks, args.img_size, args.batch, training=True)
    common.check_json(args.json)


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--variants", nargs="+", default=["auto", "fixed2", "fixed1", "passive"])
    p.add_argument("--seconds", type=float, default=30.0, help="per run (default 30)")
    p.add_argument("--img-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def bench(args: argparse.Namespace) -> None:
    if args.child:
        child(args)
        return
    check_args(args)
    info = common.machine_info(seconds=args.seconds)
    print(f"{info['cpu']}, {info['cores']} usable cores; demo train step {args.img_size} px, "
          f"batch {args.batch}; {args.seconds:.0f} s per run")  # fmt: skip
    print(f"{'variant':10s} {'idle s/step':>11s} {'busy s/step':>11s} {'busy/idle':>9s} "
          f"{'vs auto idle':>12s}  threads idle / busy")  # fmt: skip
    rows = []
    for name in args.variants:
        idle, busy = run_variant(name, False, args), run_variant(name, True, args)
        rows += [idle, busy]
        base = next((r["median_s"] for r in rows if r["variant"] == "auto" and not r["busy"]), None)
        vs = f"{idle['median_s'] / base:.2f}x" if base else "-"
        print(
            f"{name:10s} {idle['median_s']:11.3f} {busy['median_s']:11.3f} "
            f"{busy['median_s'] / idle['median_s']:8.1f}x {vs:>12s}  "
            f"{idle['threads']} / {busy['threads']}",
            flush=True,
        )
    common.write_report(args.json, {"info": info, "results": rows})


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
