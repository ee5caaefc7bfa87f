"""Detect objects in images, folders or videos with a trained checkpoint and draw the boxes.

    python predict.py --weights runs/demo/best.pt --source img.jpg
    python predict.py --weights best.pt --source folder/ clip.mp4 --output out/ --conf-thres 0.25
    python predict.py --weights yolov3-spp.weights --cfg cfg/yolov3-spp.cfg --names coco.names ...
    python predict.py --weights best.pt --source 'folder/val_0001*.jpg'    # a quoted pattern
    python predict.py --weights best.pt --source mydata/val.txt            # a list of paths
    python predict.py --weights best.pt --source 0                         # webcam 0
    python predict.py --weights best.pt --source rtsp://host/stream --classes 0 2 --save-txt

A checkpoint written by train.py carries its cfg and class names, so ``--weights`` alone is
enough; state_dicts and Darknet ``.weights`` need ``--cfg`` and ``--names``/``--data``. Each
image's detections are printed (class, confidence, xyxy box in original pixels) and drawn under
``--output``. The flags, the files written and what predict.py never writes over: README
"predict.py", :func:`plan_outputs` and :func:`choose_output_dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from build_utils.atomic import (
    check_not_over_sources,
    fsync_dir,
    make_output_dir,
    reported_write,
    temp_path,
)
from build_utils.augmentations import letterbox
from build_utils.boxes import non_max_suppression, scale_coords
from build_utils.checks import check_at_least, check_fractions
from build_utils.errors import ConfigError, DatasetError, OutputError
from build_utils.image_io import IMG_FORMATS, is_image_file, list_files, list_images, read_image
from build_utils.labels import img2label_path, read_image_list
from build_utils.limits import file_problem
from build_utils.parse_config import (
    load_class_names,
    parse_data_cfg,
)
from models.darknet import Darknet
from models.tta import detect
from train_utils.checkpoint import (
    WeightsFile,
    read_weights,
)
from train_utils.cli import (
    DEFAULT_RUN_NAME,
    HelpFormatter,
    add_augment_flag,
    add_device_flags,
    add_img_size_flag,
    add_model_flag,
    add_precision_flags,
    add_project_flags,
    add_weights_flags,
    check_environment,
    check_img_size,
    first_free_folder,
    project_folder,
    run_script,
    take_from_run,
    warn_save_conf_alone,
)
from train_utils.distributed.devices import select_device
from train_utils.evaluation.detection_files import write_yolo_txt
from train_utils.evaluation.plots import BOX_THICKNESS, DrawStyle, draw_detections, write_image
from train_utils.load_model import default_img_size, model_from_weights
from train_utils.precision import (
    InferencePrecision,
    autocast_context,
    inference_precision,
    replay_precision,
    to_model_input,
)
from train_utils.run_folder import check_not_a_run_file
from train_utils.threads import adapt_threads

logger = logging.getLogger("predict")

VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".m4v", ".mpg", ".mpeg", ".wmv"}
STREAM_PREFIXES = ("rtsp://", "rtmp://", "http://", "https://")
OUTPUT_FLAG = "--output"  # the option that chose where pictures go, named in write errors
LABELS_DIR = "labels"  # --save-txt's files, in the output folder
DEFAULT_PROJECT = "runs/predict"  # --name alone: runs/predict/NAME; nothing named: .../exp
DEFAULT_FPS = 25.0  # for output videos of sources that do not report a frame rate
# The frame rates OpenCV's mp4v writer opens a file at (measured: 0.002 and 65535 open, 0.001
# and 65536 do not; some RTSP streams report their 90 kHz clock as the rate).
MIN_VIDEO_FPS, MAX_VIDEO_FPS = 0.01, 65535.0
MAX_LINE_THICKNESS = 32767  # OpenCV's own limit (it raises beyond it)
# --save-crop grows each box as YOLOv5's save_one_box does: sides x1.02 plus 10 px in all
# (5 px a side), so a crop keeps the object's edge that a tight box may cut; then clipped.
CROP_GAIN = 1.02
CROP_PAD = 10
CROPS_DIR = "crops"


def _add_source_flags(p: argparse.ArgumentParser) -> None:
    add_weights_flags(p, required=True, help="checkpoint .pt, state_dict .pt or Darknet .weights")
    p.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="image or video files, folders (images and videos inside), a .txt list of image "
        "paths, a quoted glob pattern "
        "('dir/*.jpg', 'dir/**/*.png'), a camera index (0) or a stream URL (rtsp://, rtmp://, "
        "http(s)://)",
    )
    add_model_flag(p, None)
    p.add_argument(
        "--data",
        default=None,
        help=".data or data.yaml file whose class names to use (default: the checkpoint's names)",
    )
    p.add_argument(
        "--names",
        default=None,
        help=".names file, one class per line, or a data.yaml's names (default: the checkpoint's "
        "names, else class ids)",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        default=None,
        help="folder for the drawn images/videos; one that already holds files becomes "
        f"OUTPUT2, OUTPUT3, ... (default: {DEFAULT_PROJECT}/{DEFAULT_RUN_NAME}, numbered "
        f"{DEFAULT_RUN_NAME}2, ... as YOLOv5's runs/detect/exp)",
    )
    add_project_flags(p, DEFAULT_PROJECT, OUTPUT_FLAG)
    p.add_argument(
        "--exist-ok",
        action="store_true",
        help="write into an --output (or --project/--name) folder that already holds files "
        "(same names are replaced)",
    )
    p.add_argument(
        "--nosave",
        action="store_true",
        help="write no drawn images or videos (YOLOv5's flag): only --save-txt/--save-crop",
    )
    p.add_argument(
        "--save-txt",
        action="store_true",
        help="write OUTPUT/labels/<name>.txt: class cx cy w h normalised",
    )
    p.add_argument("--save-conf", action="store_true", help="add the confidence to --save-txt")
    p.add_argument(
        "--save-crop",
        action="store_true",
        help="cut each detection's box (grown by 2%% + 10 px, clipped) from the original "
        "picture into OUTPUT/crops/<class name>/<name>.jpg (<name>_2.jpg, ... for more)",
    )
    p.add_argument("--hide-labels", action="store_true", help="draw boxes without class names")
    p.add_argument("--hide-conf", action="store_true", help="draw class names without confidence")
    p.add_argument(
        "--line-thickness",
        type=int,
        default=BOX_THICKNESS,
        metavar="N",
        help="box line width in pixels",
    )


def _add_detection_flags(p: argparse.ArgumentParser) -> None:
    add_img_size_flag(p, None, "inference size, a multiple of 32 (default: the run's)")
    p.add_argument("--conf-thres", type=float, default=0.3, help="confidence threshold")
    p.add_argument("--iou-thres", type=float, default=0.6, help="NMS IoU threshold")
    p.add_argument("--max-det", type=int, default=300, help="detections kept per image")
    p.add_argument("--agnostic-nms", action="store_true", help="NMS across classes")
    p.add_argument(
        "--classes",
        type=int,
        nargs="+",
        default=None,
        help="keep only these class ids, e.g. --classes 0 2 (default: all)",
    )
    p.add_argument(
        "--vid-stride",
        type=int,
        default=1,
        metavar="N",
        help="predict every N-th frame of videos, cameras and streams (frames 1, N+1, ...); "
        "the output video has the source's frame rate / N",
    )
    add_augment_flag(p)
    add_precision_flags(p, None, " (default: as the checkpoint's run)", half=True)


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("YOLOv3-SPP prediction", formatter_class=HelpFormatter)
    _add_source_flags(p)
    _add_output_flags(p)
    _add_detection_flags(p)
    add_device_flags(p)
    return p


@dataclass(eq=False)
class Predictor:
    """A model plus the letterbox/NMS/rescale steps around it, for BGR images of any size."""

    model: Darknet
    device: torch.device
    img_size: int
    conf_thres: float
    iou_thres: float
    max_det: int
    agnostic: bool
    precision: InferencePrecision | None = None  # None: float32, no autocast
    classes: Sequence[int] | None = None
    augment: bool = False

    def __post_init__(self) -> None:
        # One dtype for the weights and the input, and the autocast decided with it
        # (inference_precision): --half never meets a replayed bf16 autocast.
        self.precision = self.precision or InferencePrecision(torch.float32, None, "float32")
        self.model = self.model.to(self.device, self.precision.weights).eval()

    @torch.no_grad()
    def __call__(self, img: np.ndarray) -> torch.Tensor:
        """Detections ``(n, 6)``: xyxy in ``img`` pixels, confidence, class."""
        # Enlarged as validation's loader enlarges it (long side img_size), so that a small
        # picture gets the boxes that were scored (was: not enlarged; the lineage's and
        # YOLOv5's detect enlarge too); padded to the stride, not to a square.
        lb, ratio, pad = letterbox(img, self.img_size, auto=True)
        x = torch.from_numpy(np.ascontiguousarray(lb[:, :, ::-1].transpose(2, 0, 1)))
        x = to_model_input(x.unsqueeze(0), self.device, dtype=self.precision.weights)
        with autocast_context(self.device, self.precision.autocast):
            pred = detect(self.model, x, self.augment)
        det = non_max_suppression(
            pred.float(),
            self.conf_thres,
            self.iou_thres,
            multi_label=False,
            classes=self.classes,
            agnostic=self.agnostic,
            max_det=self.max_det,
        )[0].cpu()
        if len(det):
            det[:, :4] = scale_coords(
                x.shape[2:], det[:, :4], img.shape[:2], ((ratio[1], ratio[0]), pad)
            )
        adapt_threads(self.device)
        return det


def crop_bounds(
    xyxy: Sequence[float], shape: tuple[int, ...], gain: float = CROP_GAIN, pad: float = CROP_PAD
) -> tuple[int, int, int, int]:
    """The pixel rows and columns ``(top, bottom, left, right)`` (end exclusive) that
    ``--save-crop`` cuts for the box ``xyxy`` (original pixels) from a picture of ``shape``
    ``(h, w, ...)``: the box's width and height times ``gain`` plus ``pad`` around its centre,
    widened to whole pixels (floor, ceil) and clipped to the picture; empty when the box lies
    outside it."""
    x1, y1, x2, y2 = (float(v) for v in xyxy)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    half_w, half_h = ((x2 - x1) * gain + pad) / 2, ((y2 - y1) * gain + pad) / 2
    h, w = shape[:2]
    left = min(max(math.floor(cx - half_w), 0), w)
    right = min(max(math.ceil(cx + half_w), left), w)
    top = min(max(math.floor(cy - half_h), 0), h)
    bottom = min(max(math.ceil(cy + half_h), top), h)
    return top, bottom, left, right


def _folder_name(name: str) -> str:
    """``name`` as one path component: path separators and characters file systems refuse
    become ``_``, and a name of dots only (``..``) is not a way out of the crops folder."""
    safe = "".join(ch if ch.isalnum() or ch in " -_.+()" else "_" for ch in name).strip()
    return "_" + safe if not safe.strip(".") else safe


class Saver:
    """What predict.py writes for one picture (an image, or a video frame) beside the drawn
    picture: ``--save-txt`` labels and ``--save-crop`` crops, never two files under one name.

    Crops go to ``OUTPUT/crops/<class>/<stem>.jpg``, the picture's k-th crop of a class as
    ``<stem>_k.jpg``; a name taken earlier in this run (``x_2`` is also a planned stem when
    ``x.jpg`` and ``x.png`` are both sources), or one of the ``reserved`` output stems (a
    source folder named ``crops`` puts drawn pictures under ``OUTPUT/crops/`` too), moves on to
    the next free one. Class folders are class names made safe as one path component (two
    classes that would share one folder get ``_2``).
    """

    def __init__(
        self,
        out_dir: Path,
        names: Sequence[str],
        style: DrawStyle = DrawStyle(),  # noqa: B008 (frozen: one shared default is safe)
        save_txt: bool = False,
        save_conf: bool = False,
        save_crop: bool = False,
        reserved: Iterable[str] = (),
        save_drawn: bool = True,
    ):
        self.out_dir, self.names, self.style = out_dir, names, style
        self.save_drawn = save_drawn  # the drawn pictures and videos (off: --nosave)
        self._reserved = {r.casefold() for r in reserved}
        self.save_conf, self.save_crop = save_conf, save_crop
        # Folders this run created, parents first (those left empty go again at the end).
        self._made: list[Path] = []
        self.txt_dir = self._make(out_dir / LABELS_DIR, out_dir) if save_txt else None
        self._class_folders: dict[int, str] = {}
        self._folders_taken: set[str] = set()
        self._crops_taken: dict[str, set[str]] = {}
        # Output stems of this run's sources and of the video frames named so far.
        self._stems_taken = set(self._reserved)

    def frame_stem(self, video: Path | str, number: int) -> str:
        """The name of frame ``number`` of the video whose output stem is ``video``, for its
        labels and crops: ``<video>_<number>``, or ``<video>_<number>_2``, ... when a source of
        this run or an earlier frame has that stem (``clip_1.jpg`` beside ``clip.mp4``), so a
        frame's labels never replace an image's."""
        return _unique(f"{Path(video).as_posix()}_{number}", self._stems_taken)

    def _make(self, folder: Path, root: Path) -> Path:
        """Create ``folder`` (below ``root``), remembering which of its folders are new."""
        new = [p for p in (folder, *folder.parents) if p.is_relative_to(root) and p != root]
        self._made += [p for p in reversed(new) if not p.exists()]
        return make_output_dir(folder, OUTPUT_FLAG)

    def prepare(self, stem: Path) -> None:
        """Create the sub-folders that ``stem``'s outputs go to."""
        if stem.parent != Path():
            self._make(self.out_dir / stem.parent, self.out_dir)
        if self.txt_dir is not None:
            self._make(self.txt_dir / stem.parent, self.txt_dir)

    def remove_unused_folders(self) -> None:
        """Remove the folders this run made that stayed empty (every image of a source folder
        skipped, or nothing readable at all), deepest first; never one that was there before,
        nor one something was written to."""
        for folder in reversed(self._made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one goes

    def save(self, img: np.ndarray, det: torch.Tensor, stem: Path | str) -> None:
        """Labels and crops of ``det`` ((n, 6) xyxy in ``img``'s pixels, conf, cls) found in
        the BGR ``img``; ``stem``: the picture's output path relative to OUTPUT, no suffix."""
        if self.txt_dir is not None:
            write_yolo_txt(
                self.txt_dir / f"{stem}.txt",
                det.numpy(),
                img.shape[1],
                img.shape[0],
                self.save_conf,
                OUTPUT_FLAG,
            )
        if self.save_crop:
            for *xyxy, _, cls in det.tolist():
                self._save_crop(img, xyxy, int(cls), Path(stem))

    def _class_folder(self, c: int) -> str:
        if c not in self._class_folders:
            name = _folder_name(str(self.names[c] if 0 <= c < len(self.names) else c))
            self._class_folders[c] = _unique(name, self._folders_taken)
        return self._class_folders[c]

    def _save_crop(self, img: np.ndarray, xyxy: Sequence[float], c: int, stem: Path) -> None:
        top, bottom, left, right = crop_bounds(xyxy, img.shape)
        if bottom <= top or right <= left:
            return  # the box lies outside the picture: nothing to cut
        folder = self._class_folder(c)
        taken = self._crops_taken.setdefault(folder, set())
        name = _unique(stem.as_posix(), taken)
        while f"{CROPS_DIR}/{folder}/{name}".casefold() in self._reserved:
            name = _unique(stem.as_posix(), taken)  # _unique took the last one: the next
        target = self.out_dir / CROPS_DIR / folder / f"{name}.jpg"
        make_output_dir(target.parent, OUTPUT_FLAG)
        write_image(target, np.ascontiguousarray(img[top:bottom, left:right]), OUTPUT_FLAG)


def load_model(args: argparse.Namespace) -> tuple[Darknet, list[str], WeightsFile]:
    """The model ``--weights`` holds (its own cfg unless ``--cfg``), and the class names:
    ``--names``, else ``--data``'s, else the checkpoint's, else the class ids."""
    weights = read_weights(args.weights, trust=args.trust_checkpoint)
    # The fallback is a number, so that a recorded img_size of another kind is still refused.
    size = args.img_size if args.img_size is not None else default_img_size(weights, args.cfg)
    take_from_run(args, weights.run, {"img_size": size}, f"--weights {args.weights}")
    check_img_size(args.img_size)
    names = weights.names
    if args.names:
        names = load_class_names(args.names)
    elif args.data:
        names = parse_data_cfg(args.data)["class_names"]
    model = model_from_weights(weights, args.cfg, len(names) if names else None, args.img_size)
    return model, names or [str(i) for i in range(model.nc)], weights


def is_camera(source: str) -> bool:
    return source.isdigit()


def is_stream(source: str) -> bool:
    return source.lower().startswith(STREAM_PREFIXES)


@dataclass(frozen=True)
class Output:
    """One thing to predict on and where its results go.

    ``source``: an image or video file (Path), or a camera index / stream URL (str).
    ``stem``: its output path relative to ``--output``, without suffix: the image is written as
    ``stem + its suffix``, a video as ``stem.mp4``, labels as ``labels/stem.txt``
    (``labels/stem_<frame>.txt`` for video frames).
    """

    source: str | Path
    stem: Path


def _is_media(path: Path) -> bool:
    return is_image_file(path) or path.suffix.lower() in VIDEO_SUFFIXES


def _unique(name: str, taken: set[str]) -> str:
    """``name``, or ``name_2``, ``name_3``, ... the first not in ``taken`` (compared without
    letter case, as macOS and Windows file systems do); the result is added to ``taken``."""
    candidate, k = name, 1
    while candidate.casefold() in taken:
        k += 1
        candidate = f"{name}_{k}"
    taken.add(candidate.casefold())
    return candidate


def plan_outputs(sources: Sequence[str]) -> list[Output]:
    """Every image and video of ``sources`` (folders searched recursively, sorted), camera and
    stream, in the order given, each with an output path no other one shares.

    An image in a source folder keeps its path inside the folder; with several sources each
    folder's outputs go to a sub-folder named after it (``a_2`` for a second folder named
    ``a``), so same-named images of different folders keep apart. Files, cameras and streams go
    to the top. Two outputs that would still share a stem (``x.jpg`` and ``x.png`` both label
    ``x.txt``; ``a/x.jpg`` and ``b/x.jpg`` given as files) are told apart by ``_2``, ``_3``.

    Raises:
        ConfigError: a source that does not exist, a folder or pattern with no image or video,
            or sources none of which is an image or video file to read.
    """
    folder_names: set[str] = set()
    stems: set[str] = set()
    outputs, renamed = [], []
    for s in sources:
        if not s.strip():  # an unset shell variable; Path("") would be the current folder
            raise ConfigError(
                f"--source {s!r}: an empty source; give an image, folder, video, pattern, "
                "camera index or URL"
            )
        for source, stem in _planned(s, folder_names, len(sources) > 1):
            unique = Path(_unique(stem.as_posix(), stems))
            if unique != stem:
                renamed.append(f"{source} -> {unique}")
            outputs.append(Output(source, unique))
    if renamed:
        logger.warning("same output names told apart: %s", ", ".join(renamed))
    _refuse_if_nothing_readable(outputs)
    return outputs


# What a source must hold, named where it holds none.
MEDIA_KINDS = f"images: {' '.join(IMG_FORMATS)}; videos: {' '.join(sorted(VIDEO_SUFFIXES))}"
GLOB_CHARS = "*?["  # a --source that does not exist and holds one of these is a pattern


def _planned(s: str, folder_names: set[str], several: bool) -> list[tuple[str | Path, Path]]:
    """What one ``--source`` holds, each with its output stem (see :func:`plan_outputs`)."""
    if is_camera(s) or is_stream(s):
        return [(s, Path(capture_name(s)))]
    p = Path(s)
    if p.is_dir():
        # Anything named like media but a folder is planned, so that a FIFO, socket or
        # link loop named x.jpg is skipped with its reason rather than in silence.
        top_abs = os.path.abspath(p)
        files = [p / os.path.relpath(f, top_abs) for f in list_files(p) if _is_media(Path(f))]
        if not files:
            raise ConfigError(f"--source {s}: no images or videos in this folder ({MEDIA_KINDS})")
        # Why the folder's own name: a user finds a/x.jpg's result under OUTPUT/a/.
        top = Path(_unique(p.resolve().name or "source", folder_names))
        base = top if several else Path()
        return [(f, base / f.relative_to(p).with_suffix("")) for f in files]
    if p.suffix.lower() == ".txt" and os.path.lexists(p):
        # A list of image paths, one a line (YOLOv5 takes it; a dataset's train.txt is one),
        # relative ones beside the list as the loader reads it: each entry as if given, an
        # entry that is missing or no image skipped with its reason.
        entries = [Path(f) for f in read_image_list(p)]
        if not entries:
            raise ConfigError(f"--source {s}: no image or video paths in this list")
        return [(f, Path(f.stem)) for f in entries]
    if os.path.lexists(p):  # a file, or a FIFO/link loop skipped with its reason
        return [(p, Path(p.stem))]
    if any(c in s for c in GLOB_CHARS):
        # A quoted pattern (YOLOv5 takes 'dir/*.jpg'; ** reaches into sub-folders): its
        # files, as if each were given.
        found = sorted(Path(m) for m in glob.glob(s, recursive=True))
        files = [f for f in found if _is_media(f) and not f.is_dir()]
        if not files:
            what = "no file" if not found else "no image or video file"
            raise ConfigError(f"--source {s}: {what} matches this pattern ({MEDIA_KINDS})")
        return [(f, Path(f.stem)) for f in files]
    raise ConfigError("--source: no such file or folder", p)


def _refuse_if_nothing_readable(outputs: Sequence[Output]) -> None:
    """One line (before the model loads or the output folder exists) when no planned source is
    a readable file: ``--source /dev/zero`` or a folder of FIFOs has nothing to predict on, as
    YOLOv5 says for an empty source. Mixed sources keep going: each bad one is skipped."""
    problems = []
    for o in outputs:
        if not isinstance(o.source, Path):
            return
        problem = file_problem(o.source, None)
        if problem is None and not _is_media(o.source):
            problem = f"not an image or video file ({MEDIA_KINDS})"
        if problem is None:
            return
        problems.append(f"{o.source}: {problem}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"--source: nothing readable to predict on: {problems[0]}{more}")


def check_not_a_datasets_labels(out: Path) -> None:
    """Refuse ``--save-txt`` into ``out`` when ``out/labels`` holds the label files of images
    in ``out/images``: a dataset's ground truth, which predictions must never replace, not even
    with ``--exist-ok`` (was: ``--output d/val --exist-ok --save-txt`` replaced them).

    Raises:
        ConfigError: ``out/labels`` pairs with ``out/images``.
    """
    labels, images = out / LABELS_DIR, out / "images"
    if not (labels.is_dir() and images.is_dir()):
        return
    if any(Path(img2label_path(f)).is_file() for f in list_images(images)):
        raise ConfigError(
            f"{OUTPUT_FLAG} {out}: {labels} holds the labels of the images in {images} (a "
            f"dataset's), which --save-txt would replace; choose another {OUTPUT_FLAG}"
        )


def check_not_over_kept_files(out: Path, outputs: Sequence[Output]) -> None:
    """Refuse a picture that would replace a file predictions must never replace, not even with
    ``--exist-ok``: a training run's own file (``train_batch0.jpg``, ``results.png`` in a folder
    holding that run) or a dataset's image (one whose label file exists). Was: ``--exist-ok``
    into ``images/train`` replaced the training images with drawn ones.

    Raises:
        ConfigError: naming the first such file.
    """
    if not out.is_dir():
        return
    with os.scandir(out) as entries:
        if next(entries, None) is None:
            return  # an empty folder (no --exist-ok into files): no stat per source image
    for o in outputs:
        if not (isinstance(o.source, Path) and is_image_file(o.source)):
            continue  # a video's or stream's stem.mp4: no run or dataset file has that name
        target = out / f"{o.stem.as_posix()}{o.source.suffix}"
        if not target.is_file():
            continue
        check_not_a_run_file(target, OUTPUT_FLAG, out.with_name(f"{out.name}-predict"))
        if Path(img2label_path(str(target))).is_file():
            raise ConfigError(
                f"{OUTPUT_FLAG} {out}: {target} is a dataset's image (its labels are in "
                f"{img2label_path(str(target))}), which a drawn picture would replace; choose "
                f"another {OUTPUT_FLAG}"
            )


def choose_output_dir(
    requested: Path,
    exist_ok: bool,
    sources: Sequence[str],
    outputs: Sequence[Output],
    save_txt: bool = False,
) -> tuple[Path, bool]:
    """Create and return the folder this run writes, and whether it was new: ``requested``,
    or when it already holds files (an earlier run's predictions) and not ``exist_ok``, the
    first of ``requested2``, ``requested3``, ... that is new or empty, as YOLOv5 numbers
    ``exp2``.

    Raises:
        ConfigError: the folder is, lies inside or holds a source (see
            :func:`~build_utils.atomic.check_not_over_sources`), or a file stands where it
            should be.
        OutputError: it cannot be created (a read-only place, a full disk).
    """
    read = {f"--source {s}": s for s in sources if not (is_camera(s) or is_stream(s))}
    images = [o.source for o in outputs if isinstance(o.source, Path)]
    # A file where the folder should be is reported by make_output_dir, as every write is.
    out = first_free_folder(requested, exist_ok)
    for folder in dict.fromkeys((requested, out)):
        check_not_over_sources(
            folder, OUTPUT_FLAG, read, images, "the predictions", "a source image"
        )
    if save_txt:
        check_not_a_datasets_labels(out)
    check_not_over_kept_files(out, outputs)
    if out != requested:
        logger.info(
            "--output %s already holds files; writing to %s (--exist-ok to write into it)",
            requested,
            out,
        )
    created = not out.exists()
    return make_output_dir(out, OUTPUT_FLAG), created


def open_capture(source: str | Path) -> cv2.VideoCapture:
    """A ``cv2.VideoCapture`` of a video file, a camera index or a stream URL."""
    # OpenCV logs its own WARN lines for a camera that does not open ("can't open camera by
    # index"); :func:`open_video` says it in one line instead. Its errors still show; the
    # user's level comes back after the open.
    log = cv2.utils.logging
    level = log.getLogLevel()
    log.setLogLevel(min(level, log.LOG_LEVEL_ERROR))
    try:
        return cv2.VideoCapture(int(source) if is_camera(str(source)) else str(source))
    finally:
        log.setLogLevel(level)


def capture_name(source: str | Path) -> str:
    """File stem for a video's outputs: the file's stem, ``camera0``, or the URL's last part."""
    if isinstance(source, Path):
        return source.stem
    if is_camera(source):
        return f"camera{source}"
    tail = source.rstrip("/").rsplit("/", 1)[-1]
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in tail) or "stream"


def output_fps(source_fps: float, vid_stride: int = 1) -> float:
    """The frame rate of the output video of a source reporting ``source_fps`` (0, negative or
    NaN: none, :data:`DEFAULT_FPS`) predicted every ``vid_stride``-th frame: the source's rate
    / ``vid_stride``, held within what the mp4 writer opens (a warning when it is not), so a
    large ``--vid-stride`` or an odd stream is not reported as an unwritable place."""
    fps = source_fps if math.isfinite(source_fps) and source_fps > 0 else DEFAULT_FPS
    wanted = fps / vid_stride
    held = min(max(wanted, MIN_VIDEO_FPS), MAX_VIDEO_FPS)
    if held != wanted:
        logger.warning(
            "the output video plays at %g frames per second, not %g (%g / --vid-stride %d): "
            "an mp4 holds %g to %g",
            held,
            wanted,
            fps,
            vid_stride,
            MIN_VIDEO_FPS,
            MAX_VIDEO_FPS,
        )
    return held


def open_video(source: str | Path) -> cv2.VideoCapture | None:
    """The capture of a video file, camera or stream; None (with a warning) for a video file
    that cannot be read.

    Raises:
        ConfigError: a camera or stream cannot be opened.
    """
    problem = file_problem(source, None) if isinstance(source, Path) else None
    if problem is not None:
        # A FIFO named clip.mp4 would block the decoder forever; a video has no size limit.
        logger.warning("skipped: %s: %s", source, problem)
        return None
    cap = open_capture(source)
    if cap.isOpened():
        return cap
    cap.release()
    if isinstance(source, Path):
        logger.warning("%s: cannot open as a video; skipped", source)
        return None
    if is_camera(source):
        raise ConfigError(
            f"--source {source}: cannot open camera {source}; check the index "
            "and that no other program uses it"
        )
    raise ConfigError(
        f"--source {source}: cannot open the stream; check the URL and that it is reachable"
    )


def open_live_sources(outputs: Sequence[Output]) -> dict[str, cv2.VideoCapture]:
    """Every camera and stream of ``outputs``, opened before the model loads or anything is
    written, so that one that cannot open is one line and leaves nothing behind.

    Raises:
        ConfigError: one cannot be opened (those opened before are released).
    """
    captures: dict[str, cv2.VideoCapture] = {}
    try:
        for o in outputs:
            if isinstance(o.source, str):
                captures[o.source] = open_video(o.source)
    except BaseException:
        for cap in captures.values():
            cap.release()
        raise
    return captures


def predict_video(
    predictor: Predictor,
    source: str | Path,
    saver: Saver,
    stem: Path,
    vid_stride: int = 1,
    cap: cv2.VideoCapture | None = None,
) -> int:
    """Detect in frames 1, 1 + ``vid_stride``, ... of a video file, camera or stream (``cap``:
    already opened, see :func:`open_live_sources`) and write them to ``<stem>.mp4`` at the
    source's frame rate / ``vid_stride`` (so the video lasts as long as the source); ``stem``:
    the output path relative to OUTPUT. Labels and crops of a frame are named
    ``<stem>_<frame number>`` (see :meth:`Saver.frame_stem`).
    Returns the number of frames predicted.

    Raises:
        ConfigError: a camera or stream cannot be opened (a video file that cannot be read is a
            warning).
    """
    cap = cap if cap is not None else open_video(source)
    if cap is None:
        return 0
    target = saver.out_dir / f"{stem}.mp4"
    # Written under a hidden temporary name (ending .mp4: OpenCV picks the container by it) and
    # renamed onto ``target`` at the end, so an --exist-ok run that fails midway leaves the old
    # video whole; a Ctrl-C (a camera's usual end) keeps the frames so far.
    tmp = temp_path(target).with_suffix(".tmp.mp4")
    video = _VideoOut(tmp, target, output_fps(cap.get(cv2.CAP_PROP_FPS), vid_stride))
    finished = False
    try:
        frames = _predict_frames(predictor, cap, source, saver, stem, vid_stride, video)
        finished = True
    except KeyboardInterrupt:
        finished = True
        # A camera's usual end, but a file's video would pass for whole: say it is not.
        logger.warning(
            "%s: interrupted; %s holds its first %d frames", source, target, video.written
        )
        raise
    finally:
        cap.release()
        video.close(keep=finished)
    return frames


@dataclass
class _VideoOut:
    """An mp4 written at ``tmp`` and renamed onto ``target`` when kept; opened on the first
    frame (its size is the frame's)."""

    tmp: Path
    target: Path
    fps: float
    writer: cv2.VideoWriter | None = None
    written: int = 0  # frames written so far

    def write(self, frame: np.ndarray) -> None:
        if self.writer is None:
            h, w = frame.shape[:2]
            fourcc = cv2.VideoWriter_fourcc(*"mp4v")
            self.writer = cv2.VideoWriter(str(self.tmp), fourcc, self.fps, (w, h))
            if not self.writer.isOpened():  # OpenCV reports no reason, only that it failed
                raise OutputError(
                    f"cannot write {self.target}: OpenCV cannot open it for writing; "
                    f"check the place is writable and has space, or choose another {OUTPUT_FLAG}"
                )
        self.writer.write(frame)
        self.written += 1

    def close(self, keep: bool) -> None:
        if self.writer is not None:
            self.writer.release()
        try:
            if keep and self.writer is not None and self.tmp.exists():
                with reported_write(self.target, OUTPUT_FLAG):  # a folder named clip.mp4
                    os.replace(self.tmp, self.target)
                fsync_dir(self.target.parent)
        finally:
            self.tmp.unlink(missing_ok=True)


def _predict_frames(
    predictor: Predictor,
    cap: cv2.VideoCapture,
    source: str | Path,
    saver: Saver,
    name: Path | str,
    vid_stride: int,
    video: _VideoOut,
) -> int:
    frames = number = 0
    while True:
        # Skipped frames are grabbed, not decoded: a stride of N costs about 1/N.
        if number % vid_stride and cap.grab():
            number += 1
            continue
        ok, frame = cap.read()
        if not ok:
            return frames
        number += 1
        det = predictor(frame)
        if saver.save_drawn:
            video.write(draw_detections(frame, det, saver.names, saver.style))
        frames += 1
        saver.save(frame, det, saver.frame_stem(name, number))
        print(f"{source} frame {number}: {len(det)} detections")


def check_flags(args: argparse.Namespace) -> None:
    check_fractions({"--conf-thres": args.conf_thres, "--iou-thres": args.iou_thres})
    check_at_least(
        {
            "--max-det": args.max_det,
            "--line-thickness": args.line_thickness,
            "--vid-stride": args.vid_stride,
        },
        1,
    )
    if args.line_thickness > MAX_LINE_THICKNESS:
        raise ConfigError(
            f"--line-thickness {args.line_thickness}: at most {MAX_LINE_THICKNESS} pixels"
        )
    warn_save_conf_alone(args)


def make_predictor(args: argparse.Namespace) -> tuple[Predictor, list[str]]:
    """The model with the steps around it and the precision it computes in, and its class
    names."""
    device = select_device(args.device)
    model, names, weights = load_model(args)
    amp, _, why = replay_precision(
        weights.precision, weights.run.get("amp"), args.amp, False, device
    )
    precision = inference_precision(amp, why, args.half, args.amp, device)
    if args.classes is not None and any(not 0 <= c < len(names) for c in args.classes):
        raise ConfigError(f"--classes {args.classes}: class ids are 0..{len(names) - 1}")
    predictor = Predictor(
        model,
        device,
        args.img_size,
        args.conf_thres,
        args.iou_thres,
        args.max_det,
        args.agnostic_nms,
        precision,
        args.classes,
        args.augment,
    )
    return predictor, names


def predict_image(predictor: Predictor, saver: Saver, path: Path, stem: Path) -> bool:
    """Detect in one image file, print the detections, write the drawn picture (and labels,
    crops); False when it is skipped (not an image, unreadable)."""
    if not is_image_file(path):
        logger.warning("%s: not an image or video file; skipped", path)
        return False
    try:
        img = read_image(path)
    except DatasetError as e:  # one bad image is reported and skipped, never fatal
        logger.warning("skipped: %s", e)
        return False
    det = predictor(img)
    names = saver.names
    items = ", ".join(
        f"{names[int(c)] if int(c) < len(names) else int(c)} {conf:.2f} "
        f"[{x1:.0f},{y1:.0f},{x2:.0f},{y2:.0f}]"
        for x1, y1, x2, y2, conf, c in det.tolist()
    )
    print(f"{path}: {len(det)} detections{': ' + items if items else ''}")
    # Not with_suffix: a stem may hold dots of its own (img.v2.jpg -> stem img.v2).
    target = saver.out_dir / stem.parent / (stem.name + path.suffix)
    if saver.save_drawn:
        write_image(target, draw_detections(img, det, saver.names, saver.style), OUTPUT_FLAG)
    saver.save(img, det, stem)
    return True


def predict_sources(
    args: argparse.Namespace,
    predictor: Predictor,
    saver: Saver,
    outputs: Sequence[Output],
    captures: dict[str, cv2.VideoCapture],
) -> tuple[int, int]:
    """Every planned source in order; (images drawn, video frames drawn)."""
    n_images = n_frames = 0
    for item in outputs:
        path, stem = item.source, item.stem
        saver.prepare(stem)
        if not isinstance(path, Path) or path.suffix.lower() in VIDEO_SUFFIXES:
            cap = captures.pop(path, None) if isinstance(path, str) else None
            n_frames += predict_video(predictor, path, saver, stem, args.vid_stride, cap)
        else:
            n_images += predict_image(predictor, saver, path, stem)
    return n_images, n_frames


def predict(args: argparse.Namespace) -> None:
    # A bad YOLO_THREADS or limit is reported before anything is loaded (as train.py does).
    check_environment()
    check_flags(args)
    requested = project_folder(args, OUTPUT_FLAG, DEFAULT_PROJECT) or Path(
        args.output or f"{DEFAULT_PROJECT}/{DEFAULT_RUN_NAME}"
    )
    # Sources first: a missing or empty one is reported before the model is loaded.
    outputs = plan_outputs(args.source)
    captures = open_live_sources(outputs)
    try:
        predictor, names = make_predictor(args)
        out_dir, created = choose_output_dir(
            requested, args.exist_ok, args.source, outputs, args.save_txt
        )
        # predict.py runs contiguous inputs (to_model_input's default), whatever the run did.
        logger.info("%s", predictor.precision.describe(channels_last=False))
        style = DrawStyle(args.line_thickness, args.hide_labels, args.hide_conf)
        planned = [o.stem.as_posix() for o in outputs]
        saver = Saver(
            out_dir,
            names,
            style,
            args.save_txt,
            args.save_conf,
            args.save_crop,
            planned,
            save_drawn=not args.nosave,
        )
        n_images, n_frames = predict_sources(args, predictor, saver, outputs, captures)
        saver.remove_unused_folders()
    finally:
        for cap in captures.values():
            cap.release()
    if not n_images and not n_frames:
        if created:  # a run that wrote nothing leaves nothing
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise ConfigError(
            f"--source {' '.join(args.source)}: no image or video frame could be read (each "
            "one skipped above); nothing written"
        )
    # Frames counted apart: a run of videos only is not "0 images drawn".
    frames = f" and {n_frames} video frames" if n_frames else ""
    if args.nosave and created:  # with neither --save-txt nor --save-crop: no empty folder
        with contextlib.suppress(OSError):
            out_dir.rmdir()
    done = "predicted (--nosave: no drawn pictures)" if args.nosave else "drawn"
    where = f"in {out_dir}" if out_dir.exists() else "(nothing written)"
    images = "1 image" if n_images == 1 else f"{n_images} images"
    logger.info("%s%s %s %s", images, frames, done, where)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), predict, argv)


if __name__ == "__main__":
    sys.exit(main())
