"""Pictures of a dataset and of an evaluation: label statistics, image mosaics with boxes,
the confusion matrix and the P/R/F1 curves; and the boxes predict.py draws.

Pure drawing: every ``plot_*`` function takes arrays and a path and writes one file. Nothing
here uses a random number generator (training numerics must not depend on whether pictures are
drawn). Charts use matplotlib's Agg backend, image mosaics OpenCV.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from build_utils.atomic import atomic_write, reported_write
from build_utils.boxes import xywhn2xyxy
from build_utils.errors import OutputError
from train_utils.evaluation.metrics import ClassMetrics

MOSAIC_CELL = 320  # pixels of the longer side of each image in a mosaic
MOSAIC_MAX_IMAGES = 16
BOX_THICKNESS = 2  # pixels (predict.py's default --line-thickness)
DPI = 100
CURVE_FILES = ("PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png")  # plot_curves
MAX_CURVE_LEGEND = 10  # classes named in a curve's legend; more are drawn grey and unnamed


def save_figure(fig: Any, path: str | Path) -> None:
    """Write the matplotlib ``fig`` to ``path`` (format from the suffix) atomically and close it.

    Raises:
        OutputError: ``path`` cannot be written (the previous picture stays as it was).
    """
    path = Path(path)
    try:
        with reported_write(path), atomic_write(path, "wb") as f:
            fig.savefig(f, dpi=DPI, format=path.suffix.lstrip(".") or "png")
    finally:
        _pyplot().close(fig)


def write_image(path: str | Path, img: np.ndarray, flag: str | None = None) -> None:
    """Encode the BGR ``img`` by ``path``'s suffix (``.jpg`` when none) and write it atomically.

    Raises:
        OutputError: OpenCV cannot encode that format (``cv2.imencode`` returns False rather
            than raising), or ``path`` cannot be written (the previous picture stays);
            ``flag`` is the option that chose the folder.
    """
    path = Path(path)
    ok, buf = cv2.imencode(path.suffix or ".jpg", img)
    if not ok:
        raise OutputError(f"cannot write {path}: OpenCV cannot encode {path.suffix!r} images")
    with reported_write(path, flag), atomic_write(path, "wb") as f:
        f.write(buf.tobytes())


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def class_colour(c: int) -> tuple[int, int, int]:
    """A stable, distinct BGR colour per class: consecutive ids 94 degrees apart in hue (47 of
    OpenCV's 180 units), so neighbouring classes never look alike. Shared by ``predict.py``."""
    hsv = np.uint8([[[(c * 47) % 180, 220, 255]]])
    return tuple(int(v) for v in cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0])


def _name(names: Sequence[str], c: int) -> str:
    return names[c] if 0 <= c < len(names) else str(c)


@dataclass(frozen=True)
class DrawStyle:
    """How boxes are drawn: ``thickness`` (pixels, predict.py's ``--line-thickness``), and
    whether the label shows the class name (``--hide-labels``) and the confidence
    (``--hide-conf``)."""

    thickness: int = BOX_THICKNESS
    hide_labels: bool = False
    hide_conf: bool = False


def draw_detections(
    img: np.ndarray, det: Any, names: Sequence[str], style: DrawStyle = DrawStyle()
) -> np.ndarray:
    """Draw ``det`` ((n, 6) array or tensor: xyxy in ``img``'s pixels, conf, cls) on a copy of
    BGR ``img``: predict.py's pictures and the cells of :func:`plot_images`."""
    out = img.copy()
    scale = max(0.4, min(out.shape[:2]) / 800)
    for x1, y1, x2, y2, conf, cls in det.tolist():
        c = int(cls)
        colour = class_colour(c)
        p1, p2 = (round(x1), round(y1)), (round(x2), round(y2))
        cv2.rectangle(out, p1, p2, colour, style.thickness, cv2.LINE_AA)
        if style.hide_labels:
            continue
        label = _name(names, c)
        if not style.hide_conf:
            label += f" {conf:.2f}"
        (tw, th), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
        top = max(p1[1], th + base)
        cv2.rectangle(out, (p1[0], top - th - base), (p1[0] + tw, top), colour, -1)
        cv2.putText(
            out,
            label,
            (p1[0], top - base),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            (255, 255, 255),
            1,
            cv2.LINE_AA,
        )
    return out


def plot_labels(labels: Sequence[np.ndarray], names: Sequence[str], path: Path) -> None:
    """``labels.png``: instances per class, box centres and box sizes.

    Args:
        labels: per image ``(n, 5)`` = class, cx, cy, w, h normalised.
    """
    plt = _pyplot()
    lb = np.concatenate([np.asarray(x).reshape(-1, 5) for x in labels] or [np.zeros((0, 5))])
    nc = max(len(names), int(lb[:, 0].max()) + 1 if len(lb) else 1)
    counts = np.bincount(lb[:, 0].astype(np.int64), minlength=nc)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(range(nc), counts, color="tab:blue")
    axes[0].set(title=f"instances per class ({len(lb)} in all)", ylabel="instances")
    if nc <= 30:
        axes[0].set_xticks(range(nc), [_name(names, c) for c in range(nc)], rotation=90)
    axes[1].hist2d(lb[:, 1], lb[:, 2], bins=50, range=[[0, 1], [0, 1]], cmap="Blues")
    axes[1].set(title="box centres", xlabel="x", ylabel="y", xlim=(0, 1), ylim=(1, 0))
    axes[2].hist2d(lb[:, 3], lb[:, 4], bins=50, range=[[0, 1], [0, 1]], cmap="Blues")
    axes[2].set(title="box sizes", xlabel="width", ylabel="height", xlim=(0, 1), ylim=(0, 1))
    fig.tight_layout()
    save_figure(fig, path)


def plot_images(
    images: Sequence[np.ndarray],
    boxes: Sequence[np.ndarray],
    names: Sequence[str],
    path: Path,
    titles: Sequence[str] | None = None,
    show_conf: bool = False,
) -> None:
    """A mosaic of up to ``MOSAIC_MAX_IMAGES`` images with their boxes, written by OpenCV.

    Args:
        images: BGR ``uint8 (H, W, 3)`` images, any sizes.
        boxes: per image ``(n, 6)`` = x1, y1, x2, y2 in that image's pixels, confidence, class.
        titles: a caption per image (e.g. its file name).
        show_conf: write the confidence beside the class name (predictions).
    """
    images, boxes = list(images)[:MOSAIC_MAX_IMAGES], list(boxes)[:MOSAIC_MAX_IMAGES]
    n = max(len(images), 1)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    mosaic = np.full((rows * MOSAIC_CELL, cols * MOSAIC_CELL, 3), 114, dtype=np.uint8)
    for k, (img, det) in enumerate(zip(images, boxes)):
        h, w = img.shape[:2]
        s = MOSAIC_CELL / max(h, w)
        cell = cv2.resize(img, (max(1, round(w * s)), max(1, round(h * s))))
        det = np.array(det, dtype=np.float64).reshape(-1, 6)
        det[:, :4] *= s
        cell = draw_detections(cell, det, names, DrawStyle(hide_conf=not show_conf))
        if titles is not None and k < len(titles):
            cv2.putText(
                cell, titles[k][:40], (3, 12), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1
            )
        r, c = divmod(k, cols)
        y0, x0 = r * MOSAIC_CELL, c * MOSAIC_CELL
        mosaic[y0 : y0 + cell.shape[0], x0 : x0 + cell.shape[1]] = cell
        cv2.rectangle(
            mosaic, (x0, y0), (x0 + MOSAIC_CELL - 1, y0 + MOSAIC_CELL - 1), (255, 255, 255), 1
        )
    write_image(path, mosaic)


def batch_to_images(
    imgs: np.ndarray, targets: np.ndarray
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A collated training batch as :func:`plot_images` inputs.

    Args:
        imgs: ``(bs, 3, H, W)`` uint8 RGB.
        targets: ``(nt, 6)`` = image index in the batch, class, cx, cy, w, h normalised.
    """
    imgs = np.asarray(imgs)
    targets = np.asarray(targets, dtype=np.float64).reshape(-1, 6)
    h, w = imgs.shape[2:]
    out_imgs, out_boxes = [], []
    for i in range(min(len(imgs), MOSAIC_MAX_IMAGES)):
        out_imgs.append(np.ascontiguousarray(imgs[i].transpose(1, 2, 0)[:, :, ::-1]))
        t = targets[targets[:, 0] == i]
        xyxy = xywhn2xyxy(t[:, 2:6], w, h)
        out_boxes.append(np.concatenate((xyxy, np.ones((len(t), 1)), t[:, 1:2]), 1))
    return out_imgs, out_boxes


def plot_confusion_matrix(matrix: np.ndarray, names: Sequence[str], path: Path) -> None:
    """``confusion_matrix.png``: rows predicted, columns true, each column normalised to 1; the
    last row/column is background (missed labels / detections of nothing)."""
    plt = _pyplot()
    m = np.asarray(matrix, dtype=np.float64)
    nc = m.shape[0] - 1
    norm = m / np.maximum(m.sum(0, keepdims=True), 1)
    labels = [_name(names, c) for c in range(nc)] + ["background"]
    size = min(4 + 0.4 * (nc + 1), 16)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046)
    if nc < 30:
        ax.set_xticks(range(nc + 1), labels, rotation=90)
        ax.set_yticks(range(nc + 1), labels)
        for i in range(nc + 1):
            for j in range(nc + 1):
                if m[i, j]:
                    colour = "white" if norm[i, j] > 0.5 else "black"
                    ax.text(j, i, f"{norm[i, j]:.2f}", ha="center", va="center", color=colour)
    ax.set(xlabel="true", ylabel="predicted", title="confusion matrix (column-normalised)")
    fig.tight_layout()
    save_figure(fig, path)


def plot_curves(metrics: ClassMetrics, names: Sequence[str], out_dir: Path) -> list[Path]:
    """``PR_curve.png``, ``F1_curve.png``, ``P_curve.png`` and ``R_curve.png``: one line per class
    and the mean over classes with labels (thick). Returns the paths written."""
    plt = _pyplot()
    has = metrics.n_labels > 0
    px = metrics.px
    specs = [
        ("recall", "precision", metrics.pr_curve, metrics.ap50, "AP50"),
        ("confidence", "F1", metrics.f1_curve, None, None),
        ("confidence", "precision", metrics.p_curve, None, None),
        ("confidence", "recall", metrics.r_curve, None, None),
    ]
    written = []
    for fname, (xlabel, ylabel, curves, values, value_name) in zip(CURVE_FILES, specs, strict=True):
        fig, ax = plt.subplots(figsize=(7, 5))
        named = len(metrics.classes) <= MAX_CURVE_LEGEND
        for k, c in enumerate(metrics.classes.tolist()):
            if not has[k]:
                continue
            label = None
            if named:
                label = _name(names, c) + (f" {values[k]:.3f}" if values is not None else "")
            ax.plot(px, curves[k], linewidth=1, label=label, color=None if named else "grey")
        mean = curves[has].mean(0) if has.any() else np.zeros_like(px)
        if values is not None:
            mean_label = f"all classes {value_name} {values[has].mean() if has.any() else 0:.3f}"
        else:
            i = int(mean.argmax())
            mean_label = f"all classes {mean[i]:.2f} at {px[i]:.3f}"
        ax.plot(px, mean, linewidth=3, color="tab:blue", label=mean_label)
        ax.set(xlabel=xlabel, ylabel=ylabel, xlim=(0, 1), ylim=(0, 1.02))
        ax.legend(loc="lower left" if fname == CURVE_FILES[0] else "best", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        save_figure(fig, out_dir / fname)
        written.append(out_dir / fname)
    return written
