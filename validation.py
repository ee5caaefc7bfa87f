"""Evaluate weights on a dataset's validation set: COCO mAP (faster-coco-eval where installed,
else pycocotools: the same numbers), per-class table, error breakdown.

    python validation.py --weights runs/exp/best.pt            # the run's own data and settings
    python validation.py --weights runs/exp/best.pt --data data/other.data
    python validation.py --weights yolov3-spp.weights --cfg cfg/yolov3-spp.cfg --data coco.data
    python validation.py ... --save-json out/ --json-out stats.json
    python validation.py ... --save-json out/ --coco-gt instances_val.json  # + the source JSON
    python validation.py ... --save-txt --save-conf --save-dir runs/val/exp
    python validation.py ... --task test                     # the data's test split instead
    python validation.py ... --task speed --batch-size 1      # ms per image for each step
    python validation.py ... --augment                       # test-time augmentation (3 passes)
    torchrun --nproc_per_node=2 validation.py ...     # each process scores a disjoint shard

A checkpoint written by train.py describes its run, and every setting not given on the command
line is the run's (:data:`RUN_SETTINGS`, the autocast dtype and memory format it evaluated in),
so ``validation.py --weights best.pt`` gives the mAP the run logged for that epoch; a flag
overrides the run's value (and a line says so). Darknet ``.weights`` and bare state_dicts carry
nothing: they need ``--cfg`` and ``--data``. The report folder's files, the ``--save-json`` ids
(:func:`json_ids`) and what validation never writes over (:func:`check_outputs`,
:func:`check_not_over_inputs`): README "validation.py".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from build_utils.atomic import (
    check_apart,
    check_new_outputs,
    check_not_an_input,
    check_not_over_sources,
    check_output_place,
    make_output_dir,
    write_text,
)
from build_utils.checks import check_at_least, check_fractions
from build_utils.datasets import UnreadableImages, log_unreadable
from build_utils.errors import CheckpointError, ConfigError
from models.darknet import Darknet
from train_utils.checkpoint import WeightsFile, read_weights
from train_utils.cli import (
    DEFAULT_EVAL_CONF,
    DEFAULT_EVAL_IOU,
    DEFAULT_IMG_SIZE,
    DEFAULT_RUN_NAME,
    HelpFormatter,
    add_augment_flag,
    add_data_flags,
    add_device_flags,
    add_eval_flags,
    add_img_size_flag,
    add_local_rank_flag,
    add_model_flag,
    add_precision_flags,
    add_project_flags,
    add_weights_flags,
    check_choices,
    check_environment,
    check_img_size,
    first_free_folder,
    project_folder,
    run_script,
    switch,
    take_from_run,
    warn_save_conf_alone,
)
from train_utils.config import TASK_SPLITS, DataConfig, load_data_config
from train_utils.data_loaders import eval_image_ids, make_eval_dataset, make_eval_loader
from train_utils.distributed.node import resolve_workers
from train_utils.distributed.process_group import cleanup, init_distributed_mode
from train_utils.engine import evaluate
from train_utils.evaluation.coco_eval import STAT_NAMES, CocoEvaluator
from train_utils.evaluation.coco_gt import (
    coco_dict_from_dataset,
    get_coco_api_from_dataset,
    ground_truth_from_file,
)
from train_utils.evaluation.detection_files import (
    COCO80_TO_91,
    gt_to_official_coco_ids,
    read_coco_ids,
    resolve_coco_ids,
    to_official_coco_ids,
    write_dataset_txt,
)
from train_utils.evaluation.error_breakdown import ERRORS_FILE, report_errors
from train_utils.evaluation.options import MAX_DET, EvalOptions, eval_options
from train_utils.evaluation.report import REPORT_FILES, write_eval_report
from train_utils.evaluation.speed import measure_speed
from train_utils.load_model import default_img_size, model_from_weights
from train_utils.precision import inference_precision, replay_precision
from train_utils.run_folder import (
    REPLACED_PREFIX,
    check_not_a_run_file,
    move_previous_run,
    run_files_in,
)

logger = logging.getLogger("validation")

DEFAULT_BATCH_SIZE = 8  # for weights that do not record their run's
DEFAULT_SAVE_DIR = "runs/val"  # also the --project of --name alone (runs/val/NAME)
# What a run's checkpoint answers when the flag is not given, and the default otherwise.
RUN_SETTINGS = {
    "data": None,
    "img_size": DEFAULT_IMG_SIZE,
    "batch_size": DEFAULT_BATCH_SIZE,
    "conf_thres": DEFAULT_EVAL_CONF,
    "iou_thres": DEFAULT_EVAL_IOU,
    "single_cls": False,
    "coco_backend": "auto",
}
RUN_HINT = " (default: as the checkpoint's run)"
GT_JSON, PRED_JSON = "ground_truth.json", "predictions.json"  # --save-json's files
SOURCE_STATS_JSON = "source_stats.json"  # --coco-gt's stats, beside them
LABELS_DIR = "labels"  # --save-txt's files, in --save-dir
# What a report writes into --save-dir under fixed names.
REPORT_NAMES = (*REPORT_FILES, ERRORS_FILE, LABELS_DIR)


def _add_evaluation_flags(g: argparse._ArgumentGroup) -> None:
    add_img_size_flag(g, None, "inference size, a multiple of 32" + RUN_HINT)
    g.add_argument(
        "--batch-size",
        "--batch",
        type=int,
        default=None,
        help="images per batch and process" + RUN_HINT,
    )
    add_eval_flags(g, None, None, None, RUN_HINT)
    g.add_argument("--max-det", type=int, default=MAX_DET, help="detections kept per image")
    switch(g, "--multi-label", True, "one detection per class above threshold for each box")
    add_augment_flag(g)
    add_precision_flags(g, None, RUN_HINT, half=True)
    g.add_argument(
        "--task",
        default="val",
        choices=("val", "test", "train", "speed"),
        help="val: COCO mAP, per-class table and pictures of the data's val images; test, "
        "train: the same for that split (YOLOv5's val.py --task); speed: ms per image of "
        "pre-process, inference and NMS on the val images",
    )


def _add_report_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--save-dir",
        default=DEFAULT_SAVE_DIR,
        help="folder for per_class.csv, errors.json, the pictures and --save-txt labels, "
        "used as given, an earlier report there replaced only with --exist-ok (default: "
        f"{DEFAULT_SAVE_DIR}/{DEFAULT_RUN_NAME}, numbered {DEFAULT_RUN_NAME}2, "
        f"{DEFAULT_RUN_NAME}3, ... when it holds files)",
    )
    add_project_flags(g, DEFAULT_SAVE_DIR, "--save-dir")
    g.add_argument(
        "--exist-ok",
        action="store_true",
        help="with --project/--name (or no --save-dir): write into DIR/NAME even when it holds "
        "files, the previous report moved into DIR/NAME/replaced-<time>/; replace an existing "
        "--json-out file, --save-json DIR's JSON files, or a report in --save-dir",
    )
    switch(g, "--plots", True, "draw the confusion matrix, P/R/F1/PR curves and validation images")
    g.add_argument(
        "--save-txt",
        action="store_true",
        help="write SAVE_DIR/labels/<image>.txt: class cx cy w h normalised, one detection a line",
    )
    g.add_argument("--save-conf", action="store_true", help="add the confidence to --save-txt")


def _add_json_flags(g: argparse._ArgumentGroup) -> None:
    switch(
        g,
        "--coco-ids",
        None,
        "--save-json with COCO image/category ids: the source JSON's for a dataset of "
        "tools/coco2yolo.py, else the official ones (default: for such a dataset, or when the "
        "data has 80 classes and numeric image file names)",
    )
    g.add_argument(
        "--save-json",
        nargs="?",
        const=True,  # bare --save-json (YOLOv5's habit): into the report folder
        default=None,
        metavar="DIR",
        help=f"write DIR/{GT_JSON} and DIR/{PRED_JSON} (COCO format; DIR left out: "
        "the report folder, --save-dir or --project/--name; default: none)",
    )
    g.add_argument(
        "--coco-gt",
        default=None,
        metavar="FILE",
        help=f"with --save-json: also score {PRED_JSON} with pycocotools against this COCO "
        "JSON (the file tools/coco2yolo.py converted, or COCO's own), its crowd regions "
        f"ignored as pycocotools does; the 12 stats go to DIR/{SOURCE_STATS_JSON} (default: "
        "none)",
    )
    g.add_argument(
        "--json-out",
        default=None,
        metavar="FILE",
        help="write the 12 COCO stats as JSON with the results.csv names (default: none)",
    )


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("YOLOv3-SPP validation", formatter_class=HelpFormatter)
    g = p.add_argument_group("model and data")
    add_weights_flags(g, required=True, help="checkpoint .pt, state_dict .pt or Darknet .weights")
    add_model_flag(g, None)
    add_data_flags(g, None, single_cls_default=None)
    _add_evaluation_flags(p.add_argument_group("evaluation"))
    output = p.add_argument_group("output")
    _add_report_flags(output)
    _add_json_flags(output)
    add_device_flags(p.add_argument_group("device"), 2, "DataLoader workers per process")
    add_local_rank_flag(p)
    return p


def resolve_settings(args: argparse.Namespace, weights: WeightsFile) -> None:
    """Fill every setting not given from the run that wrote ``weights``, then check them all."""
    run = dict(weights.run)
    data = run.get("data")
    path = data.get("path") if isinstance(data, dict) else None
    run["data"] = path if isinstance(path, str) else None
    # The fallback is a number, so that a recorded img_size of another kind is still refused.
    size = args.img_size if args.img_size is not None else default_img_size(weights, args.cfg)
    take_from_run(args, run, {**RUN_SETTINGS, "img_size": size}, f"--weights {weights.path}")
    check_choices(get_parser(), args)
    if args.data is None:
        raise ConfigError(
            "these weights do not name the dataset they were trained on; pass --data", args.weights
        )
    check_img_size(args.img_size)
    check_at_least({"--batch-size": args.batch_size, "--max-det": args.max_det}, 1)
    check_at_least({"--workers": args.workers}, 0)
    check_fractions({"--conf-thres": args.conf_thres, "--iou-thres": args.iou_thres})
    warn_save_conf_alone(args)


def evaluation_options(
    args: argparse.Namespace, weights: WeightsFile, device: torch.device, is_main: bool
) -> EvalOptions:
    """The options the run's own evaluation used (see :func:`eval_options`), flags on top."""
    amp, channels_last, why = replay_precision(
        weights.precision, weights.run.get("amp"), args.amp, args.channels_last, device
    )
    precision = inference_precision(amp, why, args.half, args.amp, device)
    logger.info("%s", precision.describe(channels_last))
    return eval_options(
        vars(args),
        device,
        precision.autocast,
        channels_last,
        is_main,
        multi_label=args.multi_label,
        max_det=args.max_det,
        single_cls=bool(args.single_cls),
        augment=args.augment,
        dtype=precision.weights,
    )


def build_model(
    args: argparse.Namespace,
    weights: WeightsFile,
    nc: int,
    opts: EvalOptions,
    data_nc: int | None = None,
) -> Darknet:
    """The model of ``weights`` with ``nc`` classes (1 under --single-cls), or under
    --single-cls with the .data's ``data_nc`` classes, on the device and in the dtype and
    memory format of ``opts``, in eval mode."""
    device = opts.device  # where the memory check counts
    try:
        model = model_from_weights(weights, args.cfg, nc, args.img_size, args.batch_size, device)
    except CheckpointError:
        if not args.single_cls or data_nc == nc:
            raise
        # --single-cls on a model of the data's classes: YOLOv5 scores it as one class (see
        # EvalOptions.single_cls) instead of refusing; a model trained with --single-cls has
        # one class and was built above.
        model = model_from_weights(
            weights, args.cfg, data_nc, args.img_size, args.batch_size, device
        )
        logger.info("--single-cls: the model's %d classes are scored as one class", model.nc)
    model.to(device, opts.dtype).eval()
    if opts.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def json_ids(
    args: argparse.Namespace, data: DataConfig, img_files: Sequence[str], gt_ids: list[int] | None
) -> tuple[Sequence[int] | Mapping[int, int], Sequence[int], str] | None:
    """How --save-json rewrites the evaluation's (image id, class) pairs: the image id map, the
    category id of each class and what they are, for the log; None to keep them.

    A dataset of ``tools/coco2yolo.py`` is scored with its source image ids (``gt_ids``): they
    stay, and classes become the source category ids (except under --single-cls, which merges
    them); --no-coco-ids turns both back into dataset index and class. Other data: official
    COCO ids where :func:`resolve_coco_ids` finds COCO itself."""
    if gt_ids is not None:
        if args.coco_ids is False:
            return {i: k for k, i in enumerate(gt_ids)}, range(data.nc), "dataset index and class"
        same = {i: i for i in gt_ids}
        if args.single_cls:
            return same, range(data.nc), "the source COCO JSON's image ids and class"
        categories = read_coco_ids(data.coco_ids).category_ids
        if len(categories) != data.nc:
            raise ConfigError(
                f"the id map has {len(categories)} categories, the data {data.nc} classes",
                data.coco_ids,
            )
        return same, categories, f"the ids of the COCO JSON {data.coco_ids} maps to"
    image_ids = resolve_coco_ids(args.coco_ids, data.nc, img_files)
    if image_ids is None:
        return None
    return image_ids, COCO80_TO_91, "official COCO"


def read_source_gt(
    args: argparse.Namespace, img_files: Sequence[str], gt_ids: list[int] | None, coco_ids: Any
) -> Any:
    """--coco-gt's images of the data (``img_files``; ids as --save-json writes them, see
    :func:`json_ids`), read and checked before the evaluation: a wrong file costs no inference
    and writes nothing."""
    if coco_ids is None:
        raise ConfigError(
            "--coco-gt scores predictions with the ids of a COCO JSON: it needs "
            "--save-json on data with such ids (a dataset of tools/coco2yolo.py, or COCO)"
        )
    image_ids, category_ids, _ = coco_ids
    indices = range(len(img_files)) if gt_ids is None else gt_ids
    ids = [image_ids[i] for i in indices]
    return ground_truth_from_file(args.coco_gt, ids, category_ids, img_files)


def score_against_file(
    args: argparse.Namespace, source: Any, detections: list[dict], out: Path
) -> None:
    """--coco-gt: pycocotools' 12 stats of ``detections`` (the file's ids) against ``source``
    (:func:`read_source_gt`), crowd regions included; logged and written to
    ``out/source_stats.json``."""
    evaluator = CocoEvaluator(source, backend=args.coco_backend)
    evaluator.update(detections)
    stats = evaluator.evaluate()
    logger.info(
        "against %s (%d images; crowd regions ignored, as pycocotools does)\n%s",
        args.coco_gt,
        len(source.getImgIds()),
        format_report(stats),
    )
    text = json.dumps({k: float(v) for k, v in zip(STAT_NAMES, stats)}, indent=2)
    write_text(out / SOURCE_STATS_JSON, text, "--save-json")


def format_report(stats: Sequence[float]) -> str:
    """The 12 COCO stats as text (the per-class table is logged by ``write_eval_report``)."""
    return "\n".join(f"{name:>12s} {value:.4f}" for name, value in zip(STAT_NAMES, stats))


def report_place(args: argparse.Namespace) -> Path | None:
    """``--project/--name``'s folder, numbered at the end (YOLOv5's ``runs/val/exp`` when no
    folder is named at all, so that a second validation neither writes over the first's report
    nor mixes its labels/ in); None: ``--save-dir``, used as given."""
    requested = project_folder(args, "--save-dir", DEFAULT_SAVE_DIR)
    if requested is None and "save_dir" not in getattr(args, "given", ()):
        requested = Path(DEFAULT_SAVE_DIR) / DEFAULT_RUN_NAME
    return requested


def _refuse_a_run_folder(folder: str | Path, flag: str) -> None:
    """A report never writes into a training run's folder (nor an --evolve search's)."""
    found = run_files_in(Path(folder)) if Path(folder).is_dir() else []
    if found:
        raise ConfigError(
            f"{flag} {folder} holds a training run or search ({', '.join(found)}), which a "
            f"report never writes into: choose another {flag}"
        )


def json_folder(args: argparse.Namespace, requested: Path | None) -> Path | None:
    """--save-json's folder when it is known before the evaluation (a bare --save-json goes
    into the report folder, numbered only then under --project/--name); None otherwise."""
    if args.save_json is True:
        return Path(args.save_dir) if requested is None else None
    return None if args.save_json is None else Path(args.save_json)


def json_files(args: argparse.Namespace, requested: Path | None) -> dict[Path, str]:
    """The JSON files this validation writes, when known before the evaluation -> the flag.

    Raises:
        ConfigError: --json-out is one of --save-json's files.
    """
    files = {}
    folder = json_folder(args, requested)
    if folder is not None:
        names = [GT_JSON, PRED_JSON, *([SOURCE_STATS_JSON] if args.coco_gt else [])]
        files.update({folder / name: "--save-json" for name in names})
    if args.json_out:
        # Was: --json-out onto predictions.json replaced the predictions without a word.
        saved = {f"--save-json's {path.name}": path for path in files}
        check_apart({**saved, "--json-out": args.json_out}, (), "")
        files[Path(args.json_out)] = "--json-out"
    return files


def files_read(args: argparse.Namespace, data: DataConfig | None = None) -> dict[str, Any]:
    """The files this validation reads, as messages name them -> path (None: not given):
    before the weights are read, those on the command line; with ``data``, every one."""
    reads = {
        "the --weights file": args.weights,
        "the --cfg file": args.cfg,
        "the --data file": args.data if data is None else data.path,
        "the --coco-gt file": args.coco_gt,
    }
    for key, path in data.files if data is not None else ():
        what = f"the '{key}' file of {data.path}"
        reads[f"{what} ({path})" if what in reads else what] = path
    return reads


def check_outputs(args: argparse.Namespace, requested: Path | None) -> None:
    """Before the weights are read: a place no write could use, a file that exists (without
    --exist-ok), a training run's folder or file, and an --exist-ok that would move a training
    run aside. What the data name is checked once they are read (:func:`check_not_over_inputs`)."""
    if requested is None:
        check_output_place(args.save_dir, "--save-dir", folder=True)
        _refuse_a_run_folder(args.save_dir, "--save-dir")
        # Used as given, but a report there (or a user's files of the same names) is not
        # replaced unasked (was: per_class.csv and errors.json written over without a word).
        reports = [Path(args.save_dir) / name for name in REPORT_NAMES]
        check_new_outputs(reports, "--save-dir", args.exist_ok)
    elif args.exist_ok and requested.is_dir() and (found := run_files_in(requested)):
        raise ConfigError(
            f"--exist-ok would move the previous report in {requested} aside, and it holds a "
            f"training run ({', '.join(found)}): choose another --name for the report"
        )
    folder = json_folder(args, requested)
    if folder is not None:
        check_output_place(folder, "--save-json", folder=True)
        _refuse_a_run_folder(folder, "--save-json")
    if args.json_out:
        json_out = Path(args.json_out)
        # Suggested beside the run's folder: a report never writes into one.
        run = json_out.absolute().parent
        check_not_a_run_file(json_out, "--json-out", run.parent / f"{run.name}-stats.json")
    for path, flag in json_files(args, requested).items():
        check_output_place(path, flag)
        check_new_outputs([path], flag, args.exist_ok, files_read(args))


def check_not_over_inputs(
    args: argparse.Namespace, requested: Path | None, data: DataConfig, dataset: Any
) -> None:
    """Once the data are read, before the evaluation (on every rank): no output is a file this
    tool reads (the weights, cfg, dataset file and every file it names, --coco-gt's file) or
    lies among the images and labels it scores, and the report folder neither is, lies inside
    nor holds them (nor, when --exist-ok would move what it holds aside, a file read)."""
    reads = files_read(args, data)
    scored = {
        **{f"the images scored in {d}": d for d in {Path(f).parent for f in dataset.img_files}},
        **{f"the labels scored in {d}": d for d in {Path(f).parent for f in dataset.label_files}},
    }
    for path, flag in json_files(args, requested).items():
        check_not_an_input(path, flag, reads)
        check_apart({flag: path}, scored.values(), "the images or labels scored in")
    # Files read that a write could replace: in labels/ (--save-txt), or in a report folder
    # whose previous contents --exist-ok moves aside.
    at_risk = {f"{what} {path}": path for what, path in reads.items() if path is not None}
    if requested is None:
        flag, folders = "--save-dir", [Path(args.save_dir)]
        for name in REPORT_NAMES:
            check_not_an_input(folders[0] / name, flag, reads)
        if args.save_txt:
            check_not_over_sources(folders[0] / LABELS_DIR, flag, at_risk, (), "--save-txt")
    else:
        flag, folders = "--project/--name", [requested, first_free_folder(requested, args.exist_ok)]
        if args.exist_ok:
            scored.update(at_risk)
    scored_files = [*dataset.img_files, *dataset.label_files]
    for folder in dict.fromkeys(folders):
        check_not_over_sources(folder, flag, scored, scored_files, "the report", "a file scored")


@dataclass
class Evaluation:
    """What one validation evaluates: the data, options, model and loader, the COCO ground
    truth (rank 0), the ids --save-json writes (see :func:`json_ids`) and --coco-gt's ground
    truth."""

    data: DataConfig
    opts: EvalOptions
    model: Darknet
    dataset: Any
    loader: Any
    gt_ids: list[int] | None
    coco_ids: Any
    coco_gt: Any
    source_gt: Any


def prepare(
    args: argparse.Namespace, weights: WeightsFile, dist: Any, requested: Path | None
) -> Evaluation:
    device = dist.device
    splits = [TASK_SPLITS[args.task]]  # a file of val alone is scored; test only when asked
    data = load_data_config(args.data, args.single_cls, splits)
    opts = evaluation_options(args, weights, device, dist.is_main)
    data_nc = load_data_config(args.data, splits=splits).nc if args.single_cls else data.nc
    dataset = make_eval_dataset(
        getattr(data, splits[0]),
        args.img_size,
        args.batch_size,
        data.nc,
        args.single_cls,
        dist.rank,
    )
    check_not_over_inputs(args, requested, data, dataset)
    if args.batch_size > len(dataset):
        # As YOLOv5: one batch holds every image either way (the same rect shape, the same
        # scores), and the model's memory check is then made for the images there are.
        logger.info(
            "--batch-size %d: the dataset has %d images; batch %d",
            args.batch_size,
            len(dataset),
            len(dataset),
        )
        args.batch_size = len(dataset)
    model = build_model(args, weights, data.nc, opts, data_nc)
    gt_ids = eval_image_ids(data, dataset.img_files)
    coco_ids = json_ids(args, data, dataset.img_files, gt_ids) if args.save_json else None
    source_gt = None
    if args.coco_gt:  # on every rank: a refusal on rank 0 alone would leave the others waiting
        source_gt = read_source_gt(args, dataset.img_files, gt_ids, coco_ids)
    workers = resolve_workers(args.workers)
    loader = make_eval_loader(
        dataset, args.batch_size, dist.world_size, dist.rank, workers, device.type == "cuda"
    )
    coco_gt = None
    if dist.is_main:
        coco_gt = get_coco_api_from_dataset(dataset, num_classes=data.nc, image_ids=gt_ids)
    return Evaluation(data, opts, model, dataset, loader, gt_ids, coco_ids, coco_gt, source_gt)


def report_speed(args: argparse.Namespace, ev: Evaluation, is_main: bool) -> None:
    speed = measure_speed(ev.model, ev.loader, ev.opts)
    if is_main:
        logger.info(
            "%s; weights %s, img %d%s",
            speed.format(),
            args.weights,
            args.img_size,
            # The setting beside the number: --augment runs three passes.
            ", test-time augmentation" if args.augment else "",
        )


def report_folder(args: argparse.Namespace, requested: Path | None) -> tuple[Path, str]:
    """The folder the report goes to and the flag that chose it: ``--save-dir`` as given, else
    ``--project/--name``'s numbered folder (YOLOv5's); with --exist-ok its previous report is
    first moved into ``replaced-<time>/``, as train.py moves a previous run."""
    if requested is None:
        return Path(args.save_dir), "--save-dir"
    save_dir = first_free_folder(requested, args.exist_ok)
    previous = save_dir.is_dir() and any(
        not p.name.startswith(REPLACED_PREFIX) for p in save_dir.iterdir()
    )
    if args.exist_ok and previous:
        try:
            moved = move_previous_run(save_dir)
        except OSError as e:
            raise ConfigError(
                f"--exist-ok: cannot move the previous report aside: {e.strerror or e}", save_dir
            ) from e
        logger.info("--exist-ok: the previous report in %s was moved to %s", save_dir, moved)
    logger.info("writing the report to %s", save_dir)
    return save_dir, "--project/--name"


def write_coco_json(
    args: argparse.Namespace, ev: Evaluation, detections: list[dict], save_dir: Path
) -> None:
    """--save-json: the ground truth and the detections as COCO JSON (with --coco-gt, scored
    against that file too)."""
    out = make_output_dir(save_dir if args.save_json is True else args.save_json, "--save-json")
    gt = coco_dict_from_dataset(ev.dataset, ev.data.nc, ev.gt_ids)
    id_source = "dataset index and class"
    if ev.coco_ids is not None:
        image_ids, category_ids, id_source = ev.coco_ids
        gt = gt_to_official_coco_ids(gt, image_ids, ev.data.names, category_ids)
        detections = to_official_coco_ids(detections, image_ids, category_ids)
    write_text(out / GT_JSON, json.dumps(gt), "--save-json")
    write_text(out / PRED_JSON, json.dumps(detections), "--save-json")
    logger.info("wrote %s and %s (%s ids)", out / GT_JSON, out / PRED_JSON, id_source)
    if ev.source_gt is not None:
        score_against_file(args, ev.source_gt, detections, out)


def score_and_report(
    args: argparse.Namespace, ev: Evaluation, dist: Any, requested: Path | None
) -> None:
    # Images deleted or damaged since the dataset was checked are scored as blank.
    watched = UnreadableImages(ev.loader)
    stats, per_class, detections = evaluate(ev.model, watched, ev.coco_gt, ev.opts)
    log_unreadable(None, "val", watched.take(), dist.rank if dist.distributed else None)
    if not dist.is_main:
        return
    logger.info(
        "%d %s images, conf %.3g, NMS IoU %.2f, img %d%s, weights %s, scored by %s\n%s",
        len(ev.dataset),
        args.task,
        args.conf_thres,
        args.iou_thres,
        args.img_size,
        ", test-time augmentation" if args.augment else "",
        args.weights,
        ev.opts.backend,
        format_report(stats),
    )
    save_dir, flag = report_folder(args, requested)
    write_eval_report(save_dir, ev.coco_gt, detections, ev.data.names, per_class, args.plots, flag)
    report_errors(save_dir, ev.coco_gt, detections, flag)
    if args.save_txt:
        n = write_dataset_txt(save_dir / LABELS_DIR, ev.coco_gt, detections, args.save_conf, flag)
        logger.info("wrote %d label files in %s", n, save_dir / LABELS_DIR)
    if args.save_json:
        write_coco_json(args, ev, detections, save_dir)
    if args.json_out:
        json_out = Path(args.json_out)
        make_output_dir(json_out.parent, "--json-out")
        stats_by_name = {k: float(v) for k, v in zip(STAT_NAMES, stats)}
        write_text(json_out, json.dumps(stats_by_name, indent=2), "--json-out")


def validate(args: argparse.Namespace) -> None:
    # A bad YOLO_THREADS or limit is reported before anything is loaded (as train.py does).
    check_environment()
    requested = report_place(args)
    # A place that no write could use is one line now, not after the evaluation.
    check_outputs(args, requested)
    weights = read_weights(args.weights, trust=args.trust_checkpoint)
    resolve_settings(args, weights)
    dist = init_distributed_mode(args)
    try:
        ev = prepare(args, weights, dist, requested)
        if args.task == "speed":
            report_speed(args, ev, dist.is_main)
        else:
            score_and_report(args, ev, dist, requested)
    finally:
        cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(get_parser(), validate, argv)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
