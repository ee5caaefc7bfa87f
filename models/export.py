"""A Darknet model in the deployment formats: ONNX, TorchScript and OpenVINO, written atomically,
loaded back in each format's own runtime and compared with PyTorch.

Every format holds the same graph: one input ``images`` (batch, 3, H, W) in [0, 1] and one output
``detections`` (batch, N, 5 + nc), the eval-mode decoded boxes of
:class:`~models.darknet.Darknet` (cx, cy, w, h in input pixels, sigmoid objectness and class
scores) before NMS. The batch size is dynamic; H and W are fixed (the grids are baked in).

fp16 (``half=True``): ONNX and TorchScript are traced from the model in float16 on the CPU (the
pinned torch runs float16 convolutions there; an older one gets one line), so they take and
return float16; OpenVINO stores float16 weights (``compress_to_fp16``) and keeps a float32 input
and output, computing in the precision the device chooses. The runtimes and converters are
optional packages, imported only when their format is asked for.

Each export carries its metadata (:func:`export_metadata`: class names, stride, input size) as
YOLOv5 stores it where the format has a place: ONNX ``metadata_props``, TorchScript's
``config.txt`` extra file, OpenVINO's ``rt_info`` under ``model_info``; values are JSON text.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import importlib.util
import io
import json
import math
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn

from build_utils.atomic import (
    atomic_write,
    check_output_place,
    fsync_dir,
    make_output_dir,
    reported_write,
    temp_path,
)
from build_utils.boxes import non_max_suppression
from build_utils.errors import ConfigError
from models.darknet import Darknet
from models.tta import model_stride

# Opset 11 is the first with the Resize semantics nn.Upsample needs; 12 is widely supported.
MIN_OPSET = 11
DEFAULT_OPSET = 12


def _max_opset() -> int:
    """The newest opset this torch's TorchScript-based exporter (``dynamo=False``) writes: a
    higher ``--opset`` makes ``torch.onnx.export`` raise a bare RuntimeError mid-export. torch
    keeps the number in a private module, so an older or newer layout falls back to 17."""
    try:
        from torch.onnx import _constants
    except ImportError:
        return 17
    return int(getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", 17))


MAX_OPSET = _max_opset()
OUTPUT_FLAG = "--output"  # the option that chose the output place, named in write errors
INPUT_NAME, OUTPUT_NAME = "images", "detections"
INSTALL_ONNX = "pip install -r requirements-onnx.txt"
OPENVINO_FOLDER_SUFFIX = "_openvino_model"  # YOLOv5's: best.pt -> best_openvino_model/
IR_SUFFIXES = (".xml", ".bin")  # what openvino.save_model writes into that folder
# Elementwise agreement with PyTorch float32: |got - want| <= tol + tol * |want|, on every
# decoded value (boxes in pixels, scores in [0, 1]). float16 carries 11 significant bits
# (relative step 1e-3) and its rounding compounds through ~100 layers.
FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 1e-2
# NMS-level agreement: the detections a deployment would keep, at predict.py-like settings.
NMS_CONF, NMS_IOU = 0.25, 0.45
SAME_BOX_IOU = 0.9  # a reference detection is found when the export has one of its class this close
PRECISION_HINT = "INFERENCE_PRECISION_HINT"  # OpenVINO's property for the compute precision


class DetectionsOnly(nn.Module):
    """Wraps a Darknet so that the exported graph returns only the decoded detections."""

    def __init__(self, model: Darknet):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, 3, H, W) -> (bs, N, 5 + nc), see :class:`~models.darknet.Darknet`."""
        return self.model(x)[0]


def hw(img_size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """(H, W) of a side or an (H, W) pair."""
    if isinstance(img_size, int):
        return img_size, img_size
    if len(img_size) == 1:
        return int(img_size[0]), int(img_size[0])
    return int(img_size[0]), int(img_size[1])


def export_metadata(
    model: Darknet, img_size: int | tuple[int, int], names: list[str] | None = None
) -> dict[str, Any]:
    """What a deployment needs beside the graph: ``names`` (the class names, else ``class0``,
    ...), ``stride`` (the largest, pixels), ``imgsz`` ([H, W]) and the ``input``/``output``
    names."""
    return {
        "names": list(names) if names else [f"class{i}" for i in range(model.nc)],
        "stride": model_stride(model),
        "imgsz": list(hw(img_size)),
        "input": INPUT_NAME,
        "output": OUTPUT_NAME,
    }


def _meta_text(meta: Mapping[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in meta.items()}


@contextlib.contextmanager
def _tracing(model: Darknet, example: torch.Tensor) -> Iterator[DetectionsOnly]:
    """The wrapper to trace with ``example``, in eval mode (a float16 copy when ``example`` is
    float16), with the tracers' warnings about this static graph silenced; ``model`` is in eval
    mode afterwards.

    The wrapper has run ``example`` once, so that every head's grid is cached for the traced
    size: each trace then holds it as a constant, the same in every invocation (OpenVINO checks
    two traces against each other; a fresh model would count its grid in the first only).
    """
    model.eval()
    half = example.dtype == torch.float16
    wrapper = DetectionsOnly(copy.deepcopy(model).half() if half else model).eval()
    try:
        with torch.no_grad():
            wrapper(example)
    except (RuntimeError, NotImplementedError) as e:
        if half and "Half" in str(e):
            raise ConfigError(
                f"--half: torch {torch.__version__} cannot run this model in float16 on the "
                "CPU; export without --half, or upgrade torch"
            ) from e
        raise
    with warnings.catch_warnings():
        # The TorchScript-based tracers are deprecated in favour of torch.export (which needs
        # extra packages for ONNX); they handle this static graph fine. Their warnings about
        # shape-dependent Python branches concern values constant at a fixed image size.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # Darknet's max-pooling pads with -inf where MaxPool's symmetric padding cannot (size=2
        # stride=1): F.pad exports as Pad with a reversed (step -1) Slice the folder skips.
        warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
        yield wrapper
    # The ONNX exporter restores the wrapper's original mode on exit, recursively.
    model.eval()


def check_opset(opset: int) -> None:
    """Raises ConfigError for an ``--opset`` the exporter cannot write: below
    :data:`MIN_OPSET` (no Resize for the upsample layers) or above :data:`MAX_OPSET`."""
    if opset < MIN_OPSET:
        raise ConfigError(f"--opset {opset}: upsampling needs opset {MIN_OPSET} or later")
    if opset > MAX_OPSET:
        raise ConfigError(
            f"--opset {opset}: torch {torch.__version__} exports opsets {MIN_OPSET} to {MAX_OPSET}"
        )


def _begin(
    model: Darknet, path: str | Path, img_size: int | tuple[int, int], half: bool
) -> tuple[Path, torch.Tensor]:
    """What every export starts with: the image size checked against the model's strides, the
    output's folder made, and the input to trace with, (1, C, H, W) zeros (float16 when
    ``half``)."""
    h, w = hw(img_size)
    stride = model_stride(model)
    if h % stride or w % stride:
        raise ConfigError(f"--img-size {h} {w}: both sides must be multiples of {stride}")
    path = Path(path)
    make_output_dir(path.parent, OUTPUT_FLAG)
    dtype = torch.float16 if half else torch.float32
    return path, torch.zeros(1, int(model.hyperparams.get("channels", 3)), h, w, dtype=dtype)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    # Into memory first, then atomically onto ``path``: a full disk mid-write must leave the
    # previous export whole (the exporters would write ``path`` in place).
    with reported_write(path, OUTPUT_FLAG), atomic_write(path, "wb") as f:
        f.write(data)


def export_onnx(
    model: Darknet,
    path: str | Path,
    img_size: int | tuple[int, int] = 416,
    opset: int = DEFAULT_OPSET,
    half: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` in eval mode as ONNX with a dynamic batch axis; returns the path.
    ``metadata`` (JSON-able values) goes into the graph's ``metadata_props`` when the onnx
    package is there to write it.

    ``model`` is left in eval mode. Raises ConfigError for an opset outside 11 to
    :data:`MAX_OPSET` or an image size that is not a multiple of the model's largest stride.
    """
    check_opset(opset)
    path, example = _begin(model, path, img_size, half)
    buf = io.BytesIO()
    with _tracing(model, example) as wrapper:
        torch.onnx.export(
            wrapper,
            (example,),
            buf,
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    _write_file(path, _with_onnx_metadata(buf.getvalue(), metadata) if metadata else buf.getvalue())
    return path


def _with_onnx_metadata(data: bytes, metadata: Mapping[str, Any]) -> bytes:
    try:
        import onnx
    except ImportError:
        return data  # the graph runs without it; only the names and sizes are not recorded
    proto = onnx.load_from_string(data)
    for key, value in _meta_text(metadata).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def export_torchscript(
    model: Darknet,
    path: str | Path,
    img_size: int | tuple[int, int] = 416,
    half: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` traced (``torch.jit.trace``) on the CPU as a TorchScript file; returns
    the path. Load it with ``torch.jit.load(path)``; no project code is needed. ``metadata``
    is the extra file ``config.txt`` (one JSON object, as YOLOv5 writes it)."""
    path, example = _begin(model, path, img_size, half)
    buf = io.BytesIO()
    with _tracing(model, example) as wrapper:
        with torch.no_grad():
            traced = torch.jit.trace(wrapper, example, check_trace=False)
        extra = {"config.txt": json.dumps(dict(metadata))} if metadata else {}
        torch.jit.save(traced, buf, _extra_files=extra)
    _write_file(path, buf.getbuffer())
    return path


def _import_openvino():
    # OpenVINO's converter sends usage telemetry unless its package is absent: it forks a
    # helper process that connects to an analytics host and keeps a client id under ~/intel/.
    # Nothing here may reach the network, so the converter gets its own no-op stand-in.
    sys.modules.setdefault("openvino_telemetry", None)
    try:
        import openvino
    except ImportError as e:
        raise ConfigError(f"OpenVINO needs openvino: {INSTALL_ONNX}") from e
    return openvino


def export_openvino(
    model: Darknet,
    folder: str | Path,
    img_size: int | tuple[int, int] = 416,
    half: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` as an OpenVINO IR folder (``<folder>/<stem>.xml`` and ``.bin``, the stem
    being the folder's name less ``_openvino_model``); returns the folder.

    Converted from the PyTorch model directly (``openvino.convert_model``); ``half`` stores the
    weights in float16 (``compress_to_fp16``). The folder is written under a temporary name
    beside it and renamed into place, so that it is whole or absent; an existing one is
    replaced only after the new one is complete, and only when it holds nothing else
    (:func:`check_openvino_folder`). ``metadata`` goes into the IR's ``rt_info`` under
    ``model_info``.
    """
    ov = _import_openvino()
    check_openvino_folder(Path(folder))
    folder, example = _begin(model, folder, img_size, False)
    with _tracing(model, example) as wrapper:
        converted = ov.convert_model(wrapper, example_input=example, input=[-1, *example.shape[1:]])
    converted.inputs[0].get_tensor().set_names({INPUT_NAME})
    converted.outputs[0].get_tensor().set_names({OUTPUT_NAME})
    for key, value in _meta_text(metadata or {}).items():
        converted.set_rt_info(value, ["model_info", key])
    tmp = temp_path(folder)
    try:
        with reported_write(folder, OUTPUT_FLAG, folder=True):
            ov.save_model(converted, str(tmp / f"{ir_stem(folder)}.xml"), compress_to_fp16=half)
            _replace_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def ir_stem(folder: Path) -> str:
    """The file stem inside an OpenVINO folder: ``best_openvino_model`` holds ``best.xml``."""
    return folder.name.removesuffix(OPENVINO_FOLDER_SUFFIX) or folder.name


def check_openvino_folder(folder: Path) -> None:
    """Refuse to replace ``folder`` when it is a file, or holds anything but an export's own
    files (``<stem>.xml``, ``<stem>.bin``): replacing the folder would delete the user's files
    with it. Like ``--exist-ok`` elsewhere, which replaces a tool's own outputs, never others.

    Raises:
        OutputError: ``folder`` is a file.
        ConfigError: it holds a file or folder an export does not write (the first is named).
    """
    check_output_place(folder, OUTPUT_FLAG, folder=True)
    if not folder.is_dir():
        return
    own = {ir_stem(folder) + suffix for suffix in IR_SUFFIXES}
    other = sorted(p.name for p in folder.iterdir() if p.name not in own)
    if other:
        raise ConfigError(
            f"{folder} holds {other[0]}, not part of an OpenVINO export (replacing the folder "
            f"would delete it); move it away or choose another {OUTPUT_FLAG}"
        )


def _replace_folder(new: Path, folder: Path) -> None:
    """Rename the finished folder ``new`` onto ``folder``; an old one is moved aside first (a
    folder cannot be renamed onto a non-empty one) and removed once the new one is in place."""
    old = None
    if folder.exists():
        old = temp_path(folder)
        os.replace(folder, old)
    try:
        os.replace(new, folder)
    except OSError:
        if old is not None:
            os.replace(old, folder)
        raise
    fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- the formats and their runtimes ----------------------------------------------------------


def _import_onnxruntime():
    # onnxruntime (1.32, on Linux too) sends usage telemetry to an events.data.microsoft.com
    # collector from threads of its own, unless ORT_DISABLE_TELEMETRY is set when it starts
    # (disable_telemetry_events() alone still lets it connect): off, as OpenVINO's is.
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ConfigError(f"checking ONNX needs onnxruntime: {INSTALL_ONNX}") from e
    disable = getattr(ort, "disable_telemetry_events", None)
    if disable is not None:
        disable()
    return ort


def _path_or_bytes(path: Path) -> str | bytes:
    """``path`` as the runtimes take it, or the file's bytes where it is not UTF-8: onnxruntime
    and TorchScript's loader take a path only as a UTF-8 ``str`` (a non-UTF-8 folder was a
    TypeError traceback after the file was written)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return path.read_bytes()
    return str(path)


def _run_onnx(path: Path, x: np.ndarray) -> np.ndarray:
    ort = _import_onnxruntime()
    session = ort.InferenceSession(_path_or_bytes(path), providers=["CPUExecutionProvider"])
    dtype = np.float16 if session.get_inputs()[0].type == "tensor(float16)" else np.float32
    (got,) = session.run(None, {INPUT_NAME: x.astype(dtype)})
    return got.astype(np.float32)


def _run_torchscript(path: Path, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load's deprecation notice
        source = _path_or_bytes(path)
        module = torch.jit.load(
            io.BytesIO(source) if isinstance(source, bytes) else source, map_location="cpu"
        )
    dtype = next(module.parameters()).dtype
    with torch.no_grad():
        return module(torch.from_numpy(x).to(dtype)).float().numpy()


class RuntimeUnavailable(Exception):
    """A format's runtime cannot run an export on this machine (a runtime's limitation, not a
    wrong export); the message is one line."""


class _SignalStack(ctypes.Structure):
    """libc's ``stack_t``, as ``sigaltstack(2)`` reads and writes it."""

    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


@contextlib.contextmanager
def openvino_core() -> Iterator[Any]:
    """An OpenVINO ``Core``; on leaving, the calling thread's alternate signal stack is put back.

    OpenVINO's CPU plugin gives the thread a signal stack of its own for each compiled model and
    puts back the one it found when that model goes: two freed in the order they were made
    leave the thread on the first one's freed stack, and the next signal handled there (a
    child's SIGCHLD, which torch's DataLoader handles) kills the process with SIGSEGV (a pytest
    worker, on AVX512-BF16 CPUs, once a failed test's traceback had kept a model alive). With
    the caller's stack back on leaving, every later model finds, and puts back, that one.
    """
    libc = ctypes.CDLL(None) if os.name == "posix" else None
    sigaltstack = getattr(libc, "sigaltstack", None)
    saved = _SignalStack()
    kept = sigaltstack is not None and sigaltstack(None, ctypes.byref(saved)) == 0
    try:
        yield _import_openvino().Core()
    finally:
        if kept:
            sigaltstack(ctypes.byref(saved), None)


def openvino_default_precision() -> str:
    """The precision OpenVINO's CPU plugin computes in when a deployment does not choose one:
    ``f32``, or ``bf16`` on CPUs with bf16 arithmetic (AVX512-BF16, AMX), ``f16`` on some ARM."""
    with openvino_core() as core:
        return str(core.get_property("CPU", PRECISION_HINT).to_string())


def _run_openvino_in(folder: Path, x: np.ndarray, precision: str | None) -> np.ndarray:
    """Run the IR in ``folder`` on the CPU in ``precision`` (None: OpenVINO's default here).

    Raises:
        RuntimeUnavailable: OpenVINO cannot compile or run the model on this CPU.
    """
    config = {} if precision is None else {PRECISION_HINT: precision}
    try:
        with openvino_core() as core:
            compiled = core.compile_model(
                core.read_model(str(folder / f"{ir_stem(folder)}.xml")), "CPU", config
            )
            out = compiled(x.astype(np.float32))[compiled.output(0)]
            return np.asarray(out, dtype=np.float32)
    except RuntimeError as e:
        # Only the message is kept: OpenVINO's objects must not outlive the call in a traceback.
        why = _runtime_message(str(e))
    in_what = f" in {precision}" if precision else ""
    raise RuntimeUnavailable(f"OpenVINO cannot run the model{in_what} on this CPU: {why}")


def _runtime_message(text: str) -> str:
    """The line of a C++ runtime's error that says what went wrong: OpenVINO stacks lines of
    ``Exception from <file>:<line>:`` above it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if not re.fullmatch(r"Exception from \S+:\d+:?", line)]
    return (said or lines or ["(no message)"])[0]


def _openvino_deployment(folder: Path, x: np.ndarray, want: np.ndarray) -> str | None:
    """What a deployment compiled with OpenVINO's defaults gets on this CPU, when that is not
    the f32 the export was checked in: its detections after NMS against PyTorch's."""
    default = openvino_default_precision()
    if default == "f32":
        return None
    choose = f"for float32 compile with {{'{PRECISION_HINT}': 'f32'}} (README: Export)"
    try:
        got = _run_openvino_in(folder, x, None)
    except RuntimeUnavailable as e:
        return f"OpenVINO's default precision on this CPU is {default}, and {e}; {choose}"
    a = compare(want, got, FP16_TOLERANCE)
    found = (
        f"{a.found} of {a.detections} PyTorch detections after NMS are found"
        if a.detections
        else f"the sample images give no PyTorch detections above conf {NMS_CONF}, so only the "
        "raw outputs were compared"
    )
    return (
        f"OpenVINO computes in {default} on this CPU unless told otherwise: at {default} "
        f"{found} (max abs difference {a.max_abs:.2e}); {choose}"
    )


@dataclass(frozen=True)
class ExportFormat:
    """One deployment format: the ``--include`` name, the output's name from the weights' stem,
    how to write it and how to run what was written (on the CPU, in its own runtime), and the
    packages each needs (``writer_needs``, ``runtime_needs``: import names). ``deployment``,
    where a runtime computes in another precision by default than the one checked, says what
    a deployment with default settings gets (None: the same)."""

    name: str
    target: Callable[[str], str]
    write: Callable[..., Path]
    run: Callable[[Path, np.ndarray], np.ndarray]
    writer_needs: tuple[str, ...] = ()
    runtime_needs: tuple[str, ...] = ()
    deployment: Callable[[Path, np.ndarray, np.ndarray], str | None] | None = None
    check_target: Callable[[Path], None] | None = None  # may an existing output be replaced?

    def missing(self, verify: bool) -> list[str]:
        """The packages this format needs (to write, and to run when ``verify``) that are not
        installed."""
        wanted = self.writer_needs + (self.runtime_needs if verify else ())
        return [m for m in dict.fromkeys(wanted) if importlib.util.find_spec(m) is None]


# The writers as FORMATS calls them: (model, path, img_size, half, opset, metadata).
def _write_onnx(model: Darknet, path: Path, img_size, half, opset, metadata) -> Path:
    return export_onnx(model, path, img_size, opset, half, metadata)


def _write_torchscript(model: Darknet, path: Path, img_size, half, opset, metadata) -> Path:
    return export_torchscript(model, path, img_size, half, metadata)


def _write_openvino(model: Darknet, path: Path, img_size, half, opset, metadata) -> Path:
    return export_openvino(model, path, img_size, half, metadata)


# Output names as YOLOv5's export.py gives them.
FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        ExportFormat(
            "onnx", lambda stem: f"{stem}.onnx", _write_onnx, _run_onnx, ("onnx",), ("onnxruntime",)
        ),
        ExportFormat(
            "torchscript", lambda stem: f"{stem}.torchscript", _write_torchscript, _run_torchscript
        ),
        ExportFormat(
            "openvino",
            lambda stem: f"{stem}{OPENVINO_FOLDER_SUFFIX}",
            _write_openvino,
            # Checked in f32, the precision of the IR: OpenVINO would otherwise compute in bf16
            # on CPUs that have it, whose rounding no float32 tolerance covers (see
            # _openvino_deployment).
            functools.partial(_run_openvino_in, precision="f32"),
            ("openvino",),
            ("openvino",),
            _openvino_deployment,
            check_openvino_folder,
        ),
    )
}


# ---- checking an export against PyTorch ------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """How an export's output compares with PyTorch float32 on the same images.

    Attributes:
        max_abs: the largest absolute difference of any decoded value.
        worst: the largest ``|got - want| / (tol + tol * |want|)``; at most 1 passes.
        tolerance: the ``tol`` used (:data:`FP32_TOLERANCE` or :data:`FP16_TOLERANCE`).
        detections: PyTorch's detections after NMS (``NMS_CONF``, ``NMS_IOU``), all images.
        found: how many of them the export's own NMS output has (same class, IoU >= 0.9).
        unavailable: why the runtime could not run the export here (then nothing compared).
        deployment: what a deployment with the runtime's default settings gets, where that
            differs from what was checked (:attr:`ExportFormat.deployment`).
    """

    max_abs: float
    worst: float
    tolerance: float
    detections: int
    found: int
    unavailable: str | None = None
    deployment: str | None = None

    @property
    def ok(self) -> bool:
        return self.unavailable is None and self.worst <= 1.0


def _found(want: torch.Tensor, got: torch.Tensor) -> int:
    """How many rows of ``want`` (n, 6) xyxy, conf, class have a same-class row in ``got``
    with IoU >= :data:`SAME_BOX_IOU`."""
    if len(want) == 0 or len(got) == 0:
        return 0
    iou = torchvision.ops.box_iou(want[:, :4], got[:, :4])
    same = want[:, 5:6] == got[:, 5].unsqueeze(0)
    return int(((iou >= SAME_BOX_IOU) & same).any(1).sum())


def compare(want: np.ndarray, got: np.ndarray, tolerance: float) -> Agreement:
    """Compare decoded outputs (bs, N, 5 + nc) elementwise and after NMS."""
    if got.shape != want.shape:  # a broken export: nothing to compare value by value
        return Agreement(float("inf"), float("inf"), tolerance, 0, 0)
    diff = np.abs(got.astype(np.float64) - want)
    worst = float((diff / (tolerance + tolerance * np.abs(want))).max())
    kept_want = non_max_suppression(torch.from_numpy(want).float(), NMS_CONF, NMS_IOU)
    kept_got = non_max_suppression(torch.from_numpy(got).float(), NMS_CONF, NMS_IOU)
    return Agreement(
        max_abs=float(diff.max()),
        worst=worst,
        tolerance=tolerance,
        detections=sum(len(k) for k in kept_want),
        found=sum(_found(a, b) for a, b in zip(kept_want, kept_got)),
    )


def verify(
    fmt: ExportFormat, model: Darknet, path: Path, images: torch.Tensor, half: bool
) -> Agreement:
    """Run the export at ``path`` in its own runtime on ``images`` (bs, 3, H, W) float32 in
    [0, 1] and compare with ``model`` (float32, eval mode, CPU) on the same images."""
    model.eval()
    with torch.no_grad():
        want = model(images)[0].double().numpy()
    tolerance = FP16_TOLERANCE if half else FP32_TOLERANCE
    try:
        got = fmt.run(path, images.numpy())
    except RuntimeUnavailable as e:
        return Agreement(math.inf, math.inf, tolerance, 0, 0, unavailable=str(e))
    agreement = compare(want, got, tolerance)
    if fmt.deployment is not None:
        note = fmt.deployment(path, images.numpy(), want)
        agreement = dataclasses.replace(agreement, deployment=note)
    return agreement
