"""Generate the offline demo dataset: coloured shapes on textured backgrounds, in YOLO layout.

Usage (from the repository root)::

    python data/make_shapes.py --out demo_data/shapes --n-train 2000 --n-val 200 --seed 1

Writes::

    ROOT/{train,val}/images/*.jpg       the images
    ROOT/{train,val}/labels/*.txt       one `class cx cy w h` line per object, normalised to [0, 1]
    ROOT/{train,val}/Annotations/*.xml  Pascal VOC annotations (only with --voc)
    ROOT/train.txt ROOT/val.txt         image lists, paths relative to ROOT
    ROOT/shapes.names                   one class name per line
    ROOT/shapes.data                    Darknet-style dataset file (classes, train, valid, names)
    ROOT/make_shapes.json               the generator's arguments, written first: the mark of a
                                        dataset this tool made, the only kind --exist-ok replaces

Every image is generated from its own random stream seeded by (seed, split, index), so the output
is identical for a seed whatever the number of worker processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from xml.sax.saxutils import escape

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as data/make_shapes.py

from build_utils.atomic import check_new_outputs
from build_utils.checks import check_at_least
from build_utils.errors import ConfigError
from build_utils.labels import yolo_txt_lines
from train_utils.cli import check_img_size_limit, path_arg, run_script

CLASS_NAMES = ("circle", "square", "triangle", "star", "cross", "diamond", "hexagon", "bar")
# The demo's and the CLI's default: the first five. The others make harder sets (--classes 8).
DEFAULT_CLASSES = 5
SPLITS = ("train", "val")
JPEG_QUALITY = 90
# Objects overlap a little at most, so that every labelled object stays recognisable.
MAX_OVERLAP_IOU = 0.25
PLACEMENT_ATTEMPTS = 30
# Probability that an image holds no object at all (negatives matter for objectness).
P_EMPTY = 0.08
MAX_OBJECTS = 6
# A shape's colour differs from the background under it by at least this much (sum over BGR).
MIN_COLOUR_CONTRAST = 150
# Images are made in parallel above this many per split; below, a pool costs more than it saves.
PARALLEL_THRESHOLD = 64
# Upper bounds of --n-train/--n-val and --workers: each image is a job held in memory before the
# pool starts, and each worker a process.
MAX_IMAGES_PER_SPLIT = 1_000_000
MAX_WORKERS = 256
# Written first into every dataset make_dataset makes; --exist-ok replaces only a folder holding it.
STAMP_NAME = "make_shapes.json"


@dataclass(frozen=True)
class ShapeObject:
    """One drawn object: class id, box as pixel edges (x1, y1, x2, y2) and its BGR colour."""

    cls: int
    box: tuple[int, int, int, int]
    colour: tuple[int, int, int]


@dataclass(frozen=True)
class GeneratorOptions:
    img_size_range: tuple[int, int] = (256, 480)
    obj_size_range: tuple[float, float] = (10.0, 0.5)  # min pixels, max fraction of the short side
    n_classes: int = DEFAULT_CLASSES


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A textured, noisy background: a smooth random colour field plus clutter and pixel noise."""
    kind = rng.integers(3)
    if kind == 0:  # smooth colour field upsampled from a few random pixels
        grid = (int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)
        small = rng.integers(0, 256, size=grid, dtype=np.uint8)
        img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    elif kind == 1:  # stripes / checker texture
        period = int(rng.integers(8, 40))
        c1, c2 = rng.integers(0, 256, size=(2, 3))
        yy, xx = np.mgrid[0:h, 0:w]
        mask = ((xx // period + yy // period * int(rng.integers(0, 2))) % 2).astype(bool)
        img = np.where(mask[..., None], c1, c2).astype(np.uint8)
    else:  # flat colour
        img = np.empty((h, w, 3), np.uint8)
        img[:] = rng.integers(0, 256, size=3, dtype=np.uint8)
    # Clutter that is not a class: thin random lines.
    for _ in range(int(rng.integers(0, 6))):
        p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        cv2.line(img, p1, p2, colour, int(rng.integers(1, 3)), cv2.LINE_AA)
    noise_sigma = float(rng.uniform(0, 18))
    if noise_sigma > 1:
        noise = rng.normal(0.0, noise_sigma, size=(h, w, 3)).astype(np.int16)
        img = np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    return img


def _polygon(cls: int, cx: float, cy: float, s: float, rng: np.random.Generator) -> np.ndarray:
    """Integer vertices (K, 2) of a polygonal shape of size ``s`` centred at (cx, cy)."""
    r = s / 2
    if cls == 1:  # square, axis-aligned (a rotated square would look like a diamond)
        pts = [(-r, -r), (r, -r), (r, r), (-r, r)]
    elif cls == 2:  # triangle, randomly rotated
        a0 = rng.uniform(0, 2 * math.pi)
        pts = [
            (r * math.cos(a0 + k * 2 * math.pi / 3), r * math.sin(a0 + k * 2 * math.pi / 3))
            for k in range(3)
        ]
    elif cls == 3:  # five-pointed star, randomly rotated
        a0 = rng.uniform(0, 2 * math.pi)
        pts = []
        for k in range(10):
            rk = r if k % 2 == 0 else r * 0.45
            a = a0 + k * math.pi / 5
            pts.append((rk * math.cos(a), rk * math.sin(a)))
    elif cls == 4:  # plus-shaped cross
        t = r / 3
        pts = [
            (-t, -r),
            (t, -r),
            (t, -t),
            (r, -t),
            (r, t),
            (t, t),
            (t, r),
            (-t, r),
            (-t, t),
            (-r, t),
            (-r, -t),
            (-t, -t),
        ]
    elif cls == 5:  # narrow diamond, axis-aligned: tall and thin, unlike the square
        pts = [(0, -r), (0.55 * r, 0), (0, r), (-0.55 * r, 0)]
    elif cls == 6:  # regular hexagon, randomly rotated
        a0 = rng.uniform(0, 2 * math.pi)
        pts = [
            (r * math.cos(a0 + k * math.pi / 3), r * math.sin(a0 + k * math.pi / 3))
            for k in range(6)
        ]
    elif cls == 7:  # bar, 3:1, horizontal or vertical: box shapes no other class has
        t = r / 3
        pts = [(-r, -t), (r, -t), (r, t), (-r, t)]
        if rng.random() < 0.5:
            pts = [(y, x) for x, y in pts]
    else:
        raise ValueError(f"class {cls} is not a polygon")
    return np.round(np.array(pts) + np.array([cx, cy])).astype(np.int32)


def _iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    iw = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _contrasting_colour(rng: np.random.Generator, under: np.ndarray) -> tuple[int, int, int]:
    mean = under.reshape(-1, 3).mean(0)
    best, best_d = None, -1.0
    for _ in range(20):
        c = rng.integers(0, 256, size=3)
        d = float(np.abs(c - mean).sum())
        if d >= MIN_COLOUR_CONTRAST:
            return tuple(int(v) for v in c)
        if d > best_d:
            best, best_d = c, d
    return tuple(int(v) for v in best)


def render_image(
    rng: np.random.Generator, opts: GeneratorOptions = GeneratorOptions()
) -> tuple[np.ndarray, list[ShapeObject]]:
    """Draw one image. Returns the BGR image (H, W, 3) uint8 and its objects in drawing order.

    Boxes are pixel edges: an object covering columns 10..19 has x1 = 10, x2 = 20.
    """
    lo, hi = opts.img_size_range
    w, h = int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))
    img = _background(rng, w, h)
    n = 0 if rng.random() < P_EMPTY else int(rng.integers(1, MAX_OBJECTS + 1))
    min_size = opts.obj_size_range[0]
    max_size = max(min_size + 1, opts.obj_size_range[1] * min(w, h))
    objects: list[ShapeObject] = []
    for _ in range(n):
        for _attempt in range(PLACEMENT_ATTEMPTS):
            cls = int(rng.integers(opts.n_classes))
            # Log-uniform sizes: as many small objects as large ones in relative terms.
            s = float(np.exp(rng.uniform(np.log(min_size), np.log(max_size))))
            r = s / 2
            cx = float(rng.uniform(r + 1, w - r - 2))
            cy = float(rng.uniform(r + 1, h - r - 2))
            if cls == 0:
                ir = max(2, round(r))
                icx, icy = round(cx), round(cy)
                box = (icx - ir, icy - ir, icx + ir + 1, icy + ir + 1)
                pts = None
            else:
                pts = _polygon(cls, cx, cy, s, rng)
                box = (
                    int(pts[:, 0].min()),
                    int(pts[:, 1].min()),
                    int(pts[:, 0].max()) + 1,
                    int(pts[:, 1].max()) + 1,
                )
            if box[0] < 0 or box[1] < 0 or box[2] > w or box[3] > h:
                continue
            if any(_iou(box, o.box) > MAX_OVERLAP_IOU for o in objects):
                continue
            colour = _contrasting_colour(rng, img[box[1] : box[3], box[0] : box[2]])
            if pts is None:
                cv2.circle(img, (icx, icy), ir, colour, -1, cv2.LINE_8)
            else:
                cv2.fillPoly(img, [pts], colour, cv2.LINE_8)
            objects.append(ShapeObject(cls, box, colour))
            break
    return img, objects


def _voc_xml(filename: str, w: int, h: int, objects: list[ShapeObject]) -> str:
    parts = [
        "<annotation>",
        "  <folder>images</folder>",
        f"  <filename>{escape(filename)}</filename>",
        f"  <size><width>{w}</width><height>{h}</height><depth>3</depth></size>",
        "  <segmented>0</segmented>",
    ]
    for o in objects:
        x1, y1, x2, y2 = o.box
        parts += [
            "  <object>",
            f"    <name>{CLASS_NAMES[o.cls]}</name>",
            "    <pose>Unspecified</pose><truncated>0</truncated><difficult>0</difficult>",
            f"    <bndbox><xmin>{x1}</xmin><ymin>{y1}</ymin>"
            f"<xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox>",
            "  </object>",
        ]
    parts.append("</annotation>")
    return "\n".join(parts) + "\n"


def _write_one(job: tuple[Path, str, int, int, int, bool, GeneratorOptions]) -> str:
    root, split, split_id, index, seed, voc, opts = job
    rng = np.random.default_rng([seed, split_id, index])
    img, objects = render_image(rng, opts)
    h, w = img.shape[:2]
    name = f"{split}_{index:06d}"
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for {name}")
    (root / split / "images" / f"{name}.jpg").write_bytes(buf.tobytes())
    lines = yolo_txt_lines([(*o.box, 0, o.cls) for o in objects], w, h, save_conf=False)
    label_text = "".join(x + "\n" for x in lines)
    (root / split / "labels" / f"{name}.txt").write_text(label_text)
    if voc:
        xml = _voc_xml(f"{name}.jpg", w, h, objects)
        (root / split / "Annotations" / f"{name}.xml").write_text(xml)
    return f"{split}/images/{name}.jpg"


def check_options(
    img_size_range: tuple[int, int], n_classes: int, obj_size_range: tuple[float, float]
) -> None:
    """Raise ``ValueError`` for options :func:`make_dataset` cannot draw with (before anything
    is written or removed)."""
    if not 1 <= n_classes <= len(CLASS_NAMES):
        raise ValueError(f"n_classes must be in 1..{len(CLASS_NAMES)}, got {n_classes}")
    if img_size_range[0] < 32 or img_size_range[1] < img_size_range[0]:
        raise ValueError(f"bad image size range {img_size_range}: need 32 <= min <= max")
    min_side, max_frac = obj_size_range
    if not 0 < max_frac <= 1:
        raise ValueError(f"the largest object side must be a fraction in (0, 1], got {max_frac}")
    largest = max_frac * img_size_range[0]  # on the smallest images
    if not 0 < min_side <= largest:
        raise ValueError(
            f"the smallest object side must be in (0, {largest:g}] px ({max_frac:g} x the "
            f"smallest image side {img_size_range[0]}), got {min_side:g}"
        )


def make_dataset(
    out: Path | str,
    n_train: int,
    n_val: int,
    img_size_range: tuple[int, int] = (256, 480),
    seed: int = 0,
    voc: bool = False,
    n_classes: int = DEFAULT_CLASSES,
    obj_size_range: tuple[float, float] = (10.0, 0.5),
    workers: int | None = None,
) -> Path:
    """Write the shapes dataset under ``out`` and return the path of its ``shapes.data`` file.

    ``obj_size_range`` is (minimum side in pixels, maximum side as a fraction of the image's short
    side). ``workers`` defaults to the number of CPUs. :data:`STAMP_NAME` is written before any
    image, so that a set cut short is known as this tool's too.
    """
    check_options(img_size_range, n_classes, obj_size_range)
    root = Path(out)
    opts = GeneratorOptions(tuple(img_size_range), tuple(obj_size_range), n_classes)
    root.mkdir(parents=True, exist_ok=True)
    data_file = root / "shapes.data"
    data_file.unlink(missing_ok=True)  # written last: it marks a whole set (tools/demo.py)
    recipe = dict(n_train=n_train, n_val=n_val, img_size_range=list(img_size_range), seed=seed)
    recipe.update(voc=voc, n_classes=n_classes, obj_size_range=list(obj_size_range))
    (root / STAMP_NAME).write_text(json.dumps(recipe, sort_keys=True) + "\n")
    for split in SPLITS:
        for sub in ("images", "labels") + (("Annotations",) if voc else ()):
            (root / split / sub).mkdir(parents=True, exist_ok=True)
    workers = workers or os.cpu_count() or 1
    for split_id, (split, n) in enumerate(zip(SPLITS, (n_train, n_val))):
        jobs = [(root, split, split_id, i, seed, voc, opts) for i in range(n)]
        if workers > 1 and n >= PARALLEL_THRESHOLD:
            with Pool(workers) as pool:
                rel_paths = pool.map(_write_one, jobs, chunksize=32)
        else:
            rel_paths = [_write_one(j) for j in jobs]
        (root / f"{split}.txt").write_text("".join(p + "\n" for p in rel_paths))
    (root / "shapes.names").write_text("".join(n + "\n" for n in CLASS_NAMES[:n_classes]))
    data_file.write_text(
        f"classes={n_classes}\ntrain=train.txt\nvalid=val.txt\nnames=shapes.names\n"
    )
    return data_file


def _size_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX in pixels, got {text!r}") from e
    return lo, hi


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=add_help)
    parser.add_argument(
        "--out", type=path_arg, default=Path("demo_data/shapes"), help="output folder"
    )
    parser.add_argument("--n-train", type=int, default=1000, help="training images")
    parser.add_argument("--n-val", type=int, default=200, help="validation images")
    parser.add_argument(
        "--img-size",
        type=_size_range,
        default=(256, 480),
        help="range of image sides in pixels, MIN,MAX (default 256,480)",
    )
    parser.add_argument(
        "--min-obj-size",
        type=float,
        default=10.0,
        help="smallest object side in pixels (default 10)",
    )
    parser.add_argument(
        "--max-obj-frac",
        type=float,
        default=0.5,
        help="largest object side as a fraction of the short image side (default 0.5)",
    )
    parser.add_argument(
        "--classes",
        type=int,
        default=DEFAULT_CLASSES,
        help=f"number of shape classes, 1..{len(CLASS_NAMES)} (default {DEFAULT_CLASSES}: "
        f"{', '.join(CLASS_NAMES[:DEFAULT_CLASSES])})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--voc", action="store_true", help="also write Pascal VOC XML annotations")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    parser.add_argument(
        "--exist-ok",
        action="store_true",
        help="replace a dataset this tool made in --out before (its train/ and val/ folders are "
        f"removed first, so that no image of the old set stays); a folder that holds any of "
        f"its files or folders but no {STAMP_NAME} is refused",
    )
    return parser


# What make_dataset writes in --out (the docstring's layout).
OUTPUTS = ("train", "val", "train.txt", "val.txt", "shapes.names", "shapes.data", STAMP_NAME)


def check_replaceable(out: Path) -> None:
    """--exist-ok's guard: whatever of :data:`OUTPUTS` is in ``out`` must belong to a dataset
    this tool made (``out`` holds :data:`STAMP_NAME`), with train/ and val/ real folders (they
    are removed, not written through). Anything else is the user's: refused, never replaced.

    Raises:
        ConfigError: naming the paths in the way.
    """
    taken = [out / name for name in OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
    stamp = out / STAMP_NAME
    if taken and not stamp.is_file():
        them = "them" if len(taken) > 1 else "it"
        raise ConfigError(
            f"--out {out} holds {', '.join(map(str, taken))} but no {STAMP_NAME}: not a dataset "
            f"made by data/make_shapes.py, the only kind --exist-ok replaces; move {them} away "
            "or choose another --out"
        )
    for folder in (out / split for split in SPLITS):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            kind = "a symbolic link" if folder.is_symlink() else "a file"
            raise ConfigError(
                f"{folder} is {kind}, not a folder data/make_shapes.py made; move it away or "
                "choose another --out"
            )


def make_shapes(args: argparse.Namespace) -> None:
    # At least one image each: training refuses an empty split (an empty val too, --notest or not).
    check_at_least({"--n-train": args.n_train, "--n-val": args.n_val}, 1, MAX_IMAGES_PER_SPLIT)
    check_at_least({"--workers": args.workers}, 1, MAX_WORKERS)
    check_img_size_limit(max(args.img_size), "--img-size")
    obj_size_range = (args.min_obj_size, args.max_obj_frac)
    try:
        check_options(args.img_size, args.classes, obj_size_range)
    except ValueError as e:  # make_dataset's checks of its arguments, worded for a caller
        raise ConfigError(str(e)) from e
    check_new_outputs([args.out / name for name in OUTPUTS], "--out", args.exist_ok)
    check_replaceable(args.out)
    for split in SPLITS:
        if (args.out / split).is_dir():
            shutil.rmtree(args.out / split)
    data = make_dataset(
        args.out,
        args.n_train,
        args.n_val,
        args.img_size,
        args.seed,
        args.voc,
        args.classes,
        obj_size_range,
        args.workers,
    )
    print(f"wrote {args.n_train} train + {args.n_val} val images; dataset file: {data}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_args_parser(), make_shapes, argv)


if __name__ == "__main__":
    sys.exit(main())
