"""Model speed: forward (eval) and train-step images per second, against a convolution ceiling.

For a cfg at given sizes and batch sizes, each of the variants

- precision ``fp32``, ``bf16`` or ``fp16``: ``torch.autocast`` around the forward in that
  dtype (the loss, the fp32 master weights and SGD stay fp32, as in ``train_one_epoch``; fp16
  trains with a ``GradScaler``, on CUDA only);
- memory format ``contiguous`` (NCHW), or ``channels_last`` (NHWC; model and input converted);
- optionally ``--compile``: ``torch.compile`` of the model (fp32, each memory format);

is timed for

- ``eval``: ``model.eval()`` forward under ``torch.no_grad()`` (decoding included, no NMS),
  batch ``--eval-batch``;
- ``train``: one training step as ``train_utils.engine.train_one_epoch`` does it:
  uint8 -> float / 255, forward, ``compute_loss`` in fp32 (``cfg/hyp.yaml`` gains), backward,
  SGD (``optim.build_optimizer``: Nesterov momentum, weight decay on conv weights; fused on
  CUDA, as training runs it: ``optim.uses_fused_optimizer``),
  ``zero_grad(set_to_none=True)``, batch ``--train-batch``, on synthetic images with
  ``OBJECTS_PER_IMAGE`` random boxes each, already on the device (the data pipeline and the
  host-to-device copy are not measured; neither is the EMA update).

Each figure is the fastest of ``--steps`` timed calls after ``--warmup`` untimed ones; the first
call (oneDNN/cuDNN plan creation, compilation) is always untimed and reported apart. The
variants of one mode and size are called in turn (round robin), so that other load on a shared
machine slows them alike, and each figure is also given as a ratio against fp32/contiguous of
the same mode and size in the same run. FLOPs come from ``torch.utils.flop_counter`` (a
multiply-add is 2 FLOPs; a training step counts forward and backward); achieved GFLOP/s is set
against the ``ceiling``: the best forward rate of a few large convolutions (shapes of
YOLOv3-SPP at 416) measured in the same run, precision and memory format.

Usage, from the repository root::

    python bench/bench_model.py                                   # YOLOv3-SPP at 416, CPU
    python bench/bench_model.py --threads 1 --train-batch 1 --precisions fp32 bf16 --profile
    python bench/bench_model.py --sizes 320 416 --json model.json
    python bench/bench_model.py --cfg cfg/yolov3-spp-nano.cfg --sizes 320 --train-batch 16
    python bench/bench_model.py --precisions fp32 --compile       # adds torch.compile rows
    python bench/bench_model.py --profile                          # top operators per variant
    python bench/bench_model.py --device cuda --sizes 416 608 --train-batch 64 --eval-batch 32

Numbers depend on the machine and on what else runs on it; quote them with the machine. On a
CPU, bf16 is only fast where oneDNN has native bf16 kernels (AVX512-BF16 or AMX); the header
says whether this CPU has them (``mkldnn bf16``). Without them a bf16 convolution falls back to
ATen's ``_slow_conv2d`` (im2col + a generic GEMM) and is many times slower than fp32, so bf16
is then only timed when asked for (``--precisions fp32 bf16``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from bench import common
from models.darknet import Darknet
from models.loss import compute_loss, scale_loss_gains
from train_utils.cli import run_script
from train_utils.config import load_hyp
from train_utils.optim import build_optimizer, uses_fused_optimizer
from train_utils.precision import cuda_has_native_bf16

OBJECTS_PER_IMAGE = 8
LR = 1e-3  # small enough that a few synthetic steps keep the loss finite
PROFILE_ROWS = 10
# Convolutions for the ceiling: (batch, in, out, kernel, side), shapes YOLOv3-SPP has at 416.
# The batch is multiplied by CEILING_GPU_BATCH on a GPU, which needs more work to fill.
CEILING_CONVS = ((2, 256, 256, 3, 52), (2, 128, 256, 3, 104), (2, 512, 1024, 3, 13))
CEILING_GPU_BATCH = 32
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("contiguous", "channels_last")


def autocast(precision: str, device: torch.device) -> Any:
    """The forward's precision context: autocast to bf16/fp16, or nothing for fp32."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def memory_format(fmt: str) -> torch.memory_format:
    return torch.channels_last if fmt == "channels_last" else torch.contiguous_format


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batch(batch: int, size: int, nc: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(imgs (batch, 3, size, size) uint8, targets (nt, 6))``; targets are (image index,
    class, cx, cy, w, h) normalised, ``OBJECTS_PER_IMAGE`` random boxes per image."""
    g = torch.Generator().manual_seed(seed)
    imgs = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=g)
    n = batch * OBJECTS_PER_IMAGE
    wh = torch.rand(n, 2, generator=g) * 0.4 + 0.02
    cxy = wh / 2 + torch.rand(n, 2, generator=g) * (1 - wh)
    image = torch.arange(batch).repeat_interleave(OBJECTS_PER_IMAGE).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    return imgs, torch.cat((image[:, None], cls[:, None], cxy, wh), 1)


def to_input(imgs: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 batch -> float in [0, 1] in ``fmt``, as ``train_one_epoch`` prepares it."""
    x = imgs.float().div_(255)
    return x.contiguous(memory_format=memory_format(fmt))


class TrainStep:
    """One optimizer step per call: forward (in ``precision``), fp32 loss, backward, SGD.

    ``model`` may be a DDP wrapper or a compiled module; ``model_without_ddp`` is the plain
    Darknet (the loss reads its heads, the optimizer its parameters). fp16 on CUDA uses a
    ``GradScaler``, as the trainer does.
    """

    def __init__(
        self,
        model: nn.Module,
        model_without_ddp: Darknet,
        precision: str,
        fmt: str,
        img_size: int,
        hyp: dict[str, Any] | None = None,
    ):
        self.model = model
        self.raw = model_without_ddp
        self.precision = precision
        self.fmt = fmt
        self.device = next(model_without_ddp.parameters()).device
        hyp = hyp if hyp is not None else load_hyp(common.REPO / "cfg" / "hyp.yaml")
        self.hyp = scale_loss_gains(hyp, model_without_ddp.nc, img_size)
        # The optimizer training uses on this device (fused on CUDA).
        self.optimizer = build_optimizer(
            model_without_ddp, self.hyp, LR, fused=uses_fused_optimizer(self.device)
        )
        self.optimizer.zero_grad(set_to_none=True)
        use_scaler = precision == "fp16" and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None

    def __call__(self, imgs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.model.train()
        x = to_input(imgs, self.fmt)
        with autocast(self.precision, self.device):
            preds = self.model(x)
        losses = compute_loss([p.float() for p in preds], targets, self.raw, self.hyp)
        loss = losses["box_loss"] + losses["obj_loss"] + losses["cls_loss"]
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def time_calls(
    fn: Callable[[], object], warmup: int, steps: int, device: torch.device | None = None
) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones (a CUDA
    device is synchronised around each call)."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def conv_ceiling(precision: str, fmt: str, device: torch.device, repeats: int = 3) -> float:
    """Best forward GFLOP/s over ``CEILING_CONVS`` in this precision and memory format."""
    best = 0.0
    dtype = DTYPES[precision]
    mf = memory_format(fmt)
    scale = CEILING_GPU_BATCH if device.type == "cuda" else 1
    for b, cin, cout, k, side in CEILING_CONVS:
        b *= scale
        conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        conv = conv.to(device=device, dtype=dtype, memory_format=mf)
        x = torch.randn(b, cin, side, side, device=device, dtype=dtype)
        x = x.contiguous(memory_format=mf)
        flops = 2 * b * cout * cin * k * k * side * side
        with torch.no_grad():
            times = time_calls(lambda conv=conv, x=x: conv(x), 1, repeats, device)
        best = max(best, flops / min(times) / 1e9)
    return best


def count_flops(model: Darknet, size: int, train: bool) -> float:
    """FLOPs for one image: the eval forward, or forward + backward of a training step."""
    model.train(train)
    x = torch.zeros(1, 3, size, size)
    counter = FlopCounterMode(display=False)
    if train:
        with counter:
            sum(p.float().sum() for p in model(x)).backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad(), counter:
            model(x)
    return float(counter.get_total_flops())


def top_ops(fn: Callable[[], object], device: torch.device) -> list[dict[str, Any]]:
    """The operators with the most self time (CPU, or CUDA on a GPU) in one call of ``fn``."""
    activities = [ProfilerActivity.CPU]
    attr = "self_cpu_time_total"
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        attr = "self_device_time_total"
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": round(getattr(e, attr) / 1e3, 1),
            "share": round(getattr(e, attr) / total, 3),
        }
        for e in events[:PROFILE_ROWS]
    ]


def make_variant(
    args: argparse.Namespace, mode: str, size: int, precision: str, fmt: str, compiled: bool
) -> tuple[Callable[[], None], dict[str, Any]]:
    """A model, data and the call to time for one variant, and its row of the table."""
    device = args.device
    torch.manual_seed(0)
    model = Darknet(args.cfg, img_size=size).to(device=device, memory_format=memory_format(fmt))
    run_model: nn.Module = torch.compile(model) if compiled else model
    batch = args.train_batch if mode == "train" else args.eval_batch
    imgs, targets = synthetic_batch(batch, size, model.nc, seed=size)
    imgs, targets = imgs.to(device), targets.to(device)
    if mode == "train":
        step = TrainStep(run_model, model, precision, fmt, size)

        def fn() -> None:
            step(imgs, targets)

    else:
        model.eval()
        x = to_input(imgs, fmt)

        def fn() -> None:
            with torch.no_grad(), autocast(precision, device):
                run_model(x)

    row = {
        "mode": mode,
        "img_size": size,
        "batch": batch,
        "precision": precision,
        "format": fmt,
        "compile": compiled,
    }
    return fn, row


def bench_variants(
    args: argparse.Namespace, mode: str, size: int, variants: list[tuple[str, str, bool]]
) -> list[dict[str, Any]]:
    """Time ``variants`` (precision, format, compiled) of one mode and size, interleaved.

    Round k calls every variant once, so that changes in other load on a shared machine hit
    all variants alike; the fastest call of each counts. The first call of each variant
    (oneDNN/cuDNN plan creation, compilation) is timed apart.
    """
    built = [make_variant(args, mode, size, *v) for v in variants]
    for fn, row in built:
        row["first_call_s"] = round(time_calls(fn, 0, 1, args.device)[0], 3)
    for _ in range(max(args.warmup - 1, 0)):
        for fn, _ in built:
            fn()
    times: list[list[float]] = [[] for _ in built]
    for _ in range(args.steps):
        for k, (fn, _) in enumerate(built):
            times[k] += time_calls(fn, 0, 1, args.device)
    rows = []
    for (fn, row), t in zip(built, times):
        best = min(t)
        row["s_per_batch"] = round(best, 4)
        row["s_per_batch_median"] = round(sorted(t)[len(t) // 2], 4)
        row["img_per_s"] = round(row["batch"] / best, 3)
        if args.profile:
            row["top_ops"] = top_ops(fn, args.device)
        rows.append(row)
    return rows


def variant_label(r: dict[str, Any]) -> str:
    """A row's variant as tables name it: ``bf16/channels_last``, ``fp32/contiguous +compile``."""
    return f"{r['precision']}/{r['format']}{' +compile' if r['compile'] else ''}"


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--cfg", type=Path, default=common.REPO / "cfg" / "yolov3-spp.cfg")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--sizes", type=int, nargs="+", default=[416], help="input sides, pixels")
    p.add_argument("--modes", nargs="+", choices=("eval", "train"), default=["eval", "train"])
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=tuple(DTYPES),
        default=None,
        help="default: fp32 fp16 on CUDA, and bf16 on GPUs that compute it (sm80+); fp32 bf16 "
        "on a CPU with native bf16, else fp32",
    )
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--compile", action="store_true", help="also time torch.compile (fp32)")
    p.add_argument("--eval-batch", type=int, default=1)
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1, help="untimed calls (the first included)")
    p.add_argument("--steps", type=int, default=3, help="timed calls; the fastest counts")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    p.add_argument("--skip-ceiling", action="store_true", help="do not measure the conv ceiling")
    p.add_argument("--profile", action="store_true", help="top operators of each variant")
    return p


def default_precisions(device: torch.device, cpu_mkldnn_bf16: bool | None) -> list[str]:
    """The precisions timed when ``--precisions`` is not given: those training may use here."""
    if device.type == "cuda":
        return ["fp32", "fp16", *(["bf16"] if cuda_has_native_bf16() else [])]
    if cpu_mkldnn_bf16 is False:
        print(
            "this CPU has no native bf16 kernels: bf16 is skipped (it is 5-30x slower than "
            "fp32 here); --precisions fp32 bf16 times it anyway",
            file=sys.stderr,
        )
        return ["fp32"]
    return ["fp32", "bf16"]


def measure_ceilings(args: argparse.Namespace) -> dict[str, float]:
    """GFLOP/s of the convolution ceiling per precision/format (empty with --skip-ceiling)."""
    ceiling: dict[str, float] = {}
    if args.skip_ceiling:
        return ceiling
    for precision in args.precisions:
        for fmt in args.formats:
            key = f"{precision}/{fmt}"
            ceiling[key] = round(conv_ceiling(precision, fmt, args.device), 1)
            print(f"ceiling {key}: {ceiling[key]:.1f} GFLOP/s", file=sys.stderr)
    return ceiling


def measure_rows(
    args: argparse.Namespace, flops_model: Darknet, ceiling: dict[str, float]
) -> list[dict[str, Any]]:
    """Every mode, size and variant, each row with its FLOP rate and ratio to fp32/contiguous."""
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        flops = {mode: count_flops(flops_model, size, mode == "train") for mode in args.modes}
        for mode in args.modes:
            variants = [(pr, fmt, False) for pr in args.precisions for fmt in args.formats]
            if args.compile:
                variants += [("fp32", fmt, True) for fmt in args.formats]
            # The baseline first, so that every ratio is against a figure of this run.
            variants.sort(key=lambda v: v != ("fp32", "contiguous", False))
            base = None
            for r in bench_variants(args, mode, size, variants):
                precision, fmt, compiled = r["precision"], r["format"], r["compile"]
                r["gflop_per_img"] = round(flops[mode] / 1e9, 2)
                r["gflop_per_s"] = round(flops[mode] * r["img_per_s"] / 1e9, 1)
                c = ceiling.get(f"{precision}/{fmt}")
                r["of_ceiling"] = round(r["gflop_per_s"] / c, 3) if c else None
                if (precision, fmt, compiled) == ("fp32", "contiguous", False):
                    base = r["img_per_s"]
                r["vs_fp32_contiguous"] = round(r["img_per_s"] / base, 3) if base else None
                rows.append(r)
                print(
                    f"{mode:5s} {size:4d} {variant_label(r):28s} {r['img_per_s']:8.2f} img/s",
                    file=sys.stderr,
                )
    return rows


def print_report(
    args: argparse.Namespace,
    info: dict[str, Any],
    ceiling: dict[str, float],
    rows: list[dict[str, Any]],
    n_params: int,
) -> None:
    """The machine, the ceiling and one line per row (and the top operators with --profile)."""
    where = info.get("gpu", f"{info['cpu']}, {info['cpu_count']} CPUs")
    print(
        f"\n{Path(args.cfg).name}: {n_params:,} parameters; {where}, {args.threads} torch "
        f"thread(s), ISA {info['isa']}, AVX512-BF16 {'yes' if info['avx512_bf16'] else 'no'}, "
        f"AMX {'yes' if info['amx_bf16'] else 'no'}, mkldnn bf16 {info['mkldnn_bf16']}, "
        f"torch {info['torch']}"
    )
    if ceiling:
        print("conv ceiling (GFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in ceiling.items()))
    print(
        f"{'mode':5s} {'size':>4s} {'batch':>5s} {'variant':28s} {'s/batch':>8s} {'img/s':>8s} "
        f"{'GFLOP/s':>8s} {'ceiling':>8s} {'vs fp32/contig':>14s}"
    )
    for r in rows:
        of_c = f"{r['of_ceiling']:.0%}" if r["of_ceiling"] is not None else "-"
        vs = f"{r['vs_fp32_contiguous']:.2f}x" if r["vs_fp32_contiguous"] is not None else "-"
        print(
            f"{r['mode']:5s} {r['img_size']:4d} {r['batch']:5d} {variant_label(r):28s} "
            f"{r['s_per_batch']:8.3f} {r['img_per_s']:8.2f} {r['gflop_per_s']:8.1f} {of_c:>8s} "
            f"{vs:>14s}"
        )
    if args.profile:
        for r in rows:
            print(f"\ntop operators, {r['mode']} {r['img_size']} {variant_label(r)} (self time):")
            for op in r["top_ops"]:
                print(
                    f"  {op['op']:44s} {op['calls']:6d} calls {op['self_ms']:10.1f} ms "
                    f"{op['share']:6.1%}"
                )


def bench(args: argparse.Namespace) -> int:
    """The whole benchmark: ceilings, every variant, the report and the JSON."""
    # Library INFO lines (model building) would interleave with the table.
    logging.getLogger().setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    args.device = torch.device(args.device)
    if args.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed sizes, as the trainer sets it
    common.check_json(args.json)
    info = {
        **common.machine_description(args.device),
        "cfg": str(args.cfg),
        "threads": args.threads,
    }
    if args.precisions is None:
        args.precisions = default_precisions(args.device, info["mkldnn_bf16"])
    if "fp32" not in args.precisions:
        args.precisions.insert(0, "fp32")  # the baseline of every ratio
    ceiling = measure_ceilings(args)
    flops_model = Darknet(args.cfg)
    rows = measure_rows(args, flops_model, ceiling)
    print_report(args, info, ceiling, rows, sum(p.numel() for p in flops_model.parameters()))
    common.write_report(args.json, {"info": info, "ceiling_gflop_per_s": ceiling, "results": rows})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
