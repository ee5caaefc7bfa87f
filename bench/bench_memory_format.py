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
import json
import logging
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.darknet import (  # noqa: E402
    Darknet,
    model_blocks_for,
)
from train_utils.memory_format import (  # noqa: E402
    choose_channels_last,
    cpu_model,
    time_train_step,
)

# name -> (cfg, image side, batch): each model at a size and batch people train it with on a CPU.
MODELS = {
    "yolov3-spp": (REPO / "cfg" / "yolov3-spp.cfg", 320, 4),
    "yolov3-tiny": (REPO / "cfg" / "darknet" / "yolov3-tiny.cfg", 416, 8),
    "yolov4-tiny": (REPO / "cfg" / "darknet" / "yolov4-tiny.cfg", 416, 8),
    "nano": (REPO / "cfg" / "yolov3-spp-nano.cfg", 160, 16),
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
            t = time_train_step(model, size, batch, cpu, channels_last, steps=1)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeat", type=int, default=3, help="check timings per format")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--size", type=int, default=None, help="override every model's size")
    parser.add_argument("--batch", type=int, default=None, help="override every model's batch")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    header = (
        f"{'model':12} {'size':>4} {'batch':>5} | {'contig ms':>9} {'NHWC ms':>8} -> "
        f"{'auto':13} | {'check contig':>12} {'check NHWC':>10} {'auto/contig':>11} "
        f"{'auto/NHWC':>9}"
    )
    print(header)
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
    if args.json:
        info = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}
        args.json.write_text(json.dumps({"info": info, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
