"""Cost at COCO scale: label scan and cache, evaluation and its gather, RAM image cache.

COCO users bring 118k training images and 5k validation images scored at conf 0.001 (up to 300
detections each). This measures, with generated data, how each cost grows with the dataset:

- ``scan``: ``LoadImagesAndLabels`` (rect batches, as evaluation builds it) on a folder of
  ``N`` images (``--scan-sizes``, default 10k and 100k): ``cold`` (no label cache: every image
  and label file checked, the cache and report written) and ``warm`` (the cache hit of a second
  start). The check decodes every image (grayscale, ``image_io.check_image``) and hashes every
  label file, so the images are one small JPEG (``--scan-image-side``) hard-linked under N
  names and the label files hold a Poisson number of boxes (``--objects``, COCO averages ~7).
  Phases are timed by wrapping the functions of ``build_utils.labels`` that ``load_labels``
  calls; the time to check one real COCO-sized image (640 x 480) is measured apart (``ram``
  rows): it is a per-image constant.
- ``eval``: ``N`` images (``--eval-sizes``, default 1k and 5k) with ``--dets-per-image``
  detections each (300: jittered ground truth plus false positives scored mostly near 0.001, as
  NMS at conf 0.001 leaves them): the ground truth (``coco_gt``), ``detections_to_coco``, the
  project's own metrics (``metrics.evaluate_detections``: P/R/F1, AP50, confusion; and
  ``error_breakdown``, TIDE) and COCO scoring with pycocotools and faster-coco-eval
  (``CocoEvaluator``).
- ``gather``: the same detections split over 2 gloo processes (``torchrun``), gathered to rank 0
  as training's ``engine.evaluate`` does (``coco_to_rows`` -> ``comm.gather_rows_to_main`` ->
  ``rows_to_coco``): time and peak memory per rank.
- ``ram``: bytes per image of ``--cache-images ram`` at ``--ram-sizes`` (416, 640) for COCO-sized
  JPEGs (640 x 480, 480 x 640, 640 x 427): the process's RSS growth when the dataset caches
  (a list of arrays), the shared per-node cache file training uses, and ``h * w * 3`` of the
  cached arrays.

Each measurement runs in a fresh process so that its peak memory is its own: ``peak`` is the
process's high-water RSS (``VmHWM``) and ``+MB`` what the measurement added to the process it
started in (imports and generated inputs). Times are wall and CPU seconds (all threads of the
process); the per-image ``growth`` column is the CPU time per image at a larger size over that
at the smallest: 1.0 is linear. On a shared machine the wall time mostly says how busy the
others were.

Usage, from the repository root::

    python bench/bench_scale.py --json scale.json            # the sizes of bench/README.md
    python bench/bench_scale.py --scan-sizes 1000 10000 --eval-sizes 200 1000   # smaller
    python bench/bench_scale.py --only eval gather           # some of the measurements
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common
from build_utils.checks import check_at_least, check_real
from build_utils.errors import ConfigError
from build_utils.yolo_output import place_image
from train_utils.cli import run_script
from train_utils.distributed.node import usable_cpus

NUM_CLASSES = 80
KINDS = ("scan", "eval", "gather", "ram")
# COCO's common image shapes (w, h): what the RAM-cache rows and the per-image check use.
COCO_SHAPES = ((640, 480), (480, 640), (640, 427))
LABEL_SIDES = (0.02, 0.6)  # generated boxes' sides, fractions of the image
CHILD_TIMEOUT_S = 1800
MB = 2**20


# ---------------------------------------------------------------------------------------------
# Memory of this process


def _status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def rss_bytes() -> int:
    """Resident memory now (Linux ``VmRSS``; elsewhere the peak, the best there is)."""
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """High-water resident memory of this process: ``VmHWM``, which starts afresh at ``exec``
    and at :func:`reset_peak` (``ru_maxrss`` would carry the parent's peak across ``exec``)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak() -> None:
    """Make the high-water mark the current RSS (Linux >= 4.0), so that a later
    :func:`peak_rss_bytes` is the peak of what follows."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def memory_fields(start: int) -> dict[str, float]:
    """A row's memory: RSS when the measurement started (``start`` bytes), the peak, and what
    the measurement added, in MB."""
    peak = peak_rss_bytes()
    return {
        "start_rss_mb": start / MB,
        "peak_rss_mb": peak / MB,
        "peak_above_start_mb": (peak - start) / MB,
    }


class Phases:
    """Wall and CPU seconds (this process, all its threads) per named phase of a measurement.

    On a shared machine the CPU seconds are the figure to compare: another process stretches
    the wall time of a phase but hardly its CPU time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that adds its wall and CPU time to phase ``name`` on each call."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0

        return timed

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        return self.wrap(name, fn)()

    def fields(self, leave_out: Sequence[str] = ()) -> dict[str, Any]:
        """A row's times: ``seconds`` and ``cpu_s`` of the phases but ``leave_out``, and each
        phase's."""
        return {
            "seconds": sum(v for k, v in self.seconds.items() if k not in leave_out),
            "cpu_s": sum(v for k, v in self.cpu.items() if k not in leave_out),
            "phases_s": self.seconds,
            "phases_cpu_s": self.cpu,
        }


# ---------------------------------------------------------------------------------------------
# Generated data (the parent process; nothing heavy imported)


def _write_jpeg(path: Path, w: int, h: int, seed: int) -> None:
    import cv2

    rng = np.random.default_rng(seed)
    # Smooth gradients plus a little noise: a photo-like JPEG size, not a noise-sized one.
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.stack(((xx * 255 // w), (yy * 255 // h), ((xx + yy) * 127 // (w + h))), -1)
    img = (img + rng.integers(0, 24, img.shape)).clip(0, 255).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    if not ok:
        raise RuntimeError(f"cv2.imencode failed for {path}")
    path.write_bytes(buf.tobytes())


def random_labels(rng: np.random.Generator, objects: float) -> np.ndarray:
    """Poisson(``objects``) YOLO labels ``(k, 5)``: class 0..79, cx, cy, w, h normalised."""
    k = int(rng.poisson(objects))
    wh = rng.uniform(*LABEL_SIDES, (k, 2))
    cxy = rng.uniform(wh / 2, 1 - wh / 2)
    cls = rng.integers(0, NUM_CLASSES, (k, 1))
    return np.concatenate((cls, cxy, wh), 1)


def label_text(rng: np.random.Generator, objects: float) -> str:
    """A YOLO label file of :func:`random_labels`, 6 decimals."""
    rows = random_labels(rng, objects).tolist()
    return "".join(f"{int(c)} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in rows)


def linked_images(root: Path, n: int, shapes: Sequence[tuple[int, int]]) -> Path:
    """``root/images/0000000.jpg ...``: ``n`` names for one generated JPEG per ``(w, h)`` of
    ``shapes``, in turn, hard-linked (copied where links are refused). Returns the folder."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    sources = [root / f"source{k}.jpg" for k in range(len(shapes))]
    for k, (w, h) in enumerate(shapes):
        _write_jpeg(sources[k], w, h, seed=k)
    for i in range(n):
        img = images / f"{i:07d}.jpg"
        if not img.exists():
            place_image(sources[i % len(sources)], img)
    return images


def make_scan_dataset(root: Path, n: int, objects: float, side: int, seed: int = 0) -> Path:
    """:func:`linked_images` of one JPEG of ``side`` x ``3/4 side`` px, and
    ``root/labels/*.txt``. Returns the images folder; one made before is reused."""
    if (root / "done").is_file():
        return root / "images"
    images = linked_images(root, n, [(side, max(1, side * 3 // 4))])
    labels = root / "labels"
    labels.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        (labels / f"{i:07d}.txt").write_text(label_text(rng, objects))
    (root / "done").write_text("")
    return images


class SyntheticGT:
    """What ``coco_gt.get_coco_api_from_dataset`` reads of a dataset: COCO-sized images with a
    Poisson number of labels each."""

    def __init__(self, n_images: int, objects: float, rng: np.random.Generator) -> None:
        self.img_files = [f"/synthetic/{i:07d}.jpg" for i in range(n_images)]
        self.content_hash = f"synthetic-{n_images}"
        self.nc = NUM_CLASSES
        self.shapes_hw = [COCO_SHAPES[i % len(COCO_SHAPES)][::-1] for i in range(n_images)]
        self.labels = [random_labels(rng, objects).astype(np.float32) for _ in range(n_images)]

    def __len__(self) -> int:
        return len(self.img_files)

    def coco_index(self, i: int) -> tuple[np.ndarray, tuple[int, int]]:
        return self.labels[i], self.shapes_hw[i]


def synthetic_detections(
    gt: SyntheticGT, per_image: int, rng: np.random.Generator, images: Sequence[int]
) -> list[Any]:
    """Per image of ``images`` an ``(per_image, 6)`` float64 tensor x1, y1, x2, y2, score, class
    in original pixels, highest score first (an NMS output at conf 0.001): each label found
    once (jittered, 10% with another class), a fifth of the rest near a label (duplicates,
    poor localisation), the others anywhere; false positives scored 0.001 + Exp(0.03)."""
    import torch

    out = []
    for i in images:
        labels, (h, w) = gt.labels[i], gt.shapes_hw[i]
        scale = np.array([w, h, w, h], dtype=np.float64)
        cls, cxcy, bwh = labels[:, 0].astype(np.int64), labels[:, 1:3], labels[:, 3:5]
        gt_xyxy = np.concatenate((cxcy - bwh / 2, cxcy + bwh / 2), 1) * scale
        k = min(len(labels), per_image)
        size = np.concatenate((bwh, bwh), 1)[:k] * scale
        tp = gt_xyxy[:k] + rng.normal(0, 0.05, (k, 4)) * size
        tp_cls = np.where(rng.random(k) < 0.1, rng.integers(0, NUM_CLASSES, k), cls[:k])
        n_fp = per_image - k
        near = min(n_fp // 5, n_fp) if len(labels) else 0
        pick = rng.integers(0, max(len(labels), 1), near)
        near_boxes = gt_xyxy[pick] + rng.normal(0, 0.3, (near, 4)) * (
            np.concatenate((bwh, bwh), 1)[pick] * scale
        )
        far_xy = rng.uniform(0, 1, (n_fp - near, 2)) * [w, h]
        far = np.concatenate((far_xy, far_xy + rng.uniform(8, 300, (n_fp - near, 2))), 1)
        boxes = np.concatenate((tp, near_boxes, far))
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
        boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)
        scores = np.concatenate(
            (rng.uniform(0.3, 1.0, k), (0.001 + rng.exponential(0.03, n_fp)).clip(max=0.99))
        )
        classes = np.concatenate((tp_cls, rng.integers(0, NUM_CLASSES, n_fp)))
        rows = np.concatenate((boxes, scores[:, None], classes[:, None]), 1)
        out.append(torch.from_numpy(rows[np.argsort(-scores, kind="stable")]))
    return out


def _eval_inputs(spec: dict[str, Any], images: Sequence[int] | None = None) -> tuple[Any, Any]:
    rng = np.random.default_rng(spec["seed"])
    gt = SyntheticGT(spec["n"], spec["objects"], rng)
    chosen = range(spec["n"]) if images is None else images
    return gt, synthetic_detections(gt, spec["dets_per_image"], rng, list(chosen))


# ---------------------------------------------------------------------------------------------
# Measurements (each in its own process)


def measure_scan(spec: dict[str, Any]) -> dict[str, Any]:
    """Build ``LoadImagesAndLabels`` on ``spec["images"]``: ``cold`` or ``warm`` cache."""
    from build_utils import datasets, labels

    phases = Phases()
    # load_labels looks these up in its module at call time, so the wrappers see every call.
    for name in ("label_cache_key", "load_label_cache", "build_label_cache", "save_label_cache"):
        setattr(labels, name, phases.wrap(name, getattr(labels, name)))
    labels.write_report = phases.wrap("write_report", labels.write_report)
    datasets.collect_image_files = phases.wrap("list_images", datasets.collect_image_files)
    cls = datasets.LoadImagesAndLabels
    cls._hash_content = phases.wrap("content_hash", cls._hash_content)
    cls._sort_for_rect = phases.wrap("rect_sort", cls._sort_for_rect)

    images = Path(spec["images"])
    cache = labels.cache_place(images).with_name(f"{labels.cache_place(images).name}.cache.npz")
    if spec["phase"] == "cold":
        cache.unlink(missing_ok=True)
    elif not cache.is_file():
        raise RuntimeError(f"warm start without a label cache at {cache}")
    start = rss_bytes()
    reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    # rect, as evaluation (and training with --rect) builds it: the batch shapes are part of
    # the cost of a start.
    ds = cls(images, img_size=640, batch_size=16, rect=True, nc=NUM_CLASSES)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(ds)
    if n != spec["n"]:
        raise RuntimeError(f"{n} usable images, expected {spec['n']}")
    phases.seconds["other"] = seconds - sum(phases.seconds.values())
    phases.cpu["other"] = cpu - sum(phases.cpu.values())
    return {
        "kind": "scan",
        "phase": spec["phase"],
        "images": n,
        "objects": int(sum(len(lb) for lb in ds.labels)),
        **phases.fields(),
        "us_per_image": seconds / n * 1e6,
        **memory_fields(start),
        "cache_bytes": cache.stat().st_size,
        "cache_bytes_per_image": cache.stat().st_size / n,
        "report_bytes": ds.report_path.stat().st_size if ds.report_path.is_file() else 0,
    }


def measure_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """One of ``metrics``, ``pycocotools``, ``faster-coco-eval`` on ``spec["n"]`` images."""
    from train_utils.evaluation.coco_eval import CocoEvaluator, detections_to_coco
    from train_utils.evaluation.coco_gt import get_coco_api_from_dataset
    from train_utils.evaluation.error_breakdown import error_breakdown
    from train_utils.evaluation.metrics import dets_by_image, evaluate_detections, gt_by_image

    gt, outputs = _eval_inputs(spec)
    n = spec["n"]
    start = rss_bytes()
    reset_peak()
    phases = Phases()
    coco_gt = phases.run("ground_truth", lambda: get_coco_api_from_dataset(gt))
    dets = phases.wrap("detections_to_coco", detections_to_coco)(outputs, list(range(n)))
    del outputs  # as engine.evaluate, which keeps the dicts only
    if spec["what"] == "metrics":
        by_gt = phases.run("gt_by_image", lambda: gt_by_image(coco_gt))
        by_img = phases.run("dets_by_image", lambda: dets_by_image(dets))
        m = phases.run(
            "evaluate_detections", lambda: evaluate_detections(by_gt, by_img, NUM_CLASSES)
        )
        b = phases.run("error_breakdown", lambda: error_breakdown(by_gt, by_img))
        result = {"mAP50": float(m.per_class.mean[2]), "tide_ap50": b.ap50 / 100}
    else:
        evaluator = CocoEvaluator(coco_gt, backend=spec["what"])
        phases.run("update", lambda: evaluator.update(dets))
        stats = phases.run("score", evaluator.evaluate)
        phases.run("per_class_ap", evaluator.per_class_ap)
        result = {"mAP50-95": float(stats[0]), "mAP50": float(stats[1])}
    # The scoring's own time: the inputs (listed apart) are the same for every scorer.
    times = phases.fields(leave_out=("ground_truth", "detections_to_coco"))
    return {
        "kind": "eval",
        "what": spec["what"],
        "images": n,
        "detections": len(dets),
        **times,
        "ms_per_image": times["seconds"] / n * 1e3,
        **memory_fields(start),
        **result,
    }


def gather_worker(spec: dict[str, Any]) -> None:
    """One rank of the gather measurement (started by ``torchrun``): its shard of the
    detections as ``predict_batches`` returns them, then ``engine.evaluate``'s gather."""
    import torch.distributed as dist

    from train_utils.distributed.comm import barrier, gather_rows_to_main
    from train_utils.evaluation.coco_eval import coco_to_rows, detections_to_coco, rows_to_coco

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = list(range(rank, spec["n"], world))  # the evaluation sampler's sharding
        _, outputs = _eval_inputs(spec, mine)
        local = detections_to_coco(outputs, mine)
        del outputs
        start = rss_bytes()
        barrier()
        reset_peak()
        phases = Phases()
        rows = phases.run("coco_to_rows", lambda: coco_to_rows(local))
        barrier()  # the gather's own time, not the wait for the slower rank's conversion
        gathered = phases.run("gather_rows_to_main", lambda: gather_rows_to_main(rows))
        n_gathered = 0
        if gathered is not None:
            n_gathered = len(phases.run("rows_to_coco", lambda: rows_to_coco(gathered)))
        row = {
            "rank": rank,
            "local_detections": len(local),
            "gathered_detections": n_gathered,
            **phases.fields(),
            **memory_fields(start),
        }
        Path(f"{spec['out']}.rank{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()


def measure_ram(spec: dict[str, Any]) -> dict[str, Any]:
    """RSS growth per image when the dataset caches ``spec["n"]`` images in RAM at
    ``spec["img_size"]``, against the cached arrays' ``h * w * 3`` and the shared cache file."""
    from build_utils.datasets import LoadImagesAndLabels
    from build_utils.image_io import check_image
    from build_utils.shared_images import shared_file_bytes

    images = Path(spec["images"])
    ds = LoadImagesAndLabels(images, img_size=spec["img_size"], batch_size=16, nc=NUM_CLASSES)
    n = len(ds)
    pixel_bytes = ds.ram_cache_bytes()
    shared = shared_file_bytes(ds.ram_cache_sizes())
    start = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    ds.cache_in_ram(is_main=False)
    fill_s = time.perf_counter() - t0
    held = rss_bytes() - start
    arrays = sum(a.nbytes for a in ds._imgs)  # what the list holds
    # What checking one COCO-sized image costs the label scan (it decodes the image).
    first = ds.img_files[0]
    check_image(first)
    c0 = time.process_time()  # CPU time: a per-image constant, whatever else runs
    checks = 20
    for _ in range(checks):
        check_image(first)
    check_ms = (time.process_time() - c0) / checks * 1e3
    w0, h0 = (int(v) for v in ds.shapes[0])
    return {
        "kind": "ram",
        "img_size": spec["img_size"],
        "images": n,
        "hw3_bytes_per_image": pixel_bytes / n,
        "array_bytes_per_image": arrays / n,
        "rss_bytes_per_image": held / n,
        "rss_over_hw3": held / pixel_bytes,
        "shared_file_bytes_per_image": shared / n,
        "fill_ms_per_image": fill_s / n * 1e3,
        "check_ms_per_image": check_ms,
        "check_image_size": f"{w0}x{h0}",
        **memory_fields(start),
    }


CHILD_MEASURES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "scan": measure_scan,
    "eval": measure_eval,
    "ram": measure_ram,
}
RESULT_PREFIX = "RESULT "  # the line of a child's stdout that holds its row


def child_main(spec: dict[str, Any]) -> None:
    import torch

    logging.getLogger().setLevel(logging.ERROR)  # the measured code's own lines would count
    torch.set_num_threads(spec["threads"])
    if spec["kind"] == "gather":
        gather_worker(spec)
    else:
        print(RESULT_PREFIX + json.dumps(CHILD_MEASURES[spec["kind"]](spec)))


# ---------------------------------------------------------------------------------------------
# The parent: generate data, run each measurement in a fresh process, print the tables


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = common.child_env(spec["threads"])
    out = common.run_child(cmd, env, f"measurement {spec['kind']}", CHILD_TIMEOUT_S)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"measurement {spec['kind']} wrote no result:\n{out[-2000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def run_gather(spec: dict[str, Any], nproc: int) -> list[dict[str, Any]]:
    cmd = [*common.torchrun(nproc), str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    common.run_child(cmd, common.child_env(spec["threads"]), "gather (torchrun)", CHILD_TIMEOUT_S)
    rows = [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text()) for r in range(nproc)]
    for r in rows:
        r.update(kind="gather", images=spec["n"])
    return rows


def best_of(
    repeat: int, measure: Callable[[], Any], seconds: Callable[[Any], float] = itemgetter("seconds")
) -> Any:
    """The fastest of ``repeat`` runs of ``measure`` (other processes only ever slow one down)."""
    return min((measure() for _ in range(repeat)), key=seconds)


def growth(rows: list[dict[str, Any]], key: str, per: str, group: Sequence[str]) -> None:
    """Set ``row["growth"]``: ``row[key] / row[per]`` over the same of the smallest row of its
    group (1.0 = linear; the smallest row gets None). ``key`` is ``cpu_s``: on a shared machine
    the wall time says how busy the others were."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(g) for g in group), []).append(r)
    for members in groups.values():
        base = min(members, key=lambda r: r[per])
        for r in members:
            if r is base or base[key] <= 0:
                r["growth"] = None
            else:
                r["growth"] = (r[key] / r[per]) / (base[key] / base[per])


def scan_rows(args: argparse.Namespace, work: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Cold and warm starts of ``LoadImagesAndLabels`` at each ``--scan-sizes``."""
    rows = []
    for n in sorted(set(args.scan_sizes)):
        t0 = time.perf_counter()
        images = make_scan_dataset(work / f"scan{n}", n, args.objects, args.scan_image_side)
        print(f"scan {n}: data in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for phase in ("cold", "warm"):
            child = {**spec, "kind": "scan", "images": str(images), "n": n, "phase": phase}
            rows.append(best_of(args.repeat, lambda c=child: run_child(c)))
            print(f"scan {n} {phase}: {rows[-1]['seconds']:.1f} s", file=sys.stderr)
    growth(rows, "cpu_s", "images", ("phase",))
    return rows


def eval_rows(args: argparse.Namespace, work: Path, spec: dict[str, Any]) -> dict[str, list]:
    """Scoring (``eval``) and the gather to rank 0 (``gather``) at each ``--eval-sizes``."""
    results: dict[str, list[dict[str, Any]]] = {"eval": [], "gather": []}
    for n in sorted(set(args.eval_sizes)):
        sized = {**spec, "n": n, "dets_per_image": args.dets_per_image}
        for what in ("metrics", *args.backends) if "eval" in args.only else ():
            child = {**sized, "kind": "eval", "what": what}
            results["eval"].append(best_of(args.repeat, lambda c=child: run_child(c)))
            print(f"eval {n} {what}: {results['eval'][-1]['seconds']:.1f} s", file=sys.stderr)
        if "gather" in args.only:
            child = {**sized, "kind": "gather", "out": str(work / f"gather{n}")}
            rows = best_of(
                args.repeat,
                lambda c=child: run_gather(c, args.nproc),
                lambda rows: max(r["seconds"] for r in rows),
            )
            results["gather"] += rows
            print(f"gather {n}: {max(r['seconds'] for r in rows):.1f} s", file=sys.stderr)
    growth(results["eval"], "cpu_s", "images", ("what",))
    growth(results["gather"], "cpu_s", "images", ("rank",))
    return results


def ram_rows(args: argparse.Namespace, work: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The RAM image cache's bytes per image at each ``--ram-sizes``, for COCO-sized JPEGs."""
    images = linked_images(work / "ram", args.ram_images, COCO_SHAPES)
    return [
        run_child({**spec, "kind": "ram", "images": str(images), "img_size": size})
        for size in args.ram_sizes
    ]


# The columns every scan, eval and gather row ends with.
COST_HEADER = f" {'growth':>7s} {'peak MB':>8s} {'+MB':>7s}  phases (CPU s)"


def _cost(r: dict[str, Any]) -> str:
    growth = "-" if r["growth"] is None else f"{r['growth']:.2f}x"
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_cpu_s"].items())
    return f" {growth:>7s} {r['peak_rss_mb']:8.0f} {r['peak_above_start_mb']:7.0f}  {phases}"


def _print_scoring(title: str, rows: list, label: tuple[str, str], count: tuple[str, str]) -> None:
    """The eval or the gather table: each row's images, ``label`` and detection ``count``
    (header, key), its times and :func:`_cost`."""
    print(title)
    print(
        f"{'images':>7s} {label[0]:18s} {count[0]:>9s} {'s':>8s} {'CPU s':>8s}"
        f" {'CPU ms/img':>10s}" + COST_HEADER
    )
    for r in rows:
        print(
            f"{r['images']:7d} {r[label[1]]!s:18s} {r[count[1]]:9d} {r['seconds']:8.2f}"
            f" {r['cpu_s']:8.2f} {r['cpu_s'] / r['images'] * 1e3:10.2f}" + _cost(r)
        )


def print_tables(results: dict[str, list[dict[str, Any]]]) -> None:
    if results["scan"]:
        print("\nLabel scan and cache (LoadImagesAndLabels on a folder; cold: no cache)")
        print(
            f"{'images':>8s} {'start':>5s} {'s':>8s} {'CPU s':>8s} {'CPU us/img':>10s}"
            f" {'cache MB':>9s} {'B/img':>6s}" + COST_HEADER
        )
        for r in results["scan"]:
            print(
                f"{r['images']:8d} {r['phase']:>5s} {r['seconds']:8.2f} {r['cpu_s']:8.2f}"
                f" {r['cpu_s'] / r['images'] * 1e6:10.1f} {r['cache_bytes'] / MB:9.2f}"
                f" {r['cache_bytes_per_image']:6.0f}" + _cost(r)
            )
    if results["eval"]:
        title = "\nEvaluation (detections per image as given; seconds of the scoring itself)"
        _print_scoring(title, results["eval"], ("what", "what"), ("dets", "detections"))
    if results["gather"]:
        title = "\nGather to rank 0 (2 gloo processes, engine.evaluate's path)"
        _print_scoring(title, results["gather"], ("rank", "rank"), ("local", "local_detections"))
    if results["ram"]:
        print("\nRAM image cache per image (COCO-sized JPEGs)")
        print(
            f"{'size':>5s} {'images':>6s} {'h*w*3 B':>9s} {'arrays B':>9s} {'RSS B':>9s}"
            f" {'RSS/hw3':>7s} {'shared B':>9s} {'fill ms':>8s} {'check CPU ms':>12s}"
        )
        for r in results["ram"]:
            print(
                f"{r['img_size']:5d} {r['images']:6d} {r['hw3_bytes_per_image']:9.0f}"
                f" {r['array_bytes_per_image']:9.0f} {r['rss_bytes_per_image']:9.0f}"
                f" {r['rss_over_hw3']:7.3f} {r['shared_file_bytes_per_image']:9.0f}"
                f" {r['fill_ms_per_image']:8.2f} {r['check_ms_per_image']:12.2f}"
            )


def get_parser() -> argparse.ArgumentParser:
    p = common.bench_parser(__doc__)
    p.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--scan-sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--scan-image-side", type=int, default=64, help="width of the scanned JPEG")
    p.add_argument("--objects", type=float, default=7.0, help="mean boxes per image")
    p.add_argument("--eval-sizes", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--dets-per-image", type=int, default=300)
    backends = ("pycocotools", "faster-coco-eval")
    p.add_argument("--backends", nargs="+", default=list(backends), choices=backends)
    p.add_argument("--ram-sizes", type=int, nargs="+", default=[416, 640])
    p.add_argument("--ram-images", type=int, default=300, help="images in the RAM-cache rows")
    p.add_argument("--nproc", type=int, default=2, help="gloo processes of the gather")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest counts")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the generated data here (default: a temporary folder, removed)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every number is one a measurement can take, and ``--json``'s folder exists, before
    anything is measured (a bad value was a child's traceback; an unwritable ``--json`` one at
    the end of the run).

    Raises:
        ConfigError: a size or count below 1, ``--objects`` below 0 or no number, ``--nproc``
            or ``--threads`` above the usable CPUs (each gather process holds torch; two
            processes always).
        OutputError: ``--json``'s folder cannot be made.
    """
    counts = {
        "--scan-sizes": min(args.scan_sizes),
        "--eval-sizes": min(args.eval_sizes),
        "--ram-sizes": min(args.ram_sizes),
        "--scan-image-side": args.scan_image_side,
        "--dets-per-image": args.dets_per_image,
        "--ram-images": args.ram_images,
        "--nproc": args.nproc,
        "--threads": args.threads,
        "--repeat": args.repeat,
    }
    check_at_least(counts, 1)
    check_real("--objects", args.objects)
    # More processes or threads than CPUs measure waiting (the default 2 processes run anywhere).
    cpus = usable_cpus()
    for flag, value, most in (
        ("--nproc", args.nproc, max(cpus, 2)),
        ("--threads", args.threads, cpus),
    ):
        if value > most:
            raise ConfigError(f"{flag} {value} is more than the {most} this machine's CPUs allow")
    common.check_json(args.json)


def bench(args: argparse.Namespace) -> None:
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    check_args(args)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
        work = args.workdir or Path(tmp)
        spec = {"threads": args.threads, "objects": args.objects, "seed": 0}
        if "scan" in args.only:
            results["scan"] = scan_rows(args, work, spec)
        results.update(eval_rows(args, work, spec))
        if "ram" in args.only:
            results["ram"] = ram_rows(args, work, spec)
    print_tables(results)
    info = common.machine_info(
        threads=args.threads,
        repeat=args.repeat,
        objects_per_image=args.objects,
        dets_per_image=args.dets_per_image,
        scan_image_side=args.scan_image_side,
        total_s=time.perf_counter() - t_start,
    )
    print(f"\ntotal {info['total_s']:.0f} s")
    common.write_report(args.json, {"info": info, **results})


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), bench, argv)


if __name__ == "__main__":
    sys.exit(main())
