"""Detect objects in images, folders or videos with a trained checkpoint and draw the boxes.

    python predict.py --weights runs/demo/best.pt --source img.jpg
    python predict.py --weights best.pt --source folder/ clip.mp4 --output out/ --conf-thres 0.25
    python predict.py --weights yolov3-spp.weights --cfg cfg/yolov3-spp.cfg --names coco.names ...
    python predict.py --weights best.pt --source 0                         # webcam 0
    python predict.py --weights best.pt --source rtsp://host/stream --classes 0 2 --save-txt

A checkpoint written by train.py carries its cfg and class names, so ``--weights`` alone is
enough; state_dicts and Darknet ``.weights`` need ``--cfg`` and ``--names``/``--data``.
Each image's detections are printed (class, confidence, xyxy box in original pixels) and the
drawn image is saved under ``--output`` with the same name (videos, cameras and streams as
``<name>.mp4``); ``--save-txt`` also writes ``--output/labels/<name>.txt`` (YOLO format:
``class cx cy w h`` normalised, ``+ conf`` with ``--save-conf``; video frames as
``<name>_<frame>.txt``). A camera or stream runs until it ends or Ctrl-C.

predict.py never writes over what it reads or what an earlier run wrote (:func:`plan_outputs`,
:func:`choose_output_dir`): an output folder that is, lies inside or holds a source is refused;
an image found in a source folder keeps its path inside that folder, under a sub-folder named
after the folder when several sources are given (``a/``, ``a_2/`` for a second folder named
``a``); a name still taken twice (``x.jpg`` and ``x.png`` would share ``labels/x.txt``) gets
``_2``, ``_3``; and an ``--output`` folder that already holds files becomes ``OUTPUT2``,
``OUTPUT3``, ... (YOLOv5's ``exp2``) unless ``--exist-ok``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from build_utils.atomic import make_output_dir
from build_utils.augmentations import letterbox
from build_utils.boxes import non_max_suppression, scale_coords
from build_utils.errors import ConfigError, DatasetError, OutputError
from build_utils.image_io import IMG_FORMATS, is_image_file, read_image
from build_utils.limits import file_problem
from build_utils.parse_config import (
    load_class_names,
    parse_data_cfg,
)
from models.darknet import Darknet
from train_utils.builders import model_from_weights
from train_utils.checkpoint import (
    WeightsFile,
    read_weights,
)
from train_utils.cli import (
    DEFAULT_IMG_SIZE,
    HelpFormatter,
    add_device_flags,
    add_img_size_flag,
    add_model_flag,
    add_precision_flags,
    add_weights_flags,
    check_at_least,
    check_fractions,
    check_img_size,
    parse_args,
    run_main,
    setup_console_logging,
    take_from_run,
)
from train_utils.distributed.devices import select_device
from train_utils.distributed.precision import autocast_context, replay_precision, to_model_input
from train_utils.evaluation.exports import write_yolo_txt
from train_utils.evaluation.plots import class_colour, write_image

logger = logging.getLogger("predict")

VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".m4v", ".mpg", ".mpeg", ".wmv"}
STREAM_PREFIXES = ("rtsp://", "rtmp://", "http://", "https://")
OUTPUT_FLAG = "--output"  # the option that chose where pictures go, named in write errors
DEFAULT_FPS = 25.0  # for output videos of sources that do not report a frame rate
BOX_THICKNESS = 2


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("YOLOv3-SPP prediction", formatter_class=HelpFormatter)
    add_weights_flags(p, required=True, help="checkpoint .pt, state_dict .pt or Darknet .weights")
    p.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="image or video files, folders (images and videos inside), a camera "
        "index (0) or a stream URL (rtsp://, rtmp://, http(s)://)",
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
        help=".names file, one class per line (default: the checkpoint's names, else class ids)",
    )
    p.add_argument(
        "--output",
        default="runs/predict",
        help="folder for the drawn images/videos; one that already holds files becomes "
        "OUTPUT2, OUTPUT3, ... (default: %(default)s)",
    )
    p.add_argument(
        "--exist-ok",
        action="store_true",
        help="write into an --output folder that already holds files (same names are replaced)",
    )
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
        "--save-txt",
        action="store_true",
        help="write OUTPUT/labels/<name>.txt: class cx cy w h normalised",
    )
    p.add_argument("--save-conf", action="store_true", help="add the confidence to --save-txt")
    p.add_argument(
        "--half",
        action="store_true",
        help="fp16 weights and inputs (CUDA only; --amp is fp16 autocast)",
    )
    add_precision_flags(p, None, " (default: as the checkpoint's run)")
    add_device_flags(p)
    return p


def draw_detections(img: np.ndarray, det: torch.Tensor, names: Sequence[str]) -> np.ndarray:
    """Draw ``det`` ((n, 6) xyxy original pixels, conf, cls) on a copy of BGR ``img``."""
    out = img.copy()
    scale = max(0.4, min(out.shape[:2]) / 800)
    for x1, y1, x2, y2, conf, cls in det.tolist():
        c = int(cls)
        colour = class_colour(c)
        p1, p2 = (round(x1), round(y1)), (round(x2), round(y2))
        cv2.rectangle(out, p1, p2, colour, BOX_THICKNESS, cv2.LINE_AA)
        label = f"{names[c] if c < len(names) else c} {conf:.2f}"
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


class Predictor:
    """A model plus the letterbox/NMS/rescale steps around it, for BGR images of any size."""

    def __init__(
        self,
        model: Darknet,
        device: torch.device,
        img_size: int,
        conf_thres: float,
        iou_thres: float,
        max_det: int,
        agnostic: bool,
        amp: torch.dtype | None,
        classes: Sequence[int] | None = None,
        half: bool = False,
    ):
        if half and device.type != "cuda":
            raise ConfigError(f"--half needs a CUDA device, not {device}; on CPU use --amp (bf16)")
        self.model = model.to(device).eval()
        if half:
            self.model.half()  # fp16 weights; the input follows in __call__
        self.device, self.img_size, self.amp, self.half = device, img_size, amp, half
        self.conf_thres, self.iou_thres = conf_thres, iou_thres
        self.max_det, self.agnostic, self.classes = max_det, agnostic, classes

    @torch.no_grad()
    def __call__(self, img: np.ndarray) -> torch.Tensor:
        """Detections ``(n, 6)``: xyxy in ``img`` pixels, confidence, class."""
        lb, ratio, pad = letterbox(img, self.img_size, auto=True, scale_up=False)
        x = torch.from_numpy(np.ascontiguousarray(lb[:, :, ::-1].transpose(2, 0, 1)))
        dtype = torch.float16 if self.half else torch.float32
        x = to_model_input(x.unsqueeze(0), self.device, dtype=dtype)
        with autocast_context(self.device, self.amp):
            pred = self.model(x)[0]
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
        return det


def load_model(args: argparse.Namespace) -> tuple[Darknet, list[str], WeightsFile]:
    """The model ``--weights`` holds (its own cfg unless ``--cfg``), and the class names:
    ``--names``, else ``--data``'s, else the checkpoint's, else the class ids."""
    weights = read_weights(args.weights, trust=args.trust_checkpoint)
    take_from_run(args, weights.run, {"img_size": DEFAULT_IMG_SIZE}, f"--weights {args.weights}")
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
        ConfigError: a source that does not exist, or a folder with no image or video in it.
    """
    folder_names: set[str] = set()
    stems: set[str] = set()
    outputs, renamed = [], []
    for s in sources:
        if is_camera(s) or is_stream(s):
            planned = [(s, Path(capture_name(s)))]
        else:
            p = Path(s)
            if p.is_dir():
                # Anything named like media but a folder is planned, so that a FIFO, socket or
                # link loop named x.jpg is skipped with its reason rather than in silence.
                files = sorted(f for f in p.rglob("*") if _is_media(f) and not f.is_dir())
                if not files:
                    raise ConfigError(
                        f"--source {s}: no images or videos in this folder (images: "
                        f"{' '.join(IMG_FORMATS)}; videos: {' '.join(sorted(VIDEO_SUFFIXES))})"
                    )
                # Why the folder's own name: a user finds a/x.jpg's result under OUTPUT/a/.
                top = Path(_unique(p.resolve().name or "source", folder_names))
                base = top if len(sources) > 1 else Path()
                planned = [(f, base / f.relative_to(p).with_suffix("")) for f in files]
            elif os.path.lexists(p):  # a file, or a FIFO/link loop skipped with its reason
                planned = [(p, Path(p.stem))]
            else:
                raise ConfigError("--source: no such file or folder", p)
        for source, stem in planned:
            unique = Path(_unique(stem.as_posix(), stems))
            if unique != stem:
                renamed.append(f"{source} -> {unique}")
            outputs.append(Output(source, unique))
    if renamed:
        logger.warning("same output names told apart: %s", ", ".join(renamed))
    _refuse_if_nothing_readable(outputs)
    return outputs


def _refuse_if_nothing_readable(outputs: Sequence[Output]) -> None:
    """One line (before the model loads or the output folder exists) when no planned source is
    a readable file: ``--source /dev/zero`` or a folder of FIFOs has nothing to predict on, as
    YOLOv5 says for an empty source. Mixed sources keep going: each bad one is skipped."""
    problems = []
    for o in outputs:
        problem = file_problem(o.source, None) if isinstance(o.source, Path) else None
        if problem is None:
            return
        problems.append(f"{o.source}: {problem}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"--source: nothing readable to predict on: {problems[0]}{more}")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def _resolved(path: str | Path) -> Path:
    """``path`` with symbolic links resolved as far as they go: ``Path.resolve`` raises on a
    link loop, which is a source to skip with its reason, not a traceback."""
    return Path(os.path.realpath(path))


def check_not_over_sources(
    out_dir: Path, sources: Sequence[str], outputs: Sequence[Output]
) -> None:
    """Refuse an output folder that is a source folder, lies inside one, or holds a source file
    (paths compared resolved, so symbolic links count as what they point to).

    Raises:
        ConfigError: the output would be written over or among what is read.
    """
    out = _resolved(out_dir)
    for s in sources:
        if is_camera(s) or is_stream(s):
            continue
        src = _resolved(s)
        if src.is_dir() and _inside(out, src):
            where = "is" if out == src else "is inside"
            raise ConfigError(
                f"--output {out_dir} {where} --source {s}: the predictions would be written "
                "among the images they are made from; choose an --output outside it"
            )
        if _inside(src, out):
            raise ConfigError(
                f"--output {out_dir} holds --source {s}: the predictions could overwrite it; "
                "choose another --output"
            )
    for o in outputs:  # a symbolic link in a source folder may point into the output folder
        if isinstance(o.source, Path) and _inside(_resolved(o.source), out):
            raise ConfigError(
                f"--output {out_dir} holds {o.source} (a source image); choose another --output"
            )


def choose_output_dir(
    requested: Path, exist_ok: bool, sources: Sequence[str], outputs: Sequence[Output]
) -> Path:
    """Create and return the folder this run writes: ``requested``, or when it already holds
    files (an earlier run's predictions) and not ``exist_ok``, the first of ``requested2``,
    ``requested3``, ... that is new or empty, as YOLOv5 numbers ``exp2``.

    Raises:
        ConfigError: the folder overlaps a source (see :func:`check_not_over_sources`), or a
            file stands where it should be.
        OutputError: it cannot be created (a read-only place, a full disk).
    """
    check_not_over_sources(requested, sources, outputs)
    out, n = requested, 1
    while True:
        # A file where the folder should be is reported by make_output_dir, as every write is.
        if not out.is_dir() or exist_ok or not any(out.iterdir()):
            break
        n += 1
        out = requested.with_name(f"{requested.name}{n}")
    if out != requested:
        logger.info(
            "--output %s already holds files; writing to %s (--exist-ok to write into it)",
            requested,
            out,
        )
    check_not_over_sources(out, sources, outputs)
    return make_output_dir(out, OUTPUT_FLAG)


def open_capture(source: str | Path) -> cv2.VideoCapture:
    """A ``cv2.VideoCapture`` of a video file, a camera index or a stream URL."""
    return cv2.VideoCapture(int(source) if is_camera(str(source)) else str(source))


def capture_name(source: str | Path) -> str:
    """File stem for a video's outputs: the file's stem, ``camera0``, or the URL's last part."""
    if isinstance(source, Path):
        return source.stem
    if is_camera(source):
        return f"camera{source}"
    tail = source.rstrip("/").rsplit("/", 1)[-1]
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in tail) or "stream"


def predict_video(
    predictor: Predictor,
    source: str | Path,
    out_dir: Path,
    names: Sequence[str],
    txt_dir: Path | None = None,
    save_conf: bool = False,
    stem: Path | None = None,
) -> int:
    """Detect in every frame of a video file, camera or stream and write ``<stem>.mp4``
    (``stem``: the output path relative to ``out_dir``, default :func:`capture_name`).

    Raises:
        ConfigError: a camera or stream cannot be opened (a video file that cannot be read is a
            warning).
    """
    problem = file_problem(source, None) if isinstance(source, Path) else None
    if problem is not None:
        # A FIFO named clip.mp4 would block the decoder forever; a video has no size limit.
        logger.warning("skipped: %s: %s", source, problem)
        return 0
    cap = open_capture(source)
    if not cap.isOpened():
        cap.release()
        if isinstance(source, Path):
            logger.warning("%s: cannot open as a video; skipped", source)
            return 0
        if is_camera(source):
            raise ConfigError(
                f"--source {source}: cannot open camera {source}; check the index "
                "and that no other program uses it"
            )
        raise ConfigError(
            f"--source {source}: cannot open the stream; check the URL and that it is reachable"
        )
    fps = cap.get(cv2.CAP_PROP_FPS) or DEFAULT_FPS
    name = stem if stem is not None else capture_name(source)
    writer = None
    frames = 0
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            det = predictor(frame)
            drawn = draw_detections(frame, det, names)
            if writer is None:
                h, w = drawn.shape[:2]
                target = out_dir / f"{name}.mp4"
                fourcc = cv2.VideoWriter_fourcc(*"mp4v")
                writer = cv2.VideoWriter(str(target), fourcc, fps, (w, h))
                if not writer.isOpened():  # OpenCV reports no reason, only that it failed
                    raise OutputError(
                        f"cannot write {target}: OpenCV cannot open it for writing; "
                        f"check the place is writable and has space, or choose another "
                        f"{OUTPUT_FLAG}"
                    )
            writer.write(drawn)
            frames += 1
            if txt_dir is not None:
                write_yolo_txt(
                    txt_dir / f"{name}_{frames}.txt",
                    det.numpy(),
                    frame.shape[1],
                    frame.shape[0],
                    save_conf,
                    OUTPUT_FLAG,
                )
            print(f"{source} frame {frames}: {len(det)} detections")
    finally:
        cap.release()
        if writer is not None:
            writer.release()
    return frames


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(get_parser(), argv)
    setup_console_logging()

    def body() -> None:
        check_fractions({"--conf-thres": args.conf_thres, "--iou-thres": args.iou_thres})
        check_at_least({"--max-det": args.max_det}, 1)
        # Sources first: a missing or empty one is reported before the model is loaded.
        outputs = plan_outputs(args.source)
        device = select_device(args.device)
        model, names, weights = load_model(args)
        amp, _, _ = replay_precision(
            weights.precision, weights.run.get("amp"), args.amp, False, device
        )
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
            amp,
            args.classes,
            args.half,
        )
        out_dir = choose_output_dir(Path(args.output), args.exist_ok, args.source, outputs)
        txt_dir = make_output_dir(out_dir / "labels", OUTPUT_FLAG) if args.save_txt else None
        n_images = 0
        for item in outputs:
            path, stem = item.source, item.stem
            if stem.parent != Path():
                make_output_dir(out_dir / stem.parent, OUTPUT_FLAG)
            if txt_dir is not None:
                make_output_dir(txt_dir / stem.parent, OUTPUT_FLAG)
            if not isinstance(path, Path) or path.suffix.lower() in VIDEO_SUFFIXES:
                predict_video(predictor, path, out_dir, names, txt_dir, args.save_conf, stem)
                continue
            if not is_image_file(path):
                logger.warning("%s: not an image or video file; skipped", path)
                continue
            try:
                img = read_image(path)
            except DatasetError as e:  # one bad image is reported and skipped, never fatal
                logger.warning("skipped: %s", e)
                continue
            det = predictor(img)
            items = ", ".join(
                f"{names[int(c)] if int(c) < len(names) else int(c)} {conf:.2f} "
                f"[{x1:.0f},{y1:.0f},{x2:.0f},{y2:.0f}]"
                for x1, y1, x2, y2, conf, c in det.tolist()
            )
            print(f"{path}: {len(det)} detections{': ' + items if items else ''}")
            # Not with_suffix: a stem may hold dots of its own (img.v2.jpg -> stem img.v2).
            target = out_dir / stem.parent / (stem.name + path.suffix)
            write_image(target, draw_detections(img, det, names), OUTPUT_FLAG)
            if txt_dir is not None:
                write_yolo_txt(
                    txt_dir / f"{stem}.txt",
                    det.numpy(),
                    img.shape[1],
                    img.shape[0],
                    args.save_conf,
                    OUTPUT_FLAG,
                )
            n_images += 1
        logger.info("%d images drawn in %s", n_images, out_dir)

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
