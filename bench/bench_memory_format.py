"""The automatic memory-format choice of training, per model: what it picks and what it is worth.

For each cfg (at its size and batch), asks :func:`train_utils.memory_format.choose_channels_last`
for the decision exactly as ``train.py`` does with no ``--channels-last`` flag (two timed train
steps per format, no cache), then checks the decision: the train step (forward, loss-like
reduction, backward) is timed again ``--repeat`` times per format, the formats called in turn,
and the auto choice's best time is set against contiguous's. "auto vs contiguous" >= 1.00 means
the default never trains slower than the plain layout; "auto vs channels_last" the same against
the former always-channels_last default.

    python bench/bench_memory_format.py                    # the four models of bench/README.md
    python bench/bench_memory_format.py --models nano --json mf.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from build_utils.checks import check_at_least
from models.darknet import Darknet, model_blocks_for
from train_utils.cli import check_img_size, run_script
from train_utils.memory_format import choose_channels_last, time_train_step

# name -> (cfg, image side, batch): each model at a size and batch people train it with on a CPU.
MODELS = {
    "yolov3-spp": (common.REPO / "cfg" / "yolov3-spp.cfg", 320, 4),
    "yolov3-tiny": (common.REPO / "cfg" / "darknet" / "yolov3-tiny.cfg", 416, 8),
    "yolov4-tiny": (common.REPO / "cfg" / "darknet" / "yolov4-tiny.cfg", 416, 8),
    "nano": (common.REPO / "cfg" / "yolov3-spp-nano.cfg", 160, 16),
}
CLASSES = 80


def bench_one(name: str, cfg: Path, size: int, batch: int, repeat: int) -> dict:
    model = Darknet(model_blocks_for(cfg, CLASSES), img_size=(size, size))
    cpu = torch.device("cpu")
    choice = choose_channels_last(
        None, cpu, name, lambda cl: time_train_step(model, size, batch, cpu, cl), cache=None
    )
    best = {False: float("inf"), True: float("inf")}
    for _ in range(repeat):
        for channels_last in (False, True):
            t = time_train_step(model, size, batch, cpu, channels_last, steps=1).seconds
            best[channels_last] = min(best[channels_last], t)
    auto = best[choice.channels_last]
    return {
        "model": name,
        "img_size": size,
        "batch": batch,
        "decision_contiguous_s": round(choice.contiguous_s, 4),
        "decision_channels_last_s": round(choice.channels_last_s, 4),
        "auto": "channels_last" if choice.channels_last else "contiguous",
        "check_contiguous_s": round(best[False], 4),
        "check_channels_last_s": round(best[True], 4),
        "auto_vs_contiguous": round(best[False] / auto, 3),
        "auto_vs_channels_last": round(best[True] / auto, 3),
    }


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--repeat", type=int, default=3, help="check timings per format")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--size", type=int, default=None, help="override every model's size")
    p.add_argument("--batch", type=int, default=None, help="override every model's batch")
    return p


def bench(args: argparse.Namespace) -> None:
    check_at_least({"--repeat": args.repeat, "--threads": args.threads, "--batch": args.batch}, 1)
    if args.size is not None:
        check_img_size(args.size, "--size")
    common.check_json(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = common.machine_info(threads=torch.get_num_threads())
    print(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}")
    print(
        f"{'model':12} {'size':>4} {'batch':>5} | {'contig ms':>9} {'NHWC ms':>8} -> "
        f"{'auto':13} | {'check contig':>12} {'check NHWC':>10} {'auto/contig':>11} "
        f"{'auto/NHWC':>9}"
    )
    rows = []
    for name in args.models:
        cfg, size, batch = MODELS[name]
        r = bench_one(name, cfg, args.size or size, args.batch or batch, args.repeat)
        rows.append(r)
        print(
            f"{name:12} {r['img_size']:>4} {r['batch']:>5} | "
            f"{r['decision_contiguous_s'] * 1000:>9.0f} "
            f"{r['decision_channels_last_s'] * 1000:>8.0f} -> {r['auto']:13} | "
            f"{r['check_contiguous_s'] * 1000:>12.0f} "
            f"{r['check_channels_last_s'] * 1000:>10.0f} {r['auto_vs_contiguous']:>10.2f}x "
            f"{r['auto_vs_channels_last']:>8.2f}x",
            flush=True,
        )
    common.write_report(args.json, {"info": info, "results": rows})


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
