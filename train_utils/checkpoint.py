"""Checkpoint files, the one place that reads and writes ``.pt``: atomic save, safe load, the
schema shared by train, resume, ``validation.py``, ``predict.py`` and the tools, and loading
weights (``.pt`` or Darknet ``.weights``) into a model.

A checkpoint is a dict of tensors and plain Python values, so that
``torch.load(weights_only=True)`` reads it without running code from the file. Keys written by
:func:`train_utils.rounds.run_checkpoint` (schema version :data:`CHECKPOINT_VERSION`):

- ``version`` (int), ``epoch`` (int; the last *finished* epoch, -1 for converted or pretrained
  weights that are not a training state)
- ``model``: state_dict of the unwrapped model (no ``module.`` prefix)
- ``optimizer``, ``scheduler``, ``scaler``: their ``state_dict()`` or None
- ``ema``: EMA model state_dict or None, ``ema_updates`` (int)
- ``best_fitness`` (float or None), ``config`` (plain dict of the resolved run config)
- the run's record and each other part's own state (see that function)

``--resume`` is checked and restored by :mod:`train_utils.resume`; ``--weights``,
``validation.py`` and ``predict.py`` only need a state_dict, found by :func:`extract_state_dict`
and loaded by :func:`load_weights`. ultralytics/yolov3 checkpoints (``{'epoch', 'best_fitness',
'training_results', 'model', 'optimizer'}``) and bare state_dicts load the same way;
:func:`save_weights_pt` writes that layout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import errno
import logging
import math
import re
import shutil
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
from torch import nn

from build_utils.atomic import atomic_write, make_output_dir, reported_write
from build_utils.checks import is_int, is_real, shown
from build_utils.errors import CheckpointError
from build_utils.limits import MAX_WEIGHTS_BYTES, file_problem
from models.weights import DARKNET_VERSION, load_darknet_weights

logger = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1

# Key prefixes added by wrappers: DistributedDataParallel/DataParallel and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

# Where a state_dict may sit inside a checkpoint-like dict, in order of preference.
_STATE_DICT_KEYS = ("model", "state_dict", "ema")
_MAX_NESTING = 3

MAX_LISTED_MISMATCHES = 5  # tensors named in a "does not fit" error, then "and N more"

_PICKLE_PROTO = 0x80  # first byte of a pickle (protocol 2+): a legacy torch.save file


def to_plain(obj: Any) -> Any:
    """``obj`` with numpy values, paths, namespaces and dataclasses turned into plain types.

    ``weights_only=True`` loading refuses numpy scalars (a ``np.float64`` mAP is enough to make
    a checkpoint unloadable), ``Path`` objects and custom classes. Recursion goes through dicts,
    lists and tuples (named tuples become plain tuples); numpy arrays become tensors, numpy
    scalars Python numbers, ``PurePath`` ``str``, ``argparse.Namespace`` and dataclass instances
    dicts, enums their value. Tensors and other values are returned as they are.
    """
    if isinstance(obj, torch.Tensor) or is_state_dict(obj):
        return obj  # a state_dict keeps its ``_metadata`` (module versions)
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return [to_plain(x) for x in obj.tolist()]
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value)
    if isinstance(obj, argparse.Namespace):
        return {k: to_plain(v) for k, v in vars(obj).items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, OrderedDict):
        return OrderedDict((to_plain(k), to_plain(v)) for k, v in obj.items())
    if isinstance(obj, Mapping):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(x) for x in obj)
    return obj


def save_checkpoint(obj: Mapping[str, Any], path: str | Path, flag: str | None = None) -> None:
    """Write ``obj`` to ``path`` atomically: readers see the old file or the new one, never half.

    The dict goes through :func:`to_plain` first, then into a temp file in the same directory
    (same file system, so the rename is atomic), which is flushed and fsynced before
    ``os.replace`` moves it onto ``path``. A crash or a full disk mid-write leaves any previous
    ``path`` intact and removes the temp file. Missing parent directories are created.
    ``flag`` is the option that chose the place, named in the error's fix.

    Raises:
        OutputError: the file cannot be written (disk full, read-only, a file where a folder
            should be, a folder of that name, ...).
    """
    path = Path(path)
    if not isinstance(obj, Mapping):
        raise TypeError(f"a checkpoint must be a dict, got {type(obj).__name__}")
    plain = to_plain(dict(obj))
    make_output_dir(path.parent, flag)
    with reported_write(path, flag):
        try:
            with atomic_write(path, "wb", durable_dir=True) as f:
                torch.save(plain, f)
        except RuntimeError as e:
            raise _torch_write_failure(e) from e
    logger.debug("saved checkpoint %s", path)


def copy_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Copy the checkpoint file ``src`` to ``dst`` byte for byte, atomically as
    :func:`save_checkpoint` writes (``dst`` is the old file or the whole copy, never half).

    Raises:
        CheckpointError: ``src`` cannot be read or ``dst`` cannot be written.
    """
    src, dst = Path(src), Path(dst)
    try:
        with src.open("rb") as f_src, atomic_write(dst, "wb", durable_dir=True) as f_dst:
            shutil.copyfileobj(f_src, f_dst)
    except OSError as e:
        raise CheckpointError(f"cannot copy {src} here: {e.strerror or e}", dst) from e


def _torch_write_failure(e: RuntimeError) -> OSError:
    """The ``OSError`` behind ``torch.save``'s ``RuntimeError``: its zip writer reports a failed
    write of the file object (a full disk) as "unexpected pos" or "file write failed", with
    the file's own ``OSError`` as the context when there was one."""
    if isinstance(e.__context__, OSError):
        return e.__context__
    text = str(e)
    if "unexpected pos" in text or "write failed" in text:
        return OSError(errno.EIO, "the write failed (is the disk full?)")
    raise e


def _numpy_safe_globals() -> list[Any]:
    """Exactly the numpy types ultralytics/yolov3's checkpoints hold (``best_fitness`` as a numpy
    scalar or 1-element array): scalars, arrays and their dtypes, under numpy 2's module names
    and numpy 1's (``numpy.core``), for ``weights_only`` loading. Nothing else is unpickled."""
    from numpy._core import multiarray

    names: list[Any] = [multiarray.scalar, multiarray._reconstruct, np.ndarray, np.dtype]
    names += [
        (multiarray.scalar, "numpy.core.multiarray.scalar"),
        (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    ]
    names += [
        type(np.dtype(t))
        for t in (
            np.float16,
            np.float32,
            np.float64,
            np.int8,
            np.int16,
            np.int32,
            np.int64,
            np.uint8,
            np.bool_,
        )
    ]
    return names


def load_checkpoint(path: str | Path, trust: bool = False) -> dict[str, Any]:
    """Read a checkpoint dict onto the CPU.

    Args:
        path: a ``.pt``/``.pth`` file written by :func:`save_checkpoint` or another trainer.
        trust: load with ``weights_only=False``, which unpickles arbitrary objects and so can run
            code from the file: only for files from a trusted source (``--trust-checkpoint``).

    Returns:
        The dict as saved, tensors on the CPU.

    Raises:
        CheckpointError: missing, truncated or corrupt file, not a dict, or (without ``trust``)
            a file holding Python objects other than tensors and plain types.
    """
    path = Path(path)
    _check_weights_file(path, "checkpoint")
    _check_unpacked_size(path)
    if trust:
        logger.warning(
            "%s: loading with weights_only=False (--trust-checkpoint): this runs code stored in "
            "the file; do it only for files from a trusted source",
            path,
        )
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except MemoryError:
        raise
    except (ModuleNotFoundError, AttributeError) as e:
        if not trust:
            raise CheckpointError(_corrupt_message(e), path) from e
        # Full unpickling needs the classes the writer pickled (e.g. another repository's
        # models.yolo.Model).
        raise CheckpointError(
            f"checkpoint pickles objects from code that is not available here ({e}); save a "
            f"plain state_dict from the project that wrote it and load that instead",
            path,
        ) from e
    except Exception as e:
        # A bad file surfaces as many types (UnpicklingError, the zip reader's RuntimeError,
        # EOFError, struct.error, KeyError for legacy files, ...): all mean "cannot be read".
        # torch words it "Unsupported global: GLOBAL x.y" or, for blocked modules such as
        # os/posix, "unsupported GLOBAL x.y whose module x is blocked".
        found = re.search(
            r"[Uu]nsupported (?:global:\s*)?GLOBAL\s+([\w.]+)|but got <class '([\w.]+)'>", str(e)
        )
        if not trust and found:
            raise CheckpointError(
                f"checkpoint contains Python objects other than tensors and plain types "
                f"({found.group(1) or found.group(2)}), which weights_only loading refuses; pass "
                f"--trust-checkpoint only if the file comes from a trusted source (loading it "
                f"runs code stored in it)",
                path,
            ) from e
        raise CheckpointError(_corrupt_message(e), path) from e
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"not a checkpoint: the file holds a {type(obj).__name__}, expected a dict "
            f"(e.g. {{'model': state_dict, ...}})",
            path,
        )
    if trust:
        return obj
    try:
        # numpy values (ultralytics/yolov3 checkpoints) become Python numbers and tensors.
        return to_plain(obj)
    except RecursionError as e:
        # weights_only unpickling is iterative: a small file can nest lists or dicts 100,000
        # deep, which every recursive walk of the dict (this one first) cannot follow.
        raise CheckpointError(
            "not a checkpoint: its values are nested thousands of levels deep (a checkpoint "
            "holds a dict of tensors and plain values a few levels deep)",
            path,
        ) from e


def _check_unpacked_size(path: Path) -> None:
    """Refuse a zip checkpoint whose members unpack to more than
    :data:`~build_utils.limits.MAX_WEIGHTS_BYTES`: torch.save stores members uncompressed, but
    the zip reader also inflates compressed ones, so a 2 MB file of deflated zeros would become
    a 2 GB tensor in memory before anything could look at it. The central directory is read
    only (its declared sizes; the reader checks each member against its own)."""
    try:
        if not zipfile.is_zipfile(path):
            return  # a legacy pickle: its size on disk is what it holds
        with zipfile.ZipFile(path) as z:
            unpacked = sum(info.file_size for info in z.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # unreadable as a zip: torch.load reports it as a corrupt file
    if unpacked > MAX_WEIGHTS_BYTES.value():
        raise CheckpointError(MAX_WEIGHTS_BYTES.exceeded(unpacked, "unpacks to"), path)


def _check_weights_file(path: Path, what: str) -> None:
    """Stat ``path`` before anything opens it: a regular file within
    :data:`~build_utils.limits.MAX_WEIGHTS_BYTES` (a FIFO would block the open forever, a 40 GB
    sparse file would be read whole by ``torch.load``), else one :class:`CheckpointError`."""
    problem = file_problem(path, MAX_WEIGHTS_BYTES)
    if problem is None:
        return
    if problem == "a folder, not a file":
        problem = f"is a directory, not a {what} file"
    elif problem == "file not found":
        problem = "file not found" if what == "checkpoint" else "weights file not found"
    raise CheckpointError(problem, path)


def _corrupt_message(e: BaseException) -> str:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "weights_only" in detail:
        # torch's advice to load with weights_only=False: unpickling is what must not happen.
        detail = "its contents are not a PyTorch checkpoint's"
    return (
        f"cannot read checkpoint: the file is truncated, corrupt or not a PyTorch checkpoint "
        f"({detail})"
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside a DDP/DataParallel wrapper (or the model itself)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


# ---- the values a training checkpoint records, checked by the part that owns each --------------

# The last epoch a checkpoint may record: ~2,000 years of 1-minute epochs, or the iteration of
# --recipe darknet (Darknet's own cfgs ask for up to 2,000,200).
MAX_EPOCH = 100_000_000


def bad_value(what: str, value: Any) -> str:
    """``what`` and its value as an error line shows it."""
    return f"{what} {shown(value)}"


def damaged(what: str, path: str | Path | None) -> CheckpointError:
    """The error for a checkpoint value that cannot be what it says (a damaged or hand-edited
    file: a checkpoint is input too)."""
    return CheckpointError("the checkpoint is damaged: " + what, path)


def record_int(
    ckpt: Mapping[str, Any], key: str, lo: int, hi: int, path: str | Path | None
) -> int | None:
    """``ckpt[key]``: None (not recorded) or an integer in ``lo..hi``."""
    value = ckpt.get(key)
    if value is not None and (not is_int(value) or not lo <= value <= hi):
        raise damaged(bad_value(key, value) + f" must be in {lo}..{hi}", path)
    return value


def record_real(
    ckpt: Mapping[str, Any], key: str, path: str | Path | None, lo: float = -math.inf
) -> float | None:
    """``ckpt[key]``: None or a finite number of at least ``lo`` (ultralytics/yolov3's numpy scalars
    load as 1-element tensors)."""
    value = ckpt.get(key)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if value is not None and not (is_real(value) and value >= lo):
        what = "a finite number" + ("" if lo == -math.inf else f" >= {lo:g}")
        raise damaged(bad_value(key, value) + f" must be {what}", path)
    return value


def record_of_kind(ckpt: Mapping[str, Any], key: str, kind: type, path: str | Path | None) -> Any:
    """``ckpt[key]``: None or an instance of ``kind``."""
    value = ckpt.get(key)
    if value is not None and not isinstance(value, kind):
        raise damaged(f"'{key}' is a {type(value).__name__}, not a {kind.__name__}", path)
    return value


@contextlib.contextmanager
def state_loading(what: str, path: str | Path | None) -> Iterator[None]:
    """A state that a ``load_state_dict`` cannot take becomes one :class:`CheckpointError`."""
    try:
        yield
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError) as e:
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"the checkpoint's {what} state is damaged ({detail})", path) from e


def strip_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` without DDP's ``module.`` and torch.compile's ``_orig_mod.``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        while key.startswith(_WRAPPER_PREFIXES):  # each a first name component, nested or mixed
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _find_state_dict(obj: Any, depth: int) -> Mapping[str, torch.Tensor] | None:
    if is_state_dict(obj):
        return obj
    if not isinstance(obj, Mapping) or depth >= _MAX_NESTING:
        return None
    for key in _STATE_DICT_KEYS:
        found = _find_state_dict(obj.get(key), depth + 1)
        if found is not None:
            return found
    return None


def extract_state_dict(obj: Any, path: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The model weights inside what :func:`load_checkpoint` read from ``path``, as
    ``name -> tensor``.

    Accepts a bare state_dict, our checkpoint ``{'model': sd, ...}``, ``{'state_dict': sd}``
    and ``{'ema': sd}`` (tried in that order, also nested, e.g. ``{'ema': {'state_dict': sd}}``).
    Wrapper prefixes (``module.``, ``_orig_mod.``) are stripped.

    Raises:
        CheckpointError: no state_dict found ("not a checkpoint").
    """
    found = _find_state_dict(obj, 0)
    if found is None:
        if isinstance(obj, Mapping):
            keys = ", ".join(repr(k) for k in list(obj)[:10]) or "none"
            hint = f"a dict with keys {keys}"
        else:
            hint = f"a {type(obj).__name__}"
        raise CheckpointError(
            f"not a checkpoint: no model weights found in {hint}; expected a state_dict or a dict "
            f"with one under 'model', 'state_dict' or 'ema'",
            path,
        )
    return strip_prefixes(found)


def load_state_dict_flexible(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Load every tensor of ``state_dict`` whose name and shape match ``model``'s, e.g. all but
    the heads when the checkpoint was trained for another class count.

    Wrapper prefixes (``module.``, ``_orig_mod.``) are stripped; non-tensor values are ignored.

    Returns:
        The names not loaded, sorted: checkpoint tensors the model lacks or holds in another
        shape, and model entries the checkpoint lacks (they keep their initial values).
    """
    sd = strip_prefixes(state_dict)
    own = model.state_dict()
    matched = {
        k: v
        for k, v in sd.items()
        if isinstance(v, torch.Tensor) and k in own and own[k].shape == v.shape
    }
    model.load_state_dict(matched, strict=False)
    skipped = {k for k, v in sd.items() if isinstance(v, torch.Tensor) and k not in matched}
    skipped |= {k for k in own if k not in matched}
    return sorted(skipped)


def load_state_dict_file(path: str | Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The model weights of a ``.pt`` file (see :func:`extract_state_dict`), on the CPU."""
    return extract_state_dict(load_checkpoint(path, trust=trust), path)


def _mismatch_report(sd: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> str:
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    wrong = sorted(k for k in set(own) & set(sd) if own[k].shape != sd[k].shape)
    parts = []
    for label, names in (("shape", wrong), ("missing", missing), ("unexpected", unexpected)):
        if not names:
            continue
        shown = names[:MAX_LISTED_MISMATCHES]
        detail = ", ".join(
            f"{k} {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" if label == "shape" else k
            for k in shown
        )
        more = len(names) - len(shown)
        parts.append(f"{label}: {detail}" + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)


def load_weights(
    model: nn.Module, path: str | Path, strict: bool = True, trust: bool = False
) -> list[str]:
    """Load Darknet ``.weights`` or a ``.pt`` (checkpoint of any supported form) into ``model``.

    Args:
        model: a :class:`~models.darknet.Darknet` built from the cfg the weights are for.
        path: the file (see :func:`weights_kind` for how Darknet files are told apart).
        strict: every ``.pt`` tensor must fit the model and a ``.weights`` file must hold the
            whole model (evaluation, prediction, conversion); otherwise tensors that do not fit
            are skipped (``--weights`` of a checkpoint trained for another class count) and a
            Darknet backbone file loads the layers it holds.
        trust: see :func:`load_checkpoint`.

    Returns:
        The names skipped (always empty when ``strict``).

    Raises:
        CheckpointError: unreadable or truncated file, or a strict load that does not fit.
    """
    if weights_kind(path) == "darknet":
        # --weights also takes Darknet's backbone files (darknet53.conv.74, yolov4.conv.137):
        # the layers they hold are found from their size.
        load_darknet_weights(model, path, partial=not strict)
        return []
    return fit_state_dict(model, load_state_dict_file(path, trust), path, strict)


_ONNX_SUFFIXES = (".onnx", ".ort")
_TORCH_SUFFIXES = (".pt", ".pth")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container
# A Darknet file starts with int32 major, minor, revision: 0.1.0 or 0.2.0 in every published file.
_DARKNET_VERSION_BYTES = 12
_DARKNET_MAX_VERSION = (1, 20, 1000)


def _is_darknet_version(head: bytes) -> bool:
    if len(head) < _DARKNET_VERSION_BYTES:
        return False
    version = np.frombuffer(head, dtype="<i4", count=3)
    return all(0 <= int(v) <= hi for v, hi in zip(version, _DARKNET_MAX_VERSION))


WANTED = "a .pt checkpoint (a run's last.pt or best.pt) or Darknet .weights"


def weights_kind(path: str | Path, wanted: str = WANTED) -> str:
    """What a weights file is, from its content and (case-insensitively) its name: ``"torch"``
    (a ``torch.save`` zip or a legacy pickle), ``"darknet"`` (``.weights`` and Darknet's backbone
    files ``*.conv.N``, or any other file that is neither) or ``"onnx"``. ``wanted``: what the
    error for a file of another kind (text, an image) asks for instead.

    Raises:
        CheckpointError: the file is missing, is not a regular file, or is an ONNX model (which
            no script here loads: it says what to do instead).
    """
    path = Path(path)
    _check_weights_file(path, "weights")
    try:
        with path.open("rb") as f:
            head = f.read(_DARKNET_VERSION_BYTES)
    except OSError as e:
        raise CheckpointError(f"cannot read the weights file ({e.strerror or e})", path) from e
    if not head:  # before a run folder is made, as for a truncated file (was: after)
        raise CheckpointError(f"an empty file (0 bytes), not weights; pass {wanted}", path)
    suffix = path.suffix.lower()
    if head[:4] == _ZIP_MAGIC and _is_torchscript(_zip_names(path)):
        raise CheckpointError(
            "a TorchScript export, which torch.jit.load runs (no script here loads one); pass "
            "the .pt checkpoint it was exported from",
            path,
        )
    if head[:4] == _ZIP_MAGIC or (head[:1] and head[0] == _PICKLE_PROTO):
        return "torch"
    if suffix in _ONNX_SUFFIXES:
        raise CheckpointError(
            "this is an ONNX model, which runs in onnxruntime (or OpenCV's dnn module), not in "
            "these scripts; pass the .pt checkpoint it was exported from (tools/export.py "
            "--weights X.pt --include onnx writes one checked against it)",
            path,
        )
    if _is_darknet_version(head):
        return "darknet"
    if suffix in _TORCH_SUFFIXES:
        # Named like a PyTorch file but holding neither container: truncated or not a checkpoint;
        # load_checkpoint words the error.
        return "torch"
    what = _not_weights(head)
    if what is not None:
        raise CheckpointError(
            f"not a weights file but {what}; pass {wanted}",
            path,
        )
    return "darknet"


def _zip_names(path: Path) -> list[str]:
    """The member names of a ``torch.save`` zip, from its central directory only, which is the
    file's last part: a truncated copy (an interrupted download or ``cp``) has none and is
    refused here, before a script makes its run folder (was: train.py made one, then failed).

    Raises:
        CheckpointError: the central directory cannot be read.
    """
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(_corrupt_message(e), path) from e


def _is_torchscript(names: list[str]) -> bool:
    """Whether a zip's members are a TorchScript archive's (``torch.jit.save``: compiled code
    and constants beside the data)."""
    return any(n.endswith("/constants.pkl") or "/code/" in n for n in names)


# First bytes of the image files a path given by mistake is most likely to be.
_IMAGE_MAGIC = {
    b"\xff\xd8\xff": "a JPEG image",
    b"\x89PNG": "a PNG image",
    b"GIF8": "a GIF image",
    b"BM": "a BMP image",
    b"II*\x00": "a TIFF image",
    b"MM\x00*": "a TIFF image",
    b"RIFF": "a RIFF file (WebP image, AVI video)",
}


def _not_weights(head: bytes) -> str | None:
    """What a file that cannot hold weights is, from its first bytes: an image, or text (a
    Darknet file starts with small binary integers, whose zero bytes no text file has)."""
    for magic, what in _IMAGE_MAGIC.items():
        if head.startswith(magic):
            return what
    if head and all(32 <= b < 127 or b in b"\t\r\n" for b in head):
        return "a text file (a cfg, YAML, .data or list?)"
    return None


@dataclasses.dataclass(frozen=True)
class WeightsFile:
    """A weights file as every script reads it: what it is and what it says about its run.

    Attributes:
        path: the file.
        kind: ``"torch"`` or ``"darknet"`` (see :func:`weights_kind`).
        ckpt: the checkpoint dict (None for Darknet files).
        cfg_text: the model cfg the checkpoint carries (train.py writes it), else None.
        names: its class names, else None.
        run: the resolved arguments of the run that wrote it (``TrainConfig.to_dict()``), else
            an empty dict.
        precision: how that run computed (``{"amp": "bfloat16" | "float16" | None,
            "channels_last": bool}``), else an empty dict.
    """

    path: Path
    kind: str
    ckpt: dict[str, Any] | None
    cfg_text: str | None
    names: list[str] | None
    run: dict[str, Any]
    precision: dict[str, Any]


def read_weights(path: str | Path, trust: bool = False, wanted: str = WANTED) -> WeightsFile:
    """Open ``path`` once for any script: the one reader of what a weights file carries
    (``wanted``: as :func:`weights_kind`).

    Raises:
        CheckpointError: see :func:`weights_kind` and :func:`load_checkpoint`.
    """
    path = Path(path)
    kind = weights_kind(path, wanted)
    if kind == "darknet":
        return WeightsFile(path, kind, None, None, None, {}, {})
    ckpt = load_checkpoint(path, trust=trust)
    cfg_text = ckpt.get("cfg") if isinstance(ckpt.get("cfg"), str) else None
    names = ckpt.get("names")
    names = [str(n) for n in names] if isinstance(names, list) and names else None
    run = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    precision = ckpt.get("precision") if isinstance(ckpt.get("precision"), dict) else {}
    return WeightsFile(path, kind, ckpt, cfg_text, names, dict(run), dict(precision))


def fit_state_dict(
    model: nn.Module, sd: Mapping[str, torch.Tensor], path: str | Path, strict: bool = True
) -> list[str]:
    """Load a state_dict taken from ``path`` into ``model``; see :func:`load_weights`."""
    own = model.state_dict()
    skipped = load_state_dict_flexible(model, sd)
    if strict and skipped:
        cfg = getattr(model, "cfg_path", None) or "the model's cfg"
        raise CheckpointError(
            f"{len(skipped)} tensors do not fit the model built from the cfg "
            f"({_mismatch_report(sd, own)}); {cfg} does not match these weights: pass the "
            f"--cfg (and --data) the weights were trained with, or rewrite the cfg for another "
            f"class count with tools/make_cfg.py",
            path,
        )
    return skipped


def save_weights_pt(model: nn.Module, path: str | Path, flag: str | None = None) -> None:
    """Write ``model``'s weights as an ultralytics/yolov3 ``.pt``, atomically:
    ``{'model': state_dict, 'epoch': -1, 'best_fitness': None, 'training_results': None,
    'optimizer': None, 'seen': int, 'darknet_version': [major, minor, revision]}``
    (``epoch=-1`` marks weights to initialise from, never a run to resume; ``seen`` and
    ``darknet_version`` keep a loaded ``.weights`` header: :func:`models.weights.darknet_header`
    reads them back)."""
    bare = unwrap_model(model)
    version = getattr(bare, "darknet_version", DARKNET_VERSION)
    save_checkpoint(
        {
            "epoch": -1,
            "best_fitness": None,
            "training_results": None,
            "model": {k: v.detach().cpu() for k, v in bare.state_dict().items()},
            "optimizer": None,
            "seen": int(getattr(bare, "seen", 0)),
            "darknet_version": [int(v) for v in version],
        },
        path,
        flag,
    )
