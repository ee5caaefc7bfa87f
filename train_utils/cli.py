"""The command-line layer every script shares: flag groups defined once, their value checks, a
run's own settings (from its checkpoint) as defaults, console logging, and user errors as one line.

``train.py``, ``train_multi_GPU.py``, ``validation.py``, ``predict.py`` and the tools build their
parsers from the same ``add_*`` groups, so a flag has one spelling, one meaning and one check
everywhere (``--amp`` is the same five-way choice in every script). Inference scripts declare
the flags a checkpoint can answer with ``default=None``; :func:`take_from_run` then fills them
from the run that wrote the checkpoint, and says so when a flag overrides the run's value.

A :class:`YoloError` (bad cfg, .data, hyp, flag, weights or dataset) becomes ``error: <message>``
on stderr with exit status 2; Ctrl-C exits with 130 after the trainer saved what it could.
Anything else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from build_utils.augmentations import GRID  # every input side must be a multiple of it
from build_utils.checks import check_choice, check_number, shown
from build_utils.errors import ConfigError, RankFailed, RunStopped, YoloError
from build_utils.limits import MAX_IMG_SIZE, check_limit_settings, positive_env_int
from models.budget import MEMORY_ENV
from train_utils.precision import AMP_CHOICES
from train_utils.threads import fixed_thread_count

logger = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
# sysexits' EX_TEMPFAIL ("try again later"): stopped on request, resumable; an sbatch script
# requeues the job on it (README "Clusters").
EXIT_STOPPED = 75
DEFAULT_IMG_SIZE = 512
DEFAULT_EVAL_CONF = 0.001  # COCO evaluation keeps low-confidence boxes (they raise recall)
DEFAULT_EVAL_IOU = 0.6
# auto: faster-coco-eval where installed, else pycocotools (the same numbers; coco_eval.py).
COCO_BACKENDS = ("auto", "pycocotools", "faster-coco-eval")
DEFAULT_RUN_NAME = "exp"  # the folder name under --project when no --name is given (YOLOv5's)
ArgGroup = argparse.ArgumentParser | argparse._ArgumentGroup


def setup_console_logging(level: int = logging.INFO) -> None:
    """INFO lines on stderr with the time; tqdm bars share the same stream."""
    root = logging.getLogger()
    if not any(getattr(h, "_yolo_console", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handler._yolo_console = True
        root.addHandler(handler)
    root.setLevel(level)


def run_script(
    parser: argparse.ArgumentParser,
    command: Callable[[argparse.Namespace], int | None],
    argv: Sequence[str] | None = None,
) -> int:
    """Every script's ``main``: parse ``argv`` with ``parser`` (``args.given`` names the flags
    typed, see :func:`parse_args`), log to the console and run ``command(args)``. Its exit status
    is returned; a user error is one line and status 2, Ctrl-C 130, a requested stop
    (:class:`RunStopped`, SIGUSR1) 75, and a rank that died (:class:`RankFailed`) one line and
    status 1."""
    args = parse_args(parser, argv)
    setup_console_logging()
    try:
        return command(args) or 0
    except YoloError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RunStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    except RankFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that shows each default once: appended as ``(default: X)`` only when the help
    does not already say what the default is, and never for None (a flag whose None means "from
    the checkpoint" or "auto" says so in its help) or an off switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if (
            "default" in help
            or "%(default)" in help
            or default is None
            or default is argparse.SUPPRESS
            or default is False
            # A switch that turns something off (--nosave): "(default: True)" reads as on.
            or (isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool))
            or default == ""
            or action.option_strings == []  # positionals: no default to speak of
        ):
            return help
        return help + " (default: %(default)s)"


# ---- flag groups ----------------------------------------------------------------------------


def path_arg(text: str) -> Path:
    """argparse ``type=`` of a file or folder flag: an empty string (an unset shell variable)
    is refused rather than read as the current folder, whose files a tool would then write
    among or over."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a file or folder")
    return Path(text)


def switch(group: ArgGroup, flag: str, default: bool | None, help: str) -> None:
    """``--flag`` / ``--no-flag`` (never ``type=bool``, with which ``--flag False`` is true)."""
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_weights_flags(g: ArgGroup, required: bool, help: str) -> None:
    """``--weights`` and ``--trust-checkpoint``."""
    g.add_argument("--weights", required=required, default="", help=help)
    trust_help = "allow full-pickle checkpoint loading (only for files you trust)"
    g.add_argument("--trust-checkpoint", action="store_true", help=trust_help)


def add_model_flag(g: ArgGroup, default: str | None) -> None:
    """``--cfg``; inference scripts pass None: the cfg the checkpoint carries."""
    why = "model .cfg file" + ("" if default else " (default: the one the checkpoint carries)")
    g.add_argument("--cfg", default=default, help=why)


def add_data_flags(g: ArgGroup, default: str | None, single_cls_default: bool | None) -> None:
    """``--data`` and ``--single-cls``; None defaults come from the checkpoint's run."""
    why = (
        "dataset file: a Darknet .data or an ultralytics data.yaml (.yaml/.yml; its 'path' is "
        "taken relative to the yaml's folder, else to the current folder)"
    )
    why += "" if default else " (default: the checkpoint's run's)"
    g.add_argument("--data", default=default, help=why)
    single = "treat every class as one ('object')"
    if single_cls_default is None:
        single += " (default: as the checkpoint's run)"
    switch(g, "--single-cls", single_cls_default, single)


def add_img_size_flag(g: ArgGroup, default: int | None, help: str) -> None:
    """``--img-size`` with YOLOv5's spellings ``--imgsz`` and ``--img``."""
    g.add_argument(
        "--img-size", "--imgsz", "--img", dest="img_size", type=int, default=default, help=help
    )


def add_project_flags(g: ArgGroup, project_default: str, folder_flag: str) -> None:
    """YOLOv5's ``--project DIR --name NAME`` for a script whose output folder is
    ``folder_flag`` (``--save-dir``, ``--output``): the folder ``DIR/NAME``, numbered
    ``NAME2``, ``NAME3``, ... when it holds files (see :func:`project_folder`,
    :func:`first_free_folder`)."""
    g.add_argument(
        "--project",
        default=None,
        type=path_arg,
        metavar="DIR",
        help=f"write into DIR/NAME instead of {folder_flag}, numbered NAME2, NAME3, ... when "
        f"it holds files (default DIR: {project_default} when only --name is given)",
    )
    g.add_argument(
        "--name",
        default=None,
        type=path_arg,
        help=f"the folder's name under --project (default: {DEFAULT_RUN_NAME})",
    )


def project_folder(args: argparse.Namespace, folder_flag: str, project_default: str) -> Path | None:
    """``DIR/NAME`` of :func:`add_project_flags` (``project_default/exp`` for the one not
    given); None when neither was given. ``folder_flag`` typed as well is refused: it names the
    folder itself, and two answers to one question would leave one of them ignored."""
    if args.project is None and args.name is None:
        return None
    if folder_flag.lstrip("-").replace("-", "_") in getattr(args, "given", ()):
        raise ConfigError(
            f"{folder_flag} is the output folder itself, --project/--name its parent and name: "
            f"give one or the other"
        )
    name = None if args.name is None else str(args.name)
    return run_name_folder(Path(args.project or project_default), name)


def run_name_folder(parent: Path, name: str | None) -> Path:
    """``parent/name`` for ``--project``/``--name`` (``exp`` when ``name`` is empty). A name may
    hold sub-folders (``a/b``) but not leave ``parent``: an absolute name or one with ``..``
    would write the run beside the user's own files, outside the folder they chose.

    Raises:
        ConfigError: ``name`` is absolute, ``.``, or climbs out with ``..``.
    """
    name = name or DEFAULT_RUN_NAME
    path = Path(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ConfigError(
            f"--name {name!r} would leave --project ({parent}): give a folder name inside it, "
            "or the folder itself with --output-dir/--save-dir/--output"
        )
    return parent / path


def first_free_folder(requested: Path, exist_ok: bool) -> Path:
    """``requested``, or when it already holds files and not ``exist_ok``, the first of
    ``requested2``, ``requested3``, ... that is new or empty (YOLOv5's ``increment_path``), so
    that an earlier run's outputs are never written over or mixed with this one's. A file where
    the folder should be is returned as it is: the write that follows reports it."""
    out, n = requested, 1
    while out.is_dir() and not exist_ok and any(out.iterdir()):
        n += 1
        out = requested.with_name(f"{requested.name}{n}")
    return out


def add_eval_flags(
    g: ArgGroup, conf: float | None, iou: float | None, backend: str | None, run_hint: str = ""
) -> None:
    """NMS thresholds of an evaluation and the COCO scoring library; ``run_hint`` says where
    a None default comes from."""
    g.add_argument("--conf-thres", type=float, default=conf, help="confidence threshold" + run_hint)
    g.add_argument("--iou-thres", type=float, default=iou, help="NMS IoU threshold" + run_hint)
    g.add_argument(
        "--coco-backend",
        default=backend,
        choices=COCO_BACKENDS,
        help="COCO scoring library; auto: faster-coco-eval where installed, else pycocotools "
        "(the same 12 numbers)" + run_hint,
    )


def add_augment_flag(g: ArgGroup) -> None:
    """``--augment``: test-time augmentation (``models.tta``) of predict.py and validation.py."""
    g.add_argument(
        "--augment",
        action="store_true",
        help="test-time augmentation: also infer at scales 0.83 (flipped left-right) and 0.67, "
        "all boxes into one NMS (about 2x the inference time)",
    )


AMP_HELP = (
    "mixed precision. auto: on for CUDA (bf16 where the GPU has it, else fp16); on a CPU bf16 "
    "only where the CPU has bf16 arithmetic and bf16 trains clearly faster, else fp32; "
    "--amp alone or bf16: bf16 autocast on a CPU too (fp32, with a warning, where oneDNN has no "
    "bf16 kernels); fp16 (CUDA) or off to choose"
)


def add_precision_flags(
    g: ArgGroup, amp_default: str | None, run_hint: str = "", half: bool = False
) -> None:
    """``--amp`` (one meaning in every script) and ``--channels-last``; with ``half``, the
    inference scripts' ``--half`` (:func:`~train_utils.precision.inference_precision`)."""
    if half:
        g.add_argument(
            "--half",
            action="store_true",
            help="fp16 weights and inputs (CUDA only), instead of the run's autocast; --amp is "
            "autocast",
        )
    g.add_argument(
        "--amp",
        nargs="?",
        const="on",
        default=amp_default,
        choices=AMP_CHOICES,
        help=AMP_HELP + run_hint,
    )
    # One default per help: a checkpoint's run decides first where there is one.
    device_rule = "on CUDA; on CPU the faster for this model, timed"
    switch(
        g,
        "--channels-last",
        None,
        "channels_last memory format "
        + (f"{run_hint[:-1]}; else {device_rule})" if run_hint else f"(default: {device_rule})"),
    )


def add_device_flags(
    g: ArgGroup, workers_default: int | None = None, workers_help: str | None = None
) -> None:
    """``--device``, and ``--workers`` when ``workers_help`` is given."""
    g.add_argument(
        "--device",
        default="",
        help="cpu, cuda, cuda:N or N (default: cuda if available); a GPU list such as 0,1 "
        "starts one DDP process per listed GPU on this node (training)",
    )
    if workers_help is not None:
        g.add_argument("--workers", type=int, default=workers_default, help=workers_help)


def add_local_rank_flag(p: argparse.ArgumentParser) -> None:
    """The local rank that old ``torch.distributed.launch`` passes as ``--local_rank`` or
    ``--local-rank`` (torchrun sets ``LOCAL_RANK`` instead)."""
    p.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=-1,
        help=argparse.SUPPRESS,
    )


# ---- checks ---------------------------------------------------------------------------------


def check_img_size(size: int, flag: str = "--img-size") -> int:
    """``size`` when it is a positive multiple of :data:`GRID` no larger than the limit
    :data:`~build_utils.limits.MAX_IMG_SIZE` (``$YOLO_MAX_IMG_SIZE`` raises it): checked before
    the size reaches a model or a loader, where 65536 px would allocate a 12 GB batch first."""
    check_img_size_limit(size, flag)
    if size <= 0 or size % GRID:
        fix = max(GRID, round(size / GRID) * GRID)
        raise ConfigError(f"{flag} {size} is not a positive multiple of {GRID}; use e.g. {fix}")
    return size


def check_img_size_limit(size: int, flag: str = "--img-size") -> int:
    """``size`` when it is a whole number no larger than the limit (for sizes that need not be
    multiples of :data:`GRID`, such as the label scale of ``tools/kmeans_anchors.py``)."""
    check_number(flag, size, int)
    limit = MAX_IMG_SIZE.value()
    if size > limit:
        raise ConfigError(
            f"{flag} {shown(size)} is larger than the limit {limit} ({MAX_IMG_SIZE.name}); "
            f"set {MAX_IMG_SIZE.env} to raise it"
        )
    return size


def check_environment() -> None:
    """The environment variables the scripts read (YOLO_THREADS, the YOLO_MAX_* limits,
    YOLO_MEMORY_AVAILABLE), checked now: a malformed one is one line before anything is loaded,
    spawned or written, not at the first image it limits, beside a run's first files.

    Raises:
        ConfigError: the first malformed variable.
    """
    fixed_thread_count(os.environ)
    check_limit_settings()
    positive_env_int(MEMORY_ENV, "bytes")


def warn_save_conf_alone(args: argparse.Namespace) -> None:
    """One warning line for ``--save-conf`` without ``--save-txt``, which it only adds to
    (YOLOv5 ignores it silently)."""
    if args.save_conf and not args.save_txt:
        logger.warning("--save-conf adds the confidence to --save-txt's labels; ignored without it")


def check_time_budget(minutes: float | None) -> None:
    """``--time-budget`` (None: not set) is a positive number of minutes, finite in seconds too
    (1e308 minutes is inf seconds)."""
    if minutes is not None and not 0 < minutes * 60.0 < math.inf:
        raise ConfigError(
            f"--time-budget must be a positive, finite number of minutes, got {minutes}"
        )


def check_choices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every value with a fixed set of choices is one of them: argparse checks what was typed,
    this also what :func:`take_from_run` took from a checkpoint."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices is None or value is None:
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        # A flag taking several values (nargs) is checked value by value.
        for one in value if isinstance(value, list) else [value]:
            check_choice(flag, one, action.choices)


# ---- which flags the user typed, and a run's settings as defaults -----------------------------


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> frozenset[str]:
    """The ``dest`` of every option the command line names (whatever its value), so that a
    run's own settings can fill the others. Parses ``argv`` again with no defaults."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    namespace, _ = probe.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return frozenset(vars(namespace))


# Darknet's single-dash flags (`darknet detector train ... -map -dont_show`), what each is here.
DARKNET_FLAGS = {
    "-map": "evaluation runs without it (--recipe darknet: every --eval-iterations, by default "
    "Darknet's -map rule)",
    "-dont_show": "no window is ever shown; drop it",
    "-clear": "--clear",
    "-gpus": "--device (e.g. --device 0,1)",
    "-thresh": "--conf-thres",
    "-iou_thresh": "--iou-thres",
    "-ext_output": "drop it: predict.py prints each box in pixels",
    "-letter_box": "drop it: images are always letterboxed",
}


def _darknet_flag(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The first of Darknet's flags (see :data:`DARKNET_FLAGS`) in ``argv`` that ``parser`` does
    not define, with what to type instead."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in DARKNET_FLAGS and flag not in parser._option_string_actions:
            return f"{flag} is Darknet's flag; here: {DARKNET_FLAGS[flag]}"
    return None


def _errors_in_one_line(parser: argparse.ArgumentParser) -> None:
    """argparse's errors as one line, exit status 2, with the flag meant for a mistyped one
    (was: the whole usage first, 34 lines for train.py, and no suggestion)."""

    def error(message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments:"):
            typed = [a.split("=")[0] for a in message.split(":", 1)[1].split() if a[:1] == "-"]
            flags = parser._option_string_actions
            near = [difflib.get_close_matches(a, flags, 1, cutoff=0.8) for a in typed]
            meant = [
                f"{m[0]} for {a}" if len(typed) > 1 else m[0] for a, m in zip(typed, near) if m
            ]
            hint = f" (did you mean {', '.join(meant)}?)" if meant else " (--help lists the flags)"
        parser.exit(EXIT_USER_ERROR, f"{parser.prog}: error: {message}{hint}\n")

    parser.error = error  # type: ignore[method-assign]


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``given``: the flags the user typed (see
    :func:`given_flags`). Darknet's flags get a line naming this project's instead of argparse's
    bare "unrecognized arguments"."""
    _errors_in_one_line(parser)
    darknet = _darknet_flag(parser, sys.argv[1:] if argv is None else argv)
    if darknet is not None:
        parser.error(darknet)
    args = parser.parse_args(argv)
    args.given = given_flags(parser, argv)
    return args


def _same_kind(saved: Any, like: Any) -> bool:
    """Whether a value recorded in a checkpoint can stand for a flag whose value looks like
    ``like`` (None: any plain scalar; later checks judge the value)."""
    if like is None:
        return isinstance(saved, (bool, int, float, str))
    if isinstance(like, bool) or isinstance(saved, bool):
        return isinstance(saved, bool) and isinstance(like, bool)
    if isinstance(like, (int, float)):
        return isinstance(saved, (int, float)) and (
            isinstance(like, float) or isinstance(saved, int)
        )
    return isinstance(saved, type(like))


def take_from_run(
    args: argparse.Namespace,
    run: Mapping[str, Any],
    fields: Mapping[str, Any],
    source: str,
) -> list[str]:
    """Fill each flag in ``fields`` (dest -> fallback) the user did not give from ``run`` (the
    checkpoint's run settings), else from its fallback; log flags that override the run.

    A flag counts as given when it is in ``args.given`` (see :func:`parse_args`) or, without
    it, when its value is not None. Returns the dests taken from the run.
    """
    given = getattr(args, "given", None)
    taken, overridden = [], []
    for dest, fallback in fields.items():
        value = getattr(args, dest, None)
        typed = dest in given if given is not None else value is not None
        saved = run.get(dest)
        if saved is not None and not _same_kind(saved, fallback if fallback is not None else value):
            logger.warning("%s: ignoring the run's %s=%r (not a valid value)", source, dest, saved)
            saved = None
        if typed:
            if saved is not None and saved != value:
                overridden.append(f"--{dest.replace('_', '-')} {value} (the run had {saved})")
            continue
        if saved is not None:
            setattr(args, dest, saved)
            taken.append(dest)
        else:
            setattr(args, dest, fallback)
    if overridden:
        logger.info("%s: the command line overrides %s", source, ", ".join(overridden))
    return taken
