"""DDP scaling on the CPU: training images/s with 1 process vs N processes (gloo).

Each measurement runs in fresh processes with one thread each (``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``), so that N processes use N cores:

- ``1 process``: ``python bench/bench_ddp.py --worker``: the model as ``train.py`` trains it
  (no process group, no DDP wrapper);
- ``N processes``: ``torchrun --standalone --nproc_per_node=N bench/bench_ddp.py --worker``:
  ``init_distributed_mode`` (gloo) and ``DistributedDataParallel`` exactly as
  ``train_multi_GPU.py`` sets them up (``trainer.run``), each rank with its own batch;
- ``N processes, no all-reduce``: the same inside ``DDP.no_sync()``: the compute-only bound,
  which separates the cost of sharing the machine (memory bandwidth, caches, other processes)
  from the cost of the gradient all-reduce.
- with ``--accumulate K`` (K > 1) the N-process measurement all-reduces once per K steps, as
  the trainer does (``no_sync`` on the other micro-batches), and one more measurement
  all-reduces every micro-batch, as the trainer did before: their ratio is what ``no_sync``
  saves.

What is measured is the train-step loop (``bench_model.TrainStep``: uint8 -> float, forward,
fp32 loss, backward with DDP's bucketed all-reduce, SGD, ``zero_grad(set_to_none=True)``) on
synthetic batches held in memory: the data pipeline is not measured (see ``bench_data.py``).
Images/s = processes x batch x steps / wall time of the timed steps, which start and end at a
barrier. The ratio is N-process images/s over 1-process images/s; ideal is N.

On a shared machine other work takes cores from the N processes more than from one, so each
measurement also reports its CPU share (CPU seconds of its processes / (wall seconds x N)) and
images per CPU-second; N x (img/CPU-s of N processes) / (img/CPU-s of 1 process) is the ratio
projected for N idle cores ("free cores"): it shows what DDP itself costs (the all-reduce,
gloo's threads, the caches shared by the processes) apart from what the other work took.

Usage, from the repository root::

    python bench/bench_ddp.py                              # nano cfg, 256 px, batch 16 per rank
    python bench/bench_ddp.py --repeat 3 --json ddp.json
    python bench/bench_ddp.py --cfg cfg/yolov3-spp.cfg --img-size 320 --batch 2 --steps 3
    python bench/bench_ddp.py --accumulate 4 --steps 8     # gradient accumulation, no_sync gain

Runs alternate (1, N, N no-sync, 1, N, ...) ``--repeat`` times and the best of each counts, so a
burst of other work on a shared machine hurts one run, not the figure. The paired ratio is also
reported: the median over repetitions of (N-process run / the 1-process run just before it),
which cancels slow drifts of the machine's speed that "best of each" cannot (one lucky
1-process run lowers the best-of ratio of the whole session).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from bench import common
from bench.bench_model import FORMATS, TrainStep, memory_format, synthetic_batch
from build_utils.checks import check_at_least
from build_utils.parse_config import parse_model_cfg
from models.budget import check_model_fits
from models.darknet import Darknet
from train_utils.cli import check_img_size, run_script
from train_utils.distributed.comm import barrier
from train_utils.distributed.process_group import cleanup, init_distributed_mode

DISTINCT_BATCHES = 4  # synthetic batches per rank, cycled through
# A measurement's all-reduce: "step" once per optimizer step (every --accumulate micro-batches),
# "every" at each micro-batch, "nosync" never; the worker's flags and the table's words for it.
MODE_FLAGS = {"step": [], "every": ["--sync-every-batch"], "nosync": ["--no-sync"]}
MODE_WORDS = {"step": "per step", "every": "per batch", "nosync": "no"}


def all_reduces(args: argparse.Namespace, k: int) -> bool:
    """Whether micro-batch ``k`` all-reduces its gradients (the others run in ``no_sync``)."""
    if args.no_sync:
        return False
    return args.sync_every_batch or (k + 1) % args.accumulate == 0


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process of a measurement; returns (on every rank) the timing of this process."""
    torch.set_num_threads(1)
    info = init_distributed_mode(argparse.Namespace(device="cpu", local_rank=-1))
    try:
        torch.manual_seed(0)  # the same initial weights on every rank, as DDP requires anyway
        raw = Darknet(args.cfg, img_size=args.img_size).to(memory_format=memory_format(args.format))
        model: nn.Module = raw
        if info.distributed:
            model = nn.parallel.DistributedDataParallel(raw, device_ids=None)
        step = TrainStep(model, raw, "fp32", args.format, args.img_size)
        batches = [
            synthetic_batch(args.batch, args.img_size, raw.nc, seed=1000 * info.rank + k)
            for k in range(DISTINCT_BATCHES)
        ]

        def one(k: int) -> None:
            sync = not info.distributed or all_reduces(args, k)
            with nullcontext() if sync else model.no_sync():
                step(*batches[k % DISTINCT_BATCHES])

        for k in range(args.warmup):
            one(k)
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for k in range(args.steps):
            one(k)
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        barrier()
        seconds = time.perf_counter() - t0
        if info.distributed:
            dist.all_reduce(cpu)  # CPU seconds of all ranks
        images = info.world_size * args.batch * args.steps
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "seconds": seconds,
            "img_per_s": images / seconds,
            "img_per_cpu_s": images / float(cpu),
            "cpu_share": float(cpu) / (seconds * info.world_size),
            "threads": torch.get_num_threads(),
        }
    finally:
        cleanup()


def launch(args: argparse.Namespace, nproc: int, mode: str, out: Path) -> dict[str, Any]:
    """Run one measurement in fresh processes, one thread each; returns rank 0's result."""
    measured = ("cfg", "img_size", "batch", "warmup", "steps", "format", "accumulate")
    flags = {**common.flags_of(args, *measured), "--result": out}
    worker_argv = [str(Path(__file__).resolve()), "--worker", *common.as_argv(flags)]
    worker_argv += MODE_FLAGS[mode]
    cmd = [sys.executable, *worker_argv] if nproc == 1 else [*common.torchrun(nproc), *worker_argv]
    common.run_child(cmd, common.child_env(1), f"measurement ({nproc} process(es), {mode})")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def measure(args: argparse.Namespace, kinds: list[tuple[int, str]]) -> tuple[dict, list[float]]:
    """``--repeat`` rounds of every measurement in turn: the best run of each, and the paired
    ratios (each round's N-process img/s over that round's 1-process img/s)."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    paired: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for nproc, mode in kinds:
                r = launch(args, nproc, mode, Path(tmp) / "result.json")
                print(
                    f"run {rep + 1}: {nproc} process(es) {mode}: {r['img_per_s']:.2f} img/s",
                    file=sys.stderr,
                )
                if nproc == 1:
                    single_this_rep = r["img_per_s"]
                elif mode == "step":
                    paired.append(r["img_per_s"] / single_this_rep)
                if (nproc, mode) not in best or r["img_per_s"] > best[nproc, mode]["img_per_s"]:
                    best[nproc, mode] = r
    return best, paired


def table_rows(args: argparse.Namespace, kinds: list, best: dict) -> list[dict[str, Any]]:
    single = best[1, "step"]
    rows = []
    for nproc, mode in kinds:
        b = best[nproc, mode]
        rows.append(
            {
                "processes": nproc,
                "all_reduce": "-" if nproc == 1 else MODE_WORDS[mode],
                "accumulate": args.accumulate,
                "batch_per_process": args.batch,
                "img_per_s": round(b["img_per_s"], 3),
                "img_per_s_per_process": round(b["img_per_s"] / nproc, 3),
                "vs_1_process": round(b["img_per_s"] / single["img_per_s"], 3),
                "cpu_share": round(b["cpu_share"], 3),
                "img_per_cpu_s": round(b["img_per_cpu_s"], 3),
                "projected_vs_1_process": round(
                    nproc * b["img_per_cpu_s"] / single["img_per_cpu_s"], 3
                ),
            }
        )
    return rows


def print_table(args: argparse.Namespace, info: dict, rows: list, paired: list, best: dict) -> None:
    print(
        f"\nDDP scaling, {Path(args.cfg).name} at {args.img_size} px, batch {args.batch} per "
        f"process, {args.format}, 1 thread per process, gloo; {info['cpu']}, "
        f"{info['cpu_count']} CPUs; train step on synthetic data (no data pipeline), "
        f"best of {args.repeat}, accumulate {args.accumulate}"
    )
    print(
        f"{'processes':>9s} {'all-reduce':>10s} {'img/s':>8s} {'img/s/proc':>10s} "
        f"{'vs 1 proc':>9s} {'CPU share':>9s} {'img/CPU-s':>9s} {'free cores':>10s}"
    )
    for r in rows:
        print(
            f"{r['processes']:9d} {r['all_reduce']:>10s} "
            f"{r['img_per_s']:8.2f} {r['img_per_s_per_process']:10.2f} "
            f"{r['vs_1_process']:8.2f}x {r['cpu_share']:9.0%} {r['img_per_cpu_s']:9.2f} "
            f"{r['projected_vs_1_process']:9.2f}x"
        )
    print(
        f"{args.nproc}-process / 1-process throughput: {rows[1]['vs_1_process']:.2f}x best of "
        f"each, {statistics.median(paired):.2f}x median of paired runs "
        f"({', '.join(f'{x:.2f}' for x in paired)}; ideal {args.nproc}.00x)"
    )
    print(
        "CPU share: CPU time the processes got / (wall time x processes); below 100% other work "
        "took cores. free cores: the ratio projected for idle cores from images per CPU-second "
        f"(processes x img/CPU-s / 1-process img/CPU-s): {rows[1]['projected_vs_1_process']:.2f}x"
    )
    if args.accumulate > 1:
        step, every = best[args.nproc, "step"], best[args.nproc, "every"]
        print(
            f"accumulate {args.accumulate}: all-reduce per optimizer step (no_sync) vs per "
            f"micro-batch: {step['img_per_s'] / every['img_per_s']:.2f}x img/s, "
            f"{step['img_per_cpu_s'] / every['img_per_cpu_s']:.2f}x img/CPU-s"
        )


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--cfg", type=Path, default=common.REPO / "cfg" / "yolov3-spp-nano.cfg")
    p.add_argument("--img-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="images per process per step")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="channels_last",
        help="memory format (trainer's default)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes of the DDP measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per measurement")
    p.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    p.add_argument("--repeat", type=int, default=2, help="runs of each measurement; best counts")
    p.add_argument("--skip-no-sync", action="store_true", help="skip the no-all-reduce bound")
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step: all-reduce once per this many steps",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-sync", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sync-every-batch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace) -> None:
    """The flags, before any process starts (a bad one was every worker's traceback).

    Raises:
        ConfigError: a count below 1 (``--warmup`` below 0, ``--nproc`` below 2), an
            ``--img-size`` the model cannot take, a bad ``--cfg``, a step that cannot fit.
        OutputError: ``--json``'s folder cannot be made.
    """
    check_at_least(common.flags_of(args, "batch", "steps", "repeat", "accumulate"), 1)
    check_at_least(common.flags_of(args, "warmup"), 0)
    check_at_least(common.flags_of(args, "nproc"), 2)
    check_img_size(args.img_size)
    check_model_fits(parse_model_cfg(args.cfg), args.img_size, args.batch, training=True)
    common.check_json(args.json)


def bench(args: argparse.Namespace) -> None:
    if args.worker:
        result = worker(args)
        if result["rank"] == 0 and args.result is not None:
            args.result.write_text(json.dumps(result))
        return
    check_args(args)
    kinds = [(1, "step"), (args.nproc, "step")]
    if args.accumulate > 1:
        kinds.append((args.nproc, "every"))
    if not args.skip_no_sync:
        kinds.append((args.nproc, "nosync"))
    best, paired = measure(args, kinds)
    rows = table_rows(args, kinds, best)
    info = common.machine_info(
        cfg=str(args.cfg),
        img_size=args.img_size,
        format=args.format,
        threads_per_process=1,
        backend="gloo",
        steps=args.steps,
        warmup=args.warmup,
        repeat=args.repeat,
        gloo_available=dist.is_gloo_available(),
    )
    print_table(args, info, rows, paired, best)
    report = {
        "info": info,
        "results": rows,
        "ratio": rows[1]["vs_1_process"],
        "ratio_paired_median": round(statistics.median(paired), 3),
        "ratios_paired": [round(x, 3) for x in paired],
        "ratio_projected_free_cores": rows[1]["projected_vs_1_process"],
    }
    common.write_report(args.json, report)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
