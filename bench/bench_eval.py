"""Evaluation speed: NMS milliseconds per image and COCO scoring seconds per 1,000 images.

NMS (``build_utils.boxes.non_max_suppression``, iou 0.6, max_det 300) on synthetic YOLOv3-SPP
outputs at 416 px (10,647 boxes per image, 80 classes):

- ``dense``: what an untrained network emits early in training: every box above any threshold,
  objectness and class scores uniform in (0.5, 1);
- ``sparse``: a trained-like output: ~300 boxes with objectness in (0.05, 1), one dominant
  class score in (0.5, 1) and the others below 1e-3; every other box has objectness < 1e-4.
  A few hundred (box, class) candidates pass conf 0.001.

each at conf 0.001 and 0.01, single- and multi-label. Box geometry (``--geometry``): ``grid``
puts each box at its cell with its anchor's shape (jittered), as the network does;
``uniform`` draws centres uniformly in the image and sides in 10..200 px.

COCO scoring (``train_utils.evaluation.coco_eval.CocoEvaluator``: update, evaluate, per-class
AP): ``--coco-images`` synthetic images with ~7 objects each, ``--dets-per-image`` detections
per image (jittered ground truth plus false positives), scored by each available backend as
``bench_scale.measure_eval`` does; the ground truth is built and timed apart.

Usage, from the repository root::

    python bench/bench_eval.py                      # table on stdout
    python bench/bench_eval.py --json bench.json    # also write the numbers as JSON
    python bench/bench_eval.py --threads 2          # torch intra-op threads (default 1)

On a shared machine more than one torch thread makes NMS timings erratic (threads wait for
each other's time slices), hence the default of one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from bench.bench_model import time_calls
from bench.bench_scale import measure_eval
from build_utils.boxes import non_max_suppression
from build_utils.checks import check_at_least
from train_utils.cli import run_script
from train_utils.evaluation.coco_eval import faster_coco_eval_available

IMG_SIZE = 416
NUM_CLASSES = 80
# YOLOv3-SPP's COCO anchors (pixels) per head, and the heads' strides.
ANCHORS = (
    ((10, 13), (16, 30), (33, 23)),
    ((30, 61), (62, 45), (59, 119)),
    ((116, 90), (156, 198), (373, 326)),
)
STRIDES = (8, 16, 32)
IOU_THRES = 0.6
MAX_DET = 300
SPARSE_OBJECTS = 300
OBJECTS_PER_IMAGE = 7.0  # COCO's mean, in the scored images


def _geometry(g: torch.Generator, kind: str) -> torch.Tensor:
    """(10647, 4) cxcywh pixel boxes for one 416 x 416 image."""
    if kind == "uniform":
        n = sum(3 * (IMG_SIZE // s) ** 2 for s in STRIDES)
        xy = torch.rand(n, 2, generator=g) * IMG_SIZE
        wh = torch.rand(n, 2, generator=g) * 190 + 10
        return torch.cat((xy, wh), 1)
    parts = []
    for stride, anchors in zip(STRIDES, ANCHORS):
        n = IMG_SIZE // stride
        ys, xs = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        cells = torch.stack((xs, ys), -1).reshape(-1, 2).float()
        for aw, ah in anchors:
            xy = (cells + torch.rand(n * n, 2, generator=g)) * stride
            wh = torch.tensor([aw, ah]) * torch.exp(torch.randn(n * n, 2, generator=g) * 0.3)
            parts.append(torch.cat((xy, wh), 1))
    return torch.cat(parts)


def make_predictions(n_images: int, case: str, geometry: str, seed: int = 0) -> torch.Tensor:
    """(n_images, 10647, 85) decoded predictions for the ``dense`` or ``sparse`` case."""
    g = torch.Generator().manual_seed(seed)
    boxes = torch.stack([_geometry(g, geometry) for _ in range(n_images)])
    n = boxes.shape[1]
    scores = torch.empty(n_images, n, 1 + NUM_CLASSES)
    if case == "dense":
        scores.uniform_(0.5, 1.0, generator=g)
    else:
        scores[..., 0].uniform_(0.0, 1e-4, generator=g)
        scores[..., 1:].uniform_(0.0, 1e-3, generator=g)
        for i in range(n_images):
            objects = torch.randperm(n, generator=g)[:SPARSE_OBJECTS]
            scores[i, objects, 0] = torch.rand(SPARSE_OBJECTS, generator=g) * 0.95 + 0.05
            best = torch.randint(0, NUM_CLASSES, (n,), generator=g)
            scores[i, torch.arange(n), 1 + best] = torch.rand(n, generator=g) * 0.5 + 0.5
    return torch.cat((boxes, scores), 2)


def nms_row(pred: torch.Tensor, case: str, conf: float, multi_label: bool, repeats: int) -> dict:
    """The best of ``repeats`` NMS runs over the images of ``pred`` (after a warm-up)."""
    images = pred.shape[0]
    scores = pred[..., 5:] * pred[..., 4:5]
    passed = (pred[..., 4:5] > conf) & (scores > conf)
    if multi_label:
        candidates = passed.sum().item() / images
    else:
        candidates = (passed.any(2) & (scores.amax(2) > conf)).sum().item() / images
    out: list[torch.Tensor] = []

    def run() -> None:
        out[:] = non_max_suppression(
            pred, conf, IOU_THRES, multi_label=multi_label, max_det=MAX_DET
        )

    seconds = min(time_calls(run, 1, repeats))
    return {
        "case": case,
        "conf_thres": conf,
        "multi_label": multi_label,
        "candidates_per_image": round(candidates),
        "kept_per_image": round(sum(o.shape[0] for o in out) / images, 1),
        "ms_per_image": round(seconds / images * 1e3, 3),
    }


def bench_nms(images: int, repeats: int, geometry: str) -> list[dict]:
    results = []
    for case in ("dense", "sparse"):
        pred = make_predictions(images, case, geometry)
        for conf in (0.001, 0.01):
            for multi_label in (False, True):
                results.append(nms_row(pred, case, conf, multi_label, repeats))
                print(
                    f"nms {case:6s} conf {conf:<6g} {'multi' if multi_label else 'single':6s}"
                    f" {results[-1]['ms_per_image']:8.2f} ms/image",
                    file=sys.stderr,
                )
    return results


def bench_coco(n_images: int, dets_per_image: int, backends: Sequence[str]) -> list[dict]:
    """Each backend's scoring of the same synthetic images, measured as ``bench_scale.py --only
    eval`` does (in this process)."""
    spec = {"n": n_images, "dets_per_image": dets_per_image, "objects": OBJECTS_PER_IMAGE}
    per_1000 = 1000 / n_images
    rows = []
    for backend in backends:
        r = measure_eval({**spec, "seed": 0, "what": backend})
        rows.append(
            {
                "backend": backend,
                "images": n_images,
                "detections": r["detections"],
                "score_s_per_1000_images": round(r["seconds"] * per_1000, 3),
                "gt_build_s_per_1000_images": round(r["phases_s"]["ground_truth"] * per_1000, 3),
                "detections_to_coco_s_per_1000_images": round(
                    r["phases_s"]["detections_to_coco"] * per_1000, 3
                ),
                "mAP50-95": round(r["mAP50-95"], 4),
            }
        )
        print(f"coco {backend:18s} {r['seconds'] * per_1000:8.2f} s / 1000 images", file=sys.stderr)
    return rows


def print_tables(args: argparse.Namespace, nms: list[dict], coco: list[dict]) -> None:
    print(
        f"\nNMS, YOLOv3-SPP {IMG_SIZE} px (10,647 boxes, {NUM_CLASSES} classes), iou {IOU_THRES}, "
        f"max_det {MAX_DET}, {args.geometry} boxes, {args.threads} torch thread(s)"
    )
    print(
        f"{'case':8s} {'conf':>6s} {'labels':>7s} {'candidates':>11s} {'kept':>6s} {'ms/img':>8s}"
    )
    for r in nms:
        print(
            f"{r['case']:8s} {r['conf_thres']:6g} {'multi' if r['multi_label'] else 'single':>7s}"
            f" {r['candidates_per_image']:11d} {r['kept_per_image']:6.0f} {r['ms_per_image']:8.2f}"
        )
    if coco:
        print(f"\nCOCO scoring, {args.dets_per_image} detections per image")
        print(f"{'backend':18s} {'s/1000 img':>10s} {'(GT build)':>10s}")
        for r in coco:
            print(
                f"{r['backend']:18s} {r['score_s_per_1000_images']:10.2f}"
                f" {r['gt_build_s_per_1000_images']:10.2f}"
            )


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--images", type=int, default=16, help="images per NMS measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (best is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--geometry", choices=("grid", "uniform"), default="grid")
    p.add_argument("--coco-images", type=int, default=1000)
    p.add_argument("--dets-per-image", type=int, default=100)
    p.add_argument("--skip-coco", action="store_true", help="time NMS only")
    return p


def bench(args: argparse.Namespace) -> None:
    counts = ("images", "repeats", "threads", "coco_images", "dets_per_image")
    check_at_least(common.flags_of(args, *counts), 1)
    common.check_json(args.json)
    torch.set_num_threads(args.threads)
    nms = bench_nms(args.images, args.repeats, args.geometry)
    coco: list[dict[str, Any]] = []
    if not args.skip_coco:
        backends = ["pycocotools"] + (["faster-coco-eval"] if faster_coco_eval_available() else [])
        coco = bench_coco(args.coco_images, args.dets_per_image, backends)
    print_tables(args, nms, coco)
    info = common.machine_info(
        img_size=IMG_SIZE,
        num_classes=NUM_CLASSES,
        iou_thres=IOU_THRES,
        max_det=MAX_DET,
        geometry=args.geometry,
        threads=args.threads,
    )
    common.write_report(args.json, {"info": info, "nms": nms, "coco": coco})


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
