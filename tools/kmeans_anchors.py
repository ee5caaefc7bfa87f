"""Anchor boxes for a dataset: k-means on label widths/heights with IoU distance, then a genetic
refinement, reporting the best possible recall.

    python tools/kmeans_anchors.py --data demo_data/shapes/shapes.data --img-size 512
    python tools/kmeans_anchors.py --data my_data.data --cfg cfg/yolov3-spp.cfg \\
        --out-cfg cfg/my_yolov3-spp.cfg      # also write the anchors into a cfg

Label sizes are taken at ``--img-size`` the way the loader letterboxes (long side = img-size).
Distance between a box and an anchor is ``1 - IoU`` with both centred at the origin (YOLOv2);
centroids are cluster medians. The genetic step mutates the anchors and keeps a mutation when
``fitness = mean(best IoU, counting only IoUs above --iou-t)`` improves. Best possible recall
(BPR) is the fraction of labels whose best anchor IoU exceeds ``--iou-t``, the training matching
threshold (``iou_t`` in cfg/hyp.yaml): labels below it have no anchor to learn from.

Writing into a cfg replaces the ``anchors=`` line of every ``[yolo]`` section (sorted small to
large, as the masks 0,1,2 / 3,4,5 / 6,7,8 expect) and leaves everything else as it was.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import ConfigError, DatasetError
from build_utils.parse_config import parse_data_cfg
from train_utils.cli import run_main, setup_console_logging

LOGGER = logging.getLogger("kmeans_anchors")
MIN_LABEL_PX = 2.0  # labels smaller than this at img-size are ignored (lineage: 2 px)
KMEANS_ITERS = 300
MUTATION_PROB, MUTATION_SIGMA = 0.9, 0.1  # genetic step (ultralytics' values)
MUTATION_RANGE = (0.3, 3.0)  # one mutation scales an anchor by at most this


def wh_iou(wh: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """IoU ``(n, k)`` of ``(n, 2)`` widths/heights with ``(k, 2)`` anchors, all centred."""
    inter = np.minimum(wh[:, None, 0], anchors[None, :, 0]) * np.minimum(
        wh[:, None, 1], anchors[None, :, 1]
    )
    union = (wh[:, 0] * wh[:, 1])[:, None] + (anchors[:, 0] * anchors[:, 1])[None] - inter
    return inter / union


def fitness(wh: np.ndarray, anchors: np.ndarray, iou_t: float) -> float:
    best = wh_iou(wh, anchors).max(1)
    return float((best * (best > iou_t)).mean())


def kmeans_iou(wh: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means with ``1 - IoU`` distance and median centroids, k-means++ seeding.

    Returns ``(k, 2)`` anchors sorted by area.
    """
    if len(wh) < k:
        raise DatasetError(f"{len(wh)} labels are too few for {k} anchors")
    centroids = [wh[rng.integers(len(wh))]]
    for _ in range(1, k):
        d = 1 - wh_iou(wh, np.array(centroids)).max(1)
        p = d**2
        centroids.append(
            wh[rng.choice(len(wh), p=p / p.sum()) if p.sum() > 0 else rng.integers(len(wh))]
        )
    c = np.array(centroids, dtype=np.float64)
    assign = None
    for _ in range(KMEANS_ITERS):
        iou = wh_iou(wh, c)
        new = iou.argmax(1)
        if assign is not None and (new == assign).all():
            break
        assign = new
        for j in range(k):
            members = wh[assign == j]
            if len(members):
                c[j] = np.median(members, axis=0)
            else:  # an empty cluster takes the worst-served label
                c[j] = wh[iou.max(1).argmin()]
    return c[np.argsort(c.prod(1))]


def evolve(
    wh: np.ndarray, anchors: np.ndarray, iou_t: float, generations: int, rng: np.random.Generator
) -> np.ndarray:
    """Genetic refinement: random multiplicative mutations kept when the fitness improves."""
    best, best_f = anchors.copy(), fitness(wh, anchors, iou_t)
    for _ in range(generations):
        mutate = np.ones_like(best)
        while (mutate == 1).all():
            mask = rng.random(best.shape) < MUTATION_PROB
            mutate = np.clip(
                (rng.standard_normal(best.shape) * MUTATION_SIGMA * rng.random() + 1) * mask
                + ~mask,
                *MUTATION_RANGE,
            )
        cand = np.clip(best * mutate, MIN_LABEL_PX, None)
        f = fitness(wh, cand, iou_t)
        if f > best_f:
            best, best_f = cand, f
    return best[np.argsort(best.prod(1))]


def label_sizes(dataset: LoadImagesAndLabels) -> np.ndarray:
    """``(n, 2)`` label widths/heights in pixels at the dataset's img_size (long side)."""
    out = []
    for lb, (w0, h0) in zip(dataset.labels, dataset.shapes):
        if len(lb):
            r = dataset.img_size / max(w0, h0)
            out.append(lb[:, 3:5] * [w0 * r, h0 * r])
    return np.concatenate(out).astype(np.float64) if out else np.zeros((0, 2))


def describe(wh: np.ndarray, anchors: np.ndarray, iou_t: float) -> str:
    iou = wh_iou(wh, anchors)
    best = iou.max(1)
    return (
        f"best possible recall {(best > iou_t).mean():.4f} at IoU > {iou_t}; mean best IoU "
        f"{best.mean():.4f}; {(iou > iou_t).sum(1).mean():.2f} anchors per label above it"
    )


def format_anchors(anchors: np.ndarray) -> str:
    return ",  ".join(f"{round(w)},{round(h)}" for w, h in anchors)


def write_anchors_into_cfg(src: Path, dst: Path, anchors: np.ndarray) -> int:
    """Copy ``src`` to ``dst`` with the ``anchors=`` line of each ``[yolo]`` section replaced.

    Returns the number of sections changed.

    Raises:
        ConfigError: no ``[yolo]`` section, or one whose ``num`` differs from the anchor count.
    """
    lines = src.read_text(encoding="utf-8").splitlines()
    section, changed = "", 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[]").strip().lower()
        elif section == "yolo":
            m = re.match(r"\s*(\w+)\s*=\s*(.*)", line)
            if m and m.group(1) == "num" and int(m.group(2).split("#")[0]) != len(anchors):
                raise ConfigError(
                    f"[yolo] num={m.group(2)} but {len(anchors)} anchors were "
                    "computed; pass -n to match",
                    src,
                    i + 1,
                )
            if m and m.group(1) == "anchors":
                lines[i] = f"anchors={format_anchors(anchors)}"
                changed += 1
    if not changed:
        raise ConfigError("no [yolo] section with an anchors= line", src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return changed


def cfg_anchor_count(cfg: Path) -> int | None:
    """The ``num`` of the first ``[yolo]`` section, if any."""
    section = ""
    for line in cfg.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s.strip("[]").strip().lower()
        elif section == "yolo" and re.match(r"num\s*=", s):
            return int(s.split("=", 1)[1].split("#")[0])
    return None


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=add_help)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help=".data file (its train list is used)")
    src.add_argument("--list", type=Path, help="image list or folder")
    p.add_argument("--img-size", type=int, default=512, help="training image size")
    p.add_argument("-n", "--num", type=int, default=None, help="anchors (default: cfg's or 9)")
    p.add_argument("--iou-t", type=float, default=0.20, help="anchor matching IoU threshold")
    p.add_argument("--generations", type=int, default=1000, help="genetic refinement steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cfg", type=Path, help="cfg whose [yolo] anchors to replace (with --out-cfg)")
    p.add_argument("--out-cfg", type=Path, help="where to write the cfg with the new anchors")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    setup_console_logging()

    def body() -> int:
        if (args.cfg is None) != (args.out_cfg is None):
            raise ConfigError("--cfg and --out-cfg go together")
        if args.cfg is not None and not args.cfg.is_file():
            raise ConfigError("model cfg not found", args.cfg)
        if not 0 < args.iou_t < 1:
            raise ConfigError(f"--iou-t must be in (0, 1), got {args.iou_t}")
        n = args.num or (cfg_anchor_count(args.cfg) if args.cfg else None) or 9
        source = parse_data_cfg(args.data)["train"] if args.data else args.list
        dataset = LoadImagesAndLabels(source, args.img_size)
        wh = label_sizes(dataset)
        small = (wh < MIN_LABEL_PX).any(1)
        if small.any():
            LOGGER.warning(
                "%d of %d labels are under %g px at img-size %d; ignored",
                small.sum(),
                len(wh),
                MIN_LABEL_PX,
                args.img_size,
            )
        wh = wh[~small]
        rng = np.random.default_rng(args.seed)
        anchors = kmeans_iou(wh, n, rng)
        LOGGER.info("k-means:  %s; %s", format_anchors(anchors), describe(wh, anchors, args.iou_t))
        anchors = evolve(wh, anchors, args.iou_t, args.generations, rng)
        LOGGER.info("evolved:  %s; %s", format_anchors(anchors), describe(wh, anchors, args.iou_t))
        print(f"anchors={format_anchors(anchors)}")
        if args.cfg is not None:
            k = write_anchors_into_cfg(args.cfg, args.out_cfg, anchors)
            LOGGER.info("wrote %s (%d [yolo] sections)", args.out_cfg, k)
        return 0

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
