"""Darknet itself against ``train.py --recipe darknet`` and the default recipe, on the shapes data.

One Darknet tiny cfg (``--cfg``, default ``cfg/darknet/yolov4-tiny.cfg``) rewritten for the
shapes' 5 classes and for this run's ``[net]`` keys (``--size``, ``--batch``,
``--iterations`` as ``max_batches``, ``--burn-in``, the steps at 80 % and 90 %,
``--learning-rate``), trained three ways on the same generated shapes data:

1. by Darknet itself, built from ``../shared/darknet`` for the CPU with ``AVX=1 OPENMP=1
   OPTS=-O2``: ``darknet detector train DATA CFG -dont_show -clear`` (from scratch; the CPU
   build has no OpenCV, so no mosaic: the cfg asks for none);
2. by ``train.py --recipe darknet`` with each of ``--seeds``;
3. by ``train.py`` (the default recipe) with the same cfg, ``--img-size``, ``--batch-size`` and
   as many epochs as Darknet's iterations hold images (rounded up).

Every result is scored by ``validation.py`` on the validation split (Darknet's
``<cfg>_final.weights`` load here), so the mAP figures differ only by training. Each row gives
the wall seconds of the training command (start-up and the runs' own evaluations included) and
of its training proper (Darknet's per-iteration seconds summed; ours, the seconds of each
epoch or round of iterations in ``train.log``). Random streams differ from Darknet's, so
compare Darknet's mAP with the spread of the seeds.

Usage, from the repository root (figures: bench/README.md)::

    python bench/bench_darknet_recipe.py --iterations 600 --json darknet_recipe.json
    python bench/bench_darknet_recipe.py --iterations 20 --n-train 64 --seeds 0   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from build_utils.checks import check_at_least, check_real
from build_utils.errors import ConfigError
from build_utils.parse_config import format_model_cfg, parse_model_cfg
from data.make_shapes import make_dataset
from tools.make_cfg import make_cfg
from train_utils.cli import check_img_size, run_script

SHARED_TARBALL = common.REPO.parent / "shared" / "darknet" / "darknet-59596d78.tar.gz"
BUILD_DIR = common.REPO / ".cache-darknet" / "bench-avx-omp-O2"
FIXED_BUILD_DIR = common.REPO / ".cache-darknet" / "bench-avx-omp-O2-7320-fixed"
# -O2, not the Makefile's -Ofast: its fast-math drops Darknet's isnan checks, and a yolov4-tiny
# run here turned its loss NaN for good at iteration 82 (bench/README.md).
MAKE_FLAGS = ("AVX=1", "OPENMP=1", "OPTS=-O2")
CLASSES = 5
STEP_FRACTIONS = (0.8, 0.9)  # policy=steps: the rate x0.1 at these shares of the iterations
DARKNET_ITERATION = re.compile(
    r"^\s*(\d+): [-\d.naif]+, [-\d.naif]+ avg loss, .* ([\d.]+) seconds,"
)
# train.log's line after each epoch or round of iterations: "..., 12.3 s, data wait ...".
OUR_ROUND = re.compile(r"(?:epoch|iteration) \d+/\d+: .*?, ([\d.]+) s, data wait")
CHILD_TIMEOUT_S = 24 * 3600


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--cfg", type=Path, default=common.REPO / "cfg/darknet/yolov4-tiny.cfg")
    p.add_argument("--work", type=Path, default=Path("runs/bench_darknet_recipe"))
    p.add_argument("--iterations", type=int, default=600, help="max_batches")
    p.add_argument("--size", type=int, default=128, help="network width and height")
    p.add_argument("--width", type=float, default=None, help="filters x W (tools/make_cfg.py)")
    p.add_argument("--batch", type=int, default=16, help="[net] batch (subdivisions 1)")
    p.add_argument("--burn-in", type=int, default=100)
    p.add_argument("--learning-rate", type=float, default=None, help="default: the cfg's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--threads", type=int, default=2, help="of Darknet and of torch")
    p.add_argument("--parts", nargs="+", default=["darknet", "recipe", "default"])
    p.add_argument(
        "--darknet-as-released",
        action="store_true",
        help="build Darknet without the AlexeyAB/darknet#7320 fix (its CPU build then drops the "
        "gradient every [route] passes back)",
    )
    return p


def check_flags(args: argparse.Namespace) -> None:
    flags = common.flags_of(args, "iterations", "batch", "n_train", "n_val", "threads")
    check_at_least(flags, 1)
    check_at_least(common.flags_of(args, "burn_in"), 0)
    check_img_size(args.size, "--size")
    for flag, value in common.flags_of(args, "learning_rate", "width").items():
        if value is not None:
            check_real(flag, value, positive=True)
    unknown = set(args.parts) - {"darknet", "recipe", "default"}
    if unknown:
        raise ConfigError(f"--parts: unknown {', '.join(sorted(unknown))}")
    if "darknet" in args.parts and not SHARED_TARBALL.is_file():
        raise ConfigError(f"{SHARED_TARBALL} is absent: Darknet cannot be built (--parts recipe)")
    common.check_json(args.json)


# ---- data and cfg ---------------------------------------------------------------------------


def prepare_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The shapes dataset (ours: ``shapes.data``) and its Darknet layout (``darknet.data``:
    labels beside the images, absolute image lists)."""
    root = work / "shapes"
    data = root / "shapes.data"
    if not data.is_file():
        size = (args.size, args.size + args.size // 4)
        make_dataset(
            root, args.n_train, args.n_val, img_size_range=size, seed=1, obj_size_range=(12.0, 0.5)
        )
    lists = {}
    for split in ("train", "val"):
        images = [root / line for line in (root / f"{split}.txt").read_text().split()]
        for image in images:
            label = root / split / "labels" / image.with_suffix(".txt").name
            shutil.copy(label, image.with_suffix(".txt"))
        lists[split] = root / f"{split}-darknet.txt"
        lists[split].write_text("".join(f"{p.resolve()}\n" for p in images))
    darknet = root / "darknet.data"
    darknet.write_text(
        f"classes={CLASSES}\ntrain={lists['train']}\nvalid={lists['val']}\n"
        f"names={(root / 'shapes.names').resolve()}\nbackup={(work / 'darknet').resolve()}\n"
    )
    return data, darknet


def prepare_cfg(args: argparse.Namespace, work: Path) -> Path:
    """``--cfg`` for 5 classes with this run's ``[net]`` keys."""
    source = make_cfg(args.cfg, nc=CLASSES, width=args.width, output=work / "source.cfg")
    blocks = parse_model_cfg(source)
    net = blocks[0]
    steps = [max(1, int(args.iterations * f)) for f in STEP_FRACTIONS]
    net.update(width=args.size, height=args.size, batch=args.batch, subdivisions=1)
    net.update(max_batches=args.iterations, burn_in=args.burn_in, policy="steps", steps=steps)
    net.update(scales=[0.1] * len(steps))
    if args.learning_rate is not None:
        net["learning_rate"] = args.learning_rate
    cfg = work / f"{args.cfg.stem}-shapes.cfg"
    cfg.write_text(format_model_cfg(blocks))
    return cfg


# ---- the three trainings ----------------------------------------------------------------------


def build_darknet(as_released: bool) -> Path:
    """Darknet's program, built once into ``.cache-darknet/``: with AlexeyAB/darknet#7320 fixed
    (its CPU build drops the gradient a [route] passes back; tests/darknet_ref/build.py) unless
    ``as_released``."""
    build_dir = BUILD_DIR if as_released else FIXED_BUILD_DIR
    program = build_dir / "darknet" / "darknet"
    if program.is_file():
        return program
    build_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(SHARED_TARBALL) as tar:
        tar.extractall(build_dir, filter="data")
    source = program.parent
    if not as_released:
        # The fix's one copy is the Darknet reference's, whose tests prove that build equals
        # ours. Imported here, not at the top: only this part needs the test tree, and it needs
        # ../shared/darknet, which exists only beside a development checkout (and tests/).
        from tests.darknet_ref.build import fixed_sources

        for rel, text in fixed_sources(source).items():
            (source / rel).write_text(text)
    subprocess.run(
        ["make", "-C", str(source), "-j2", *MAKE_FLAGS],
        check=True,
        capture_output=True,
        timeout=CHILD_TIMEOUT_S,
    )
    return program


def train_darknet(args: argparse.Namespace, work: Path, cfg: Path, data: Path) -> dict[str, Any]:
    program = build_darknet(args.darknet_as_released)
    backup = work / "darknet"
    backup.mkdir(exist_ok=True)
    cmd = [str(program), "detector", "train", str(data), str(cfg.resolve()), "-dont_show", "-clear"]
    t0 = time.time()
    proc = subprocess.run(
        cmd,
        cwd=backup,
        env=common.child_env(args.threads),
        text=True,
        capture_output=True,
        timeout=CHILD_TIMEOUT_S,
    )
    wall = time.time() - t0
    (backup / "train.log").write_text(proc.stdout + proc.stderr)
    weights = backup / f"{cfg.stem}_final.weights"
    if proc.returncode != 0 or not weights.is_file():
        tail = (proc.stdout + proc.stderr)[-common.OUTPUT_TAIL_CHARS :]
        raise RuntimeError(f"darknet detector train failed (exit {proc.returncode}):\n{tail}")
    seconds = [
        float(m.group(2)) for m in map(DARKNET_ITERATION.match, proc.stdout.splitlines()) if m
    ]
    return {
        "run": "Darknet (CPU)" if args.darknet_as_released else "Darknet (CPU, #7320 fixed)",
        "seed": "-",
        "weights": weights,
        "wall_s": round(wall, 1),
        "train_s": round(sum(seconds), 1),
        "length": f"{len(seconds)} iterations",
    }


def train_ours(
    args: argparse.Namespace, out: Path, cfg: Path, data: Path, seed: int, recipe: bool
) -> dict[str, Any]:
    flags = {"--cfg": cfg, "--data": data, "--output-dir": out, "--device": "cpu", "--seed": seed}
    if recipe:
        flags.update({"--recipe": "darknet", "--eval-iterations": args.iterations})
        length = f"{args.iterations} iterations"
    else:
        epochs = math.ceil(args.iterations * args.batch / args.n_train)
        flags.update({"--img-size": args.size, "--batch-size": args.batch, "--epochs": epochs})
        flags["--eval-interval"] = epochs
        length = f"{epochs} epochs"
    cmd = [sys.executable, "train.py", *common.as_argv(flags)]
    if not recipe:
        cmd.append("--no-multi-scale")
    t0 = time.time()
    common.run_child(cmd, common.child_env(args.threads), f"train.py ({out.name})", CHILD_TIMEOUT_S)
    wall = time.time() - t0
    log = (out / "train.log").read_text()
    train_s = sum(float(s) for s in OUR_ROUND.findall(log))
    name = "train.py --recipe darknet" if recipe else "train.py (default recipe)"
    return {
        "run": name,
        "seed": seed,
        "weights": out / "last.pt",
        "wall_s": round(wall, 1),
        "train_s": round(train_s, 1),
        "length": length,
    }


def score(args: argparse.Namespace, row: dict[str, Any], cfg: Path, data: Path) -> None:
    """``validation.py``'s mAP of the row's weights, into the row."""
    weights = Path(row.pop("weights"))
    stats = weights.with_name(weights.stem + "-val.json")
    flags = {
        "--weights": weights,
        "--cfg": cfg,
        "--data": data,
        "--img-size": args.size,
        "--device": "cpu",
        "--json-out": stats,
        "--save-dir": weights.parent / "val",
    }
    cmd = [sys.executable, "validation.py", *common.as_argv(flags), "--exist-ok"]
    common.run_child(cmd, common.child_env(args.threads), f"validation.py ({weights})")
    values = json.loads(stats.read_text())
    row["mAP50"], row["mAP50-95"] = round(values["mAP50"], 4), round(values["mAP50-95"], 4)


def bench(args: argparse.Namespace) -> None:
    check_flags(args)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data, darknet_data = prepare_data(args, work)
    cfg = prepare_cfg(args, work)
    info = common.machine_info(
        cfg=str(args.cfg),
        width=args.width,
        size=args.size,
        batch=args.batch,
        iterations=args.iterations,
        threads=args.threads,
    )
    runs = []
    if "darknet" in args.parts:
        runs.append(lambda: train_darknet(args, work, cfg, darknet_data))
    for seed in args.seeds if "recipe" in args.parts else []:
        out = work / f"recipe-seed{seed}"
        runs.append(lambda out=out, seed=seed: train_ours(args, out, cfg, data, seed, recipe=True))
    if "default" in args.parts:
        runs.append(lambda: train_ours(args, work / "default", cfg, data, 0, recipe=False))
    rows = []
    for train in runs:
        # Scored and reported as each ends: a later failure keeps the rows measured.
        row = train()
        score(args, row, cfg, data)
        rows.append(row)
        common.write_report(args.json, {"info": info, "rows": rows})
    print_table(args, info, rows)


def print_table(args: argparse.Namespace, info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"{args.cfg.name} for 5 classes at {args.size} px, batch {args.batch}, "
        f"{args.iterations} iterations; {info.get('cpu', '?')}, {args.threads} threads"
    )
    print(
        f"{'run':<30} {'seed':>4} {'length':>16} {'wall s':>8} {'train s':>8} "
        f"{'mAP@0.5':>8} {'mAP@.5:.95':>10}"
    )
    for r in rows:
        print(
            f"{r['run']:<30} {r['seed']!s:>4} {r['length']:>16} {r['wall_s']:>8} "
            f"{r['train_s']:>8} {r['mAP50']:>8.4f} {r['mAP50-95']:>10.4f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
