"""End to end: seconds per epoch and time to a target mAP of the demo recipe.

Trains the demo recipe (``tools/demo.py``: its cfg, ``cfg/hyp_demo.yaml``, the shapes dataset
in ``demo_data/shapes``, generated if missing) through ``trainer.run`` --
``train.py``'s code path, data pipeline, EMA and evaluation included -- for ``--epochs`` epochs,
evaluating after every epoch, and reports per epoch the training seconds, the evaluation
mAP@0.5 and mAP@0.5:0.95, and the cumulative training time at which mAP@0.5 first reached
``--target-map50`` (time to target). ``--amp``, ``--channels-last`` and ``--compile`` are
passed to the trainer, so the same command compares precisions and formats.

Only ``--epochs`` and ``--eval-interval`` (1, to see every epoch) differ from the recipe; the
cosine learning-rate schedule spans ``--epochs``, so a short run is not a prefix of the full
demo. Evaluation time is not in "train s" (it is the rest of "total s", with start-up).

Usage, from the repository root::

    python bench/bench_e2e.py --epochs 2                      # fp32 (channels_last, the default)
    python bench/bench_e2e.py --epochs 2 --amp --json amp.json
    python bench/bench_e2e.py --epochs 27 --target-map50 0.85  # the whole demo recipe

On a CPU without native bf16 kernels the trainer runs ``--amp`` in fp32 (it says so in a
warning); ``--force-bf16`` makes it use bf16 autocast anyway, e.g. to compare the mAP of bf16
training with fp32 on such a machine (slowly: the generic convolution, see bench/README.md).
``--emulate-bf16`` answers the accuracy question at fp32 speed: every layer's output (and so
the gradient flowing back into it) and every convolution's input and weight is rounded to bf16,
the points where bf16 autocast stores values in bf16, while the arithmetic stays fp32 (native
bf16 convolutions also accumulate in fp32). ``--seed`` and ``--threads``
make runs of several seeds side by side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from build_utils.checks import check_at_least
from tools.demo import (
    DEMO_DATA_DIR,
    DEMO_TRAIN_FLAGS,
    DEMO_TRAIN_SWITCHES,
    TARGET_MAP50,
    ensure_demo_dataset,
)
from train_utils import precision, trainer
from train_utils.cli import parse_args, run_script
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.devices import select_device
from train_utils.distributed.process_group import DistInfo
from train_utils.reporting import read_results
from train_utils.trainer import RunSummary, run


def _round_bf16(x: Any) -> Any:
    """``x`` rounded to the nearest bf16 value, kept in its dtype; its gradient is rounded the
    same way on the way back (the backward of a dtype cast casts the gradient)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.bfloat16).to(x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_round_bf16(t) for t in x)
    return x


class _Bf16RoundedConv2d(torch.nn.Conv2d):
    """A Conv2d whose input and weight are rounded to bf16, as autocast casts them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else _round_bf16(self.bias)
        return self._conv_forward(_round_bf16(x), _round_bf16(self.weight), bias)


def emulate_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` compute as under bf16 autocast, in fp32 arithmetic (see the module doc).

    The class swap (rather than a bound ``forward``) and plain forward hooks survive the
    ``deepcopy`` of the EMA and of the memory-format probe, so evaluation is rounded too.
    """
    for m in model.modules():
        if type(m) is torch.nn.Conv2d:
            m.__class__ = _Bf16RoundedConv2d
        if not any(True for _ in m.children()):
            m.register_forward_hook(lambda _m, _inp, out: _round_bf16(out))
    return model


def _install_bf16_emulation() -> None:
    """Wrap the trainer's model builder so that the run's model is :func:`emulate_bf16`'d."""
    build = trainer.build_training_model

    def build_emulated(*a: Any, **kw: Any) -> Any:
        model, *rest = build(*a, **kw)
        return (emulate_bf16(model), *rest)

    trainer.build_training_model = build_emulated


def train_flags(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    """The demo recipe's train.py flags with this benchmark's overrides."""
    flags = {**DEMO_TRAIN_FLAGS, "--data": data, "--output-dir": out}
    flags.update(common.flags_of(args, "epochs", "eval_interval", "device", "seed"))
    given = common.flags_of(args, "workers", "img_size")
    flags.update({flag: value for flag, value in given.items() if value is not None})
    argv = [*common.as_argv(flags), *DEMO_TRAIN_SWITCHES]
    if args.amp:
        argv.append("--amp")
    if args.channels_last is not None:
        argv.append("--channels-last" if args.channels_last else "--no-channels-last")
    if args.compile:
        argv.append("--compile")
    return argv


def summarise(rows: list[dict[str, str]], target: float) -> tuple[list[dict[str, Any]], Any]:
    """Per-epoch rows with cumulative training seconds, and the time to ``target`` mAP@0.5."""
    out, total, reached = [], 0.0, None
    for r in rows:
        total += float(r["train_seconds"])
        evaluated = bool(r["mAP50"])  # empty between --eval-interval epochs
        row = {
            "epoch": int(r["epoch"]),
            "train_s": round(float(r["train_seconds"]), 2),
            "cumulative_train_s": round(total, 2),
            "mAP50": round(float(r["mAP50"]), 4) if evaluated else None,
            "mAP50-95": round(float(r["mAP50-95"]), 4) if evaluated else None,
            "loss": round(float(r["loss"]), 4),
        }
        out.append(row)
        if reached is None and evaluated and row["mAP50"] >= target:
            reached = {"epoch": row["epoch"], "cumulative_train_s": row["cumulative_train_s"]}
    return out, reached


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--data", type=Path, default=None, help="a .data file (default: the demo's)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--amp", action="store_true", help="train.py --amp (bf16 autocast on CPU)")
    p.add_argument(
        "--force-bf16",
        action="store_true",
        help="with --amp on a CPU without native bf16: use bf16 anyway (slow)",
    )
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train.py --channels-last / --no-channels-last (default: the trainer's)",
    )
    p.add_argument("--compile", action="store_true", help="train.py --compile")
    p.add_argument(
        "--emulate-bf16",
        action="store_true",
        help="fp32 arithmetic with bf16 rounding where autocast stores bf16 (accuracy study)",
    )
    p.add_argument("--seed", type=int, default=0, help="train.py --seed")
    p.add_argument("--eval-interval", type=int, default=1, help="evaluate every N epochs")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--img-size", type=int, default=None, help="override the recipe's size")
    p.add_argument("--workers", type=int, default=None, help="override the recipe's workers")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--target-map50", type=float, default=TARGET_MAP50)
    p.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="keep the run here (default: a temporary folder)",
    )
    return p


def train(args: argparse.Namespace) -> tuple[list[str], RunSummary, float, list[dict[str, str]]]:
    """The recipe's run through ``trainer.run``: its train.py flags, its summary, its seconds
    and its ``results.csv`` rows."""
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or ensure_demo_dataset(DEMO_DATA_DIR)
        flags = train_flags(args, data, args.output_dir or Path(tmp) / "run")
        print(f"python train.py {' '.join(flags)}", file=sys.stderr)
        config = build_config(parse_args(get_args_parser(), flags))
        t0 = time.perf_counter()
        summary = run(config, DistInfo.single(select_device(config.device)))
        total = time.perf_counter() - t0
        return flags, summary, total, read_results(summary.output_dir / "results.csv")


def print_table(args: argparse.Namespace, info: dict, rows: list, reached: Any) -> float:
    """The epochs' table and the time to the target; returns the seconds per epoch (training,
    the epochs after the first)."""
    train_s = [r["train_s"] for r in rows]
    mean_epoch = sum(train_s[1:]) / len(train_s[1:]) if len(train_s) > 1 else train_s[0]
    print(
        f"\ndemo recipe, {args.epochs} epoch(s), amp {'on' if args.amp else 'off'}"
        f"{' (forced bf16)' if args.force_bf16 else ''}, channels_last "
        f"{'default' if args.channels_last is None else args.channels_last}, compile "
        f"{args.compile}; {info['cpu']}, {info['cpu_count']} CPUs, {info['threads']} threads"
    )
    print(f"{'epoch':>5s} {'train s':>8s} {'cum. s':>8s} {'mAP@0.5':>8s} {'mAP@.5:.95':>10s}")
    for r in rows:
        print(
            f"{r['epoch']:5d} {r['train_s']:8.1f} {r['cumulative_train_s']:8.1f} "
            + (f"{r['mAP50']:8.4f} {r['mAP50-95']:10.4f}" if r["mAP50"] is not None else "")
        )
    print(
        f"seconds per epoch (training, epochs after the first): {mean_epoch:.1f}; "
        f"total with evaluation and start-up: {info['total_s']:.1f} s"
    )
    if reached:
        print(
            f"mAP@0.5 >= {args.target_map50} after epoch {reached['epoch']}, "
            f"{reached['cumulative_train_s']:.1f} s of training"
        )
    else:
        print(f"mAP@0.5 did not reach {args.target_map50} in {args.epochs} epoch(s)")
    return mean_epoch


def bench(args: argparse.Namespace) -> None:
    check_at_least(common.flags_of(args, "epochs", "eval_interval", "threads"), 1)
    common.check_json(args.json)
    if args.force_bf16:
        # Benchmark-only switch: the trainer's check for native bf16 kernels says yes.
        precision.cpu_bf16_is_fast = lambda: True
    if args.emulate_bf16:
        _install_bf16_emulation()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags, summary, total, results = train(args)
    rows, reached = summarise(results, args.target_map50)
    info = common.machine_info(
        flags=flags,
        threads=torch.get_num_threads(),
        force_bf16=args.force_bf16,
        emulate_bf16=args.emulate_bf16,
        seed=args.seed,
        total_s=round(total, 1),
        epochs=summary.epochs_run,
    )
    report = {"info": info, "epochs": rows, "target_map50": args.target_map50}
    report["s_per_epoch"] = round(print_table(args, info, rows, reached), 2)
    common.write_report(args.json, {**report, "time_to_target": reached})


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
