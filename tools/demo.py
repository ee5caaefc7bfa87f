"""The demo recipe as one command: data, training, evaluation and prediction, offline.

    python tools/demo.py                          # generates demo_data/shapes, trains, evaluates
    python tools/demo.py --data my.data --epochs 50 --output-dir runs/mine

Without ``--data`` it writes the synthetic shapes dataset (``data/make_shapes.py``) and trains
``cfg/yolov3-spp-nano.cfg`` from scratch with ``cfg/hyp_demo.yaml``, the recipe tuned to reach
mAP@0.5 >= 0.85 within about ten CPU minutes (see README). Training goes through ``train.py``'s
code path; evaluation through ``validation.py``'s; prediction images through ``predict.py``'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import predict  # noqa: E402
import validation  # noqa: E402
from data.make_shapes import make_dataset  # noqa: E402
from train_utils.cli import run_main, setup_console_logging  # noqa: E402
from train_utils.config import build_config, get_args_parser  # noqa: E402
from train_utils.devices import select_device  # noqa: E402
from train_utils.distributed_utils import DistInfo  # noqa: E402
from train_utils.trainer import run  # noqa: E402

logger = logging.getLogger("demo")

# The demo recipe. Each value is a flag of train.py; see README "The demo" for why.
DEMO_DATA_DIR = REPO / "demo_data" / "shapes"
DEMO_DATASET = {
    "n_train": 1500,
    "n_val": 200,
    "img_size_range": (160, 192),
    "seed": 0,
    "obj_size_range": (20.0, 0.5),
}
DEMO_TRAIN_FLAGS = {
    "--cfg": str(REPO / "cfg" / "yolov3-spp-nano.cfg"),
    "--hyp": str(REPO / "cfg" / "hyp_demo.yaml"),
    "--img-size": "160",
    "--batch-size": "16",
    "--nbs": "16",
    "--optimizer": "adam",
    "--epochs": "27",
    "--eval-interval": "5",
    "--cache-images": "ram",
    "--workers": "0",
}
DEMO_TRAIN_SWITCHES = ["--no-multi-scale"]
N_PREDICT_IMAGES = 4
TARGET_MAP50 = 0.85


def ensure_demo_dataset(root: Path) -> Path:
    """Generate the shapes dataset unless an identical one is already there."""
    stamp = root / "dataset.json"
    wanted = json.dumps(
        {k: list(v) if isinstance(v, tuple) else v for k, v in DEMO_DATASET.items()}, sort_keys=True
    )
    if stamp.is_file() and stamp.read_text() == wanted and (root / "shapes.data").is_file():
        logger.info("using the existing demo dataset in %s", root)
        return root / "shapes.data"
    if stamp.is_file():
        # Made by an older recipe: start afresh so that no stale image or cache stays behind.
        shutil.rmtree(root)
    t0 = time.time()
    data = make_dataset(root, **DEMO_DATASET)
    stamp.write_text(wanted)
    logger.info(
        "generated %d + %d shapes images in %s (%.1f s)",
        DEMO_DATASET["n_train"],
        DEMO_DATASET["n_val"],
        root,
        time.time() - t0,
    )
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="a .data file (default: the shapes demo)")
    parser.add_argument("--output-dir", default="runs/demo", help="where the run is written")
    parser.add_argument("--device", default="", help="cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs")
    parser.add_argument("--amp", action="store_true", help="mixed precision (bf16 on CPU)")
    args = parser.parse_args(argv)
    setup_console_logging()

    def body() -> None:
        t0 = time.time()
        data = Path(args.data) if args.data else ensure_demo_dataset(DEMO_DATA_DIR)
        flags = {
            **DEMO_TRAIN_FLAGS,
            "--data": str(data),
            "--output-dir": args.output_dir,
            "--device": args.device,
        }
        if args.epochs is not None:
            flags["--epochs"] = str(args.epochs)
        train_argv = [x for kv in flags.items() for x in kv] + DEMO_TRAIN_SWITCHES
        if args.amp:
            train_argv.append("--amp")
        logger.info("training: python train.py %s", " ".join(train_argv))
        config = build_config(get_args_parser().parse_args(train_argv))
        device = select_device(config.device)
        summary = run(config, DistInfo.single(device))
        out = Path(args.output_dir)
        weights = out / "best.pt" if (out / "best.pt").is_file() else out / "last.pt"

        stats_file = out / "val_stats.json"
        code = validation.main(
            [
                "--cfg",
                str(out / "model.cfg"),
                "--data",
                str(data),
                "--weights",
                str(weights),
                "--img-size",
                flags["--img-size"],
                "--device",
                str(device),
                "--json-out",
                str(stats_file),
                "--save-dir",
                str(out / "val"),
            ]
        )
        if code:
            raise SystemExit(code)
        stats = json.loads(stats_file.read_text())

        val_list = Path(config.data.valid).read_text().split()[:N_PREDICT_IMAGES]
        list_dir = Path(config.data.valid).parent
        pred_dir = out / "predictions"
        sources = [str(p if Path(p).is_absolute() else list_dir / p) for p in val_list]
        code = predict.main(
            [
                "--weights",
                str(weights),
                "--source",
                *sources,
                "--output",
                str(pred_dir),
                "--img-size",
                flags["--img-size"],
                "--device",
                str(device),
            ]
        )
        if code:
            raise SystemExit(code)

        minutes = (time.time() - t0) / 60
        verdict = "reached" if stats["mAP50"] >= TARGET_MAP50 else "NOT reached"
        print(
            f"\nDemo finished in {minutes:.1f} min (training {summary.seconds / 60:.1f} min).\n"
            f"  mAP@0.5 = {stats['mAP50']:.3f}, mAP@0.5:0.95 = {stats['mAP50-95']:.3f} on "
            f"{data}; the demo target mAP@0.5 >= {TARGET_MAP50} was {verdict}\n"
            f"  results:     {out / 'results.csv'} and {out / 'results.png'}\n"
            f"  weights:     {out / 'best.pt'}, {out / 'last.pt'}\n"
            f"  predictions: {pred_dir}/\n"
            f"  TensorBoard: tensorboard --logdir {out}"
        )

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
