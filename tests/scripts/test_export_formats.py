"""tools/export.py and models/export.py: each format loads in its own runtime (onnxruntime,
torch.jit.load, OpenVINO) and agrees with PyTorch; outputs are named, placed and replaced as the
README says; bad input is one line with exit status 2.

Tolerances: float32 exports agree with PyTorch float32 within 1e-4 relative and absolute on every
decoded value (boxes in pixels, scores) and keep the same detections after NMS; float16 within
1e-2 relative and absolute.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from build_utils.boxes import non_max_suppression
from models import export as model_export
from models.darknet import Darknet
from tools import export
from train_utils.checkpoint import save_weights_pt

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "cfg" / "yolov3-tiny.cfg"
IMG = 64
FP32_TOL = 1e-4
FP16_TOL = 1e-2
NMS_CONF, NMS_IOU = 0.25, 0.45
# What every export records beside its graph (the test weights carry no class names).
METADATA = {
    "names": [f"class{i}" for i in range(80)],
    "stride": 32,
    "imgsz": [IMG, IMG],
    "input": "images",
    "output": "detections",
}

HAVE_ORT = importlib.util.find_spec("onnxruntime") is not None
HAVE_OPENVINO = importlib.util.find_spec("openvino") is not None
needs_ort = pytest.mark.skipif(not HAVE_ORT, reason="onnxruntime not installed (requirements-onnx)")
needs_openvino = pytest.mark.skipif(
    not HAVE_OPENVINO, reason="openvino not installed (pip install -r requirements-onnx.txt)"
)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def detecting_model() -> Darknet:
    """yolov3-tiny with random weights whose heads are biased to detect class 0 with some
    confidence, so that NMS keeps boxes to compare (and no other class competes for them)."""
    torch.manual_seed(0)
    model = Darknet(TINY, img_size=IMG)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
        for i in model.yolo_layers:
            head = model.module_list[i]
            bias = model.module_list[i - 1].Conv2d.bias.view(head.na, head.no)
            bias[:, 4] += 5.0
            bias[:, 5:] = -6.0
            bias[:, 5] = 2.0
    return model.eval()


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "best.pt"
    save_weights_pt(detecting_model(), path)
    return path


def picture() -> np.ndarray:
    """(1, 3, 64, 64) float32 RGB in [0, 1]: a hand-drawn scene (gradient, shapes)."""
    img = np.zeros((IMG, IMG, 3), np.uint8)
    img[:] = np.linspace(40, 200, IMG, dtype=np.uint8)[None, :, None]
    cv2.rectangle(img, (6, 8), (30, 40), (20, 200, 60), -1)
    cv2.circle(img, (46, 44), 12, (230, 40, 40), -1)
    cv2.line(img, (0, 63), (63, 0), (255, 255, 255), 2)
    x = img.transpose(2, 0, 1)[None].astype(np.float32) / 255.0
    return np.concatenate([x, x[:, :, ::-1, ::-1].copy()])  # batch 2: a second, flipped view


def pytorch_output(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return detecting_model()(torch.from_numpy(x))[0].numpy()


def assert_same_detections(want: np.ndarray, got: np.ndarray) -> None:
    kept_want = non_max_suppression(torch.from_numpy(want), NMS_CONF, NMS_IOU)
    kept_got = non_max_suppression(torch.from_numpy(got.astype(np.float32)), NMS_CONF, NMS_IOU)
    assert sum(len(k) for k in kept_want) > 0  # the comparison has something to compare
    for a, b in zip(kept_want, kept_got):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=FP32_TOL, atol=1e-3)


def onnx_metadata(path: Path) -> dict:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}


def torchscript_metadata(path: Path) -> dict:
    extra = {"config.txt": ""}
    torch.jit.load(str(path), _extra_files=extra)
    return json.loads(extra["config.txt"])


def run_onnx(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    assert inp.name == "images"
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    (got,) = session.run(["detections"], {"images": x.astype(dtype)})
    return got


def run_torchscript(path: Path, x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    module = torch.jit.load(str(path))
    assert {p.dtype for p in module.parameters()} == {dtype}
    with torch.no_grad():
        return module(torch.from_numpy(x).to(dtype)).numpy()


def run_openvino(folder: Path, x: np.ndarray) -> tuple[np.ndarray, set[str], dict]:
    """The output, the element types of the IR's weight constants and its metadata."""
    import openvino as ov

    # The stack guard of the export's own runs (test_openvino_leaves_the_signal_stack_...).
    with model_export.openvino_core() as core:
        ir = core.read_model(str(folder / "best.xml"), str(folder / "best.bin"))
        # In f32, as the export checks itself: OpenVINO's default on a CPU with bf16
        # arithmetic is bf16, whose rounding no float32 tolerance covers.
        compiled = core.compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
        out = compiled({"images": x})[compiled.output("detections")]
    types = {
        op.get_output_element_type(0).get_type_name()
        for op in ir.get_ops()
        if op.get_type_name() == "Constant"
        and op.get_output_size()
        and len(op.get_output_shape(0)) == 4
    }
    info = ir.get_rt_info()["model_info"]
    meta = {k: json.loads(ir.get_rt_info(["model_info", k]).astype(str)) for k in info}
    return out, types, meta


# ---- each format in its own runtime -----------------------------------------------------------


@needs_ort
def test_onnx_and_torchscript_agree_with_pytorch(weights, tmp_path):
    out = tmp_path / "exports"
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", str(IMG), "-o", str(out)]
    assert export.main([*argv, "--include", "onnx", "torchscript"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["best.onnx", "best.torchscript"]
    assert onnx_metadata(out / "best.onnx") == METADATA
    assert torchscript_metadata(out / "best.torchscript") == METADATA
    x = picture()
    want = pytorch_output(x)
    for got in (
        run_onnx(out / "best.onnx", x),
        run_torchscript(out / "best.torchscript", x, torch.float32),
    ):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=FP32_TOL, atol=FP32_TOL)
        assert_same_detections(want, got)


@needs_ort
def test_exports_into_a_folder_whose_name_is_not_utf8_are_checked(weights, tmp_path, caplog):
    """Was: a TypeError traceback (exit 1) from onnxruntime's and TorchScript's loaders after the
    file was written: both take a path only as UTF-8 text; the check now hands them the bytes."""
    out = tmp_path / os.fsdecode(b"exp\xff")
    try:
        out.mkdir()
    except OSError as e:
        pytest.skip(f"this file system refuses names that are not UTF-8 ({e})")
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", str(IMG), "-o", str(out)]
    with caplog.at_level("INFO"):
        assert export.main([*argv, "--include", "onnx", "torchscript", "--exist-ok"]) == 0
    checked = [r.getMessage() for r in caplog.records if "matches PyTorch" in r.getMessage()]
    assert [m.split()[0] for m in checked] == ["onnx", "torchscript"]


@needs_ort
def test_half_onnx_and_torchscript(weights, tmp_path, caplog):
    """float16 end to end on the CPU (ONNX's grid is counted in float32: Range has no float16).
    The log says which tolerance each format is within, and how much of it is used: a max abs
    difference above 0.01 passes by the relative part (box sides in pixels)."""
    out = tmp_path / "half"
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", str(IMG), "-o", str(out)]
    with caplog.at_level("INFO"):
        assert export.main([*argv, "--include", "onnx", "torchscript", "--half"]) == 0
    checked = [r.getMessage() for r in caplog.records if "PyTorch" in r.getMessage()]
    assert [line.split()[0] for line in checked] == ["onnx", "torchscript"]
    for line in checked:
        assert re.fullmatch(
            r"\w+ matches PyTorch within the tolerance 0.01 relative \+ 0.01 absolute: the "
            r"largest difference is (\d+)% of what it allows \(max abs difference \S+\); "
            r"\d+ of its \d+ detections after NMS found",
            line,
        ), line
        assert int(re.search(r"(\d+)% of", line)[1]) <= 100
    x = picture()
    want = pytorch_output(x)
    onnx_out = run_onnx(out / "best.onnx", x)
    ts_out = run_torchscript(out / "best.torchscript", x, torch.float16)
    for got in (onnx_out, ts_out):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=FP16_TOL, atol=FP16_TOL)
        assert not np.array_equal(got.astype(np.float32), want)  # really computed in float16


@needs_openvino
@pytest.mark.parametrize("half", [False, True])
def test_openvino_agrees_with_pytorch(weights, tmp_path, half):
    out = tmp_path / "ov"
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", str(IMG), "-o", str(out)]
    assert export.main([*argv, "--include", "openvino", *(["--half"] if half else [])]) == 0
    folder = out / "best_openvino_model"
    assert sorted(p.name for p in out.iterdir()) == ["best_openvino_model"]  # no temporary left
    assert sorted(p.name for p in folder.iterdir()) == ["best.bin", "best.xml"]
    x = picture()
    want = pytorch_output(x)
    got, weight_types, meta = run_openvino(folder, x)
    assert meta == METADATA
    assert got.dtype == np.float32  # compress_to_fp16 keeps a float32 interface
    assert weight_types == ({"f16"} if half else {"f32"})
    tol = FP16_TOL if half else FP32_TOL
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    if not half:
        assert_same_detections(want, got)


class RecordingOpenVINO:
    """The openvino module as models/export.py sees it, with ``Core`` recording the settings
    of every ``compile_model`` and optionally answering another default precision or failing
    a compile (as OpenVINO does on a CPU it cannot run a model on)."""

    def __init__(self, default: str | None = None, fail: set[str | None] = frozenset()):
        import openvino

        self.real, self.default, self.fail, self.compiled = openvino, default, fail, []
        outer = self

        class Core(openvino.Core):
            def get_property(self, device, name):
                if name == model_export.PRECISION_HINT and outer.default is not None:
                    return getattr(openvino.Type, outer.default)
                return super().get_property(device, name)

            def compile_model(self, model, device, config=None):
                precision = (config or {}).get(model_export.PRECISION_HINT)
                outer.compiled.append(precision)
                if precision in outer.fail:
                    raise RuntimeError(
                        "Exception from src/inference/src/cpp/core.cpp:112:\n"
                        "Supported primitive descriptors list is empty for node: MaxPool\n"
                    )
                if precision is None and outer.default is not None:
                    # The pretended default runs as f32, so that the model compiles and the
                    # outcome is the same on every CPU (this one's own default may not compile).
                    config = {model_export.PRECISION_HINT: "f32"}
                return super().compile_model(model, device, config or {})

        self.Core = Core

    def __getattr__(self, name):
        return getattr(self.real, name)


def openvino_export(weights: Path, out: Path) -> int:
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", str(IMG), "-o", str(out)]
    return export.main([*argv, "--include", "openvino"])


@needs_openvino
def test_openvino_is_checked_with_the_f32_hint(weights, tmp_path, monkeypatch):
    """The check compiles in f32, the IR's precision, whatever OpenVINO would choose for this
    CPU; on a CPU whose default is f32 no second compile is made."""
    fake = RecordingOpenVINO(default="f32")  # not this machine's: some CPUs default to bf16
    monkeypatch.setattr(model_export, "_import_openvino", lambda: fake)
    assert openvino_export(weights, tmp_path / "ov") == 0
    assert fake.compiled == ["f32"]


@needs_openvino
@pytest.mark.parametrize("default_compiles", [True, False])
def test_a_reduced_default_precision_is_reported_with_its_detections(
    weights, tmp_path, monkeypatch, caplog, default_compiles
):
    """On a CPU where OpenVINO computes in bf16 by default (AVX512-BF16, AMX) the export is
    checked in f32 and passes, and the log says what a default deployment gets: its detections
    against PyTorch's, or that it cannot compile there, and how to choose f32."""
    fake = RecordingOpenVINO(default="bf16", fail=set() if default_compiles else {None})
    monkeypatch.setattr(model_export, "_import_openvino", lambda: fake)
    with caplog.at_level("WARNING"):
        assert openvino_export(weights, tmp_path / "ov") == 0
    assert fake.compiled == ["f32", None]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tools.export"]
    if default_compiles:
        # The pretended bf16 compile computed in f32, so every detection matches.
        assert re.fullmatch(
            r"openvino: OpenVINO computes in bf16 on this CPU unless told otherwise: at bf16 "
            r"(\d+) of \1 PyTorch detections after NMS are found \(max abs difference .*\); "
            r"for float32 compile with \{'INFERENCE_PRECISION_HINT': 'f32'\} \(README: Export\)",
            line,
        ), line
    else:
        assert line == (
            "openvino: OpenVINO's default precision on this CPU is bf16, and OpenVINO cannot "
            "run the model on this CPU: Supported primitive descriptors list is empty for node: "
            "MaxPool; "
            "for float32 compile with {'INFERENCE_PRECISION_HINT': 'f32'} (README: Export)"
        )


@needs_openvino
def test_a_reduced_default_precision_without_detections_says_so(tmp_path, monkeypatch, caplog):
    """A model that detects nothing on the sample images (random weights): the warning says
    that only the raw outputs were compared, not "0 of 0 detections are found"."""
    fake = RecordingOpenVINO(default="bf16")
    monkeypatch.setattr(model_export, "_import_openvino", lambda: fake)
    argv = ["--cfg", str(TINY), "--img-size", str(IMG), "-o", str(tmp_path), "--include"]
    with caplog.at_level("INFO"):
        assert export.main([*argv, "openvino"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "tools.export"]
    assert lines[1].endswith("; no detections above conf 0.25 on the sample images to compare")
    assert re.fullmatch(
        r"openvino: OpenVINO computes in bf16 on this CPU unless told otherwise: at bf16 the "
        r"sample images give no PyTorch detections above conf 0.25, so only the raw outputs were "
        r"compared \(max abs difference \S+\); for float32 compile with "
        r"\{'INFERENCE_PRECISION_HINT': 'f32'\} \(README: Export\)",
        lines[2],
    ), lines[2]


@needs_openvino
def test_openvino_that_cannot_run_here_is_one_line(weights, tmp_path, monkeypatch, capsys):
    """Where OpenVINO cannot compile the model on this CPU even in f32, the export is written
    and the check says so in one line (exit 1: the runtime's limitation, not the user's)."""
    fake = RecordingOpenVINO(fail={"f32"})
    monkeypatch.setattr(model_export, "_import_openvino", lambda: fake)
    assert openvino_export(weights, tmp_path / "ov") == 1
    assert (tmp_path / "ov" / "best_openvino_model" / "best.xml").is_file()
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        "error: openvino (OpenVINO cannot run the model in f32 on this CPU: Supported "
        "primitive descriptors list is empty for node: MaxPool)"
    )


# ---- where outputs go, and what is never overwritten ----------------------------------------


def test_existing_exports_are_kept_without_exist_ok(weights, tmp_path, capsys):
    """Defaults put the exports beside the weights; a second export refuses before writing
    anything, and --exist-ok replaces what is there."""
    src = tmp_path / "best.pt"
    src.write_bytes(weights.read_bytes())
    argv = ["--weights", str(src), "--cfg", str(TINY), "--img-size", str(IMG), "--no-verify"]
    assert export.main([*argv, "--include", "torchscript"]) == 0
    ts = tmp_path / "best.torchscript"
    ts.write_bytes(b"mine")
    capsys.readouterr()
    assert export.main([*argv, "--include", "onnx", "torchscript"]) == 2
    assert "best.torchscript already exists; pass --exist-ok" in one_error_line(capsys)
    assert ts.read_bytes() == b"mine" and not (tmp_path / "best.onnx").exists()
    assert export.main([*argv, "--include", "onnx,TorchScript", "--exist-ok"]) == 0
    assert ts.read_bytes() != b"mine" and (tmp_path / "best.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.onnx",
        "best.pt",
        "best.torchscript",
    ]


@needs_openvino
def test_openvino_folder_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """--exist-ok on an OpenVINO folder: a full disk while saving leaves the old folder as it
    was (and no temporary folder); a save that succeeds replaces it."""
    import openvino

    folder = tmp_path / "yolov3-tiny_openvino_model"
    folder.mkdir()
    (folder / "yolov3-tiny.xml").write_text("old")
    argv = ["--cfg", str(TINY), "--img-size", str(IMG), "-o", str(tmp_path), "--no-verify"]
    argv += ["--include", "openvino", "--exist-ok"]
    real_save = openvino.save_model

    def full_disk(model, path, **kwargs):
        real_save(model, path, **kwargs)  # the files exist, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(openvino, "save_model", full_disk)
    assert export.main(argv) == 2
    assert "No space left on device" in one_error_line(capsys)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert [p.name for p in folder.iterdir()] == ["yolov3-tiny.xml"]
    assert (folder / "yolov3-tiny.xml").read_text() == "old"
    monkeypatch.setattr(openvino, "save_model", real_save)
    assert export.main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert sorted(p.name for p in folder.iterdir()) == ["yolov3-tiny.bin", "yolov3-tiny.xml"]
    assert (folder / "yolov3-tiny.xml").read_text().startswith("<?xml")


@needs_openvino
def test_openvino_folder_with_the_users_files_is_never_replaced(tmp_path, capsys):
    """Was: --exist-ok on an OpenVINO folder that also held the user's own files (notes, a
    subfolder) replaced it whole, exit 0, and those files were gone. Now one line, exit 2,
    before anything (here the TorchScript file first) is written; a file where the folder goes
    likewise (it was moved aside to a hidden name)."""
    folder = tmp_path / "yolov3-tiny_openvino_model"
    (folder / "sub").mkdir(parents=True)
    files = {"notes.txt": "mine", "sub/y": "mine too", "yolov3-tiny.xml": "old"}
    for name, text in files.items():
        (folder / name).write_text(text)
    argv = ["--cfg", str(TINY), "--img-size", str(IMG), "-o", str(tmp_path), "--no-verify"]
    argv += ["--include", "torchscript", "openvino", "--exist-ok"]
    capsys.readouterr()
    assert export.main(argv) == 2
    assert one_error_line(capsys) == (
        f"error: {folder} holds notes.txt, not part of an OpenVINO export (replacing the "
        "folder would delete it); move it away or choose another --output\n"
    )
    assert {str(p.relative_to(folder)) for p in folder.rglob("*")} == {"sub", *files}
    assert all((folder / name).read_text() == text for name, text in files.items())
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    with pytest.raises(model_export.ConfigError, match="holds notes.txt"):
        model_export.export_openvino(Darknet(TINY, img_size=IMG), folder, IMG)
    shutil.rmtree(folder)
    folder.write_text("a file")
    assert export.main(argv) == 2
    assert "is a file where a folder should be" in one_error_line(capsys)
    assert folder.read_text() == "a file" and [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    base = ["--cfg", str(TINY), "--img-size", str(IMG), "--no-verify", "-o", str(tmp_path)]
    assert export.main([*base, "--include"]) == 2
    assert "--include needs at least one format: onnx, torchscript, openvino" in one_error_line(
        capsys
    )
    assert export.main([*base, "--include", "onnx", "tflite"]) == 2
    assert "--include 'tflite' is not a format this tool writes" in one_error_line(capsys)
    real_find_spec = importlib.util.find_spec

    def no_ort(name, *args):
        return None if name == "onnxruntime" else real_find_spec(name, *args)

    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", no_ort)
        assert export.main([*base, "--include", "torchscript", "onnx", "--verify"]) == 2
    line = one_error_line(capsys)
    assert "--include onnx needs onnxruntime: pip install -r requirements-onnx.txt" in line
    assert line.endswith("(or --no-verify)\n") and list(tmp_path.iterdir()) == []
    assert export.main(["--img-size", str(IMG), "--include", "torchscript"]) == 2
    assert "pass --weights" in one_error_line(capsys)
    # An opset torch cannot write: one line before any format (torchscript first) is written.
    too_new = "99"
    assert export.main([*base, "--include", "torchscript", "onnx", "--opset", too_new]) == 2
    line = one_error_line(capsys)
    assert f"--opset {too_new}: torch {torch.__version__} exports opsets 11 to" in line
    assert list(tmp_path.iterdir()) == []
    assert export.main([*base, "--img-size", "100"]) == 2
    assert "--img-size 100 is not a positive multiple of 32" in one_error_line(capsys)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad_out = ["--cfg", str(TINY), "--img-size", str(IMG), "--include", "torchscript"]
    assert export.main([*bad_out, "-o", str(blocker / "sub")]) == 2
    line = one_error_line(capsys)
    assert "--output" in line and str(blocker) in line
    assert list(tmp_path.iterdir()) == [blocker]


def test_weights_file_is_never_an_output(weights, tmp_path, capsys):
    src = tmp_path / "m.torchscript"
    src.write_bytes(weights.read_bytes())
    argv = ["--weights", str(src), "--cfg", str(TINY), "--img-size", str(IMG)]
    assert export.main([*argv, "--include", "torchscript", "--exist-ok"]) == 2
    assert "is the weights file itself" in one_error_line(capsys)
    assert src.read_bytes() == weights.read_bytes()


def test_verify_catches_a_wrong_export(tmp_path):
    """The tool's own check: a TorchScript file of the model passes with every detection
    found; checked against a slightly different model it fails."""
    model = detecting_model()
    path = model_export.export_torchscript(model, tmp_path / "m.torchscript", IMG)
    images = export.sample_images(IMG, IMG)
    fmt = model_export.FORMATS["torchscript"]
    same = model_export.verify(fmt, model, path, images, half=False)
    assert same.ok and same.max_abs == 0.0 and same.found == same.detections > 0
    other = detecting_model()
    with torch.no_grad():
        other.module_list[other.yolo_layers[0] - 1].Conv2d.bias[0] += 1e-2
    moved = model_export.verify(fmt, other, path, images, half=False)
    assert not moved.ok and moved.worst > 1


def test_a_size_the_memory_cannot_hold_is_refused_before_tracing(
    weights, tmp_path, monkeypatch, capsys
):
    """Was: --img-size 8192 traced for minutes until the kernel's OOM killer ended it; now the
    memory the trace, conversion and check need (models/budget.py) is one line, exit 2, with
    nothing written. YOLO_MEMORY_AVAILABLE is the way past an estimate that errs."""
    monkeypatch.setenv("YOLO_MEMORY_AVAILABLE", str(16 << 30))  # a 16 GiB machine
    traced = []
    monkeypatch.setattr(model_export, "_tracing", lambda *a: traced.append(a))
    out = tmp_path / "out"
    argv = ["--weights", str(weights), "--cfg", str(TINY), "--img-size", "8192", "-o", str(out)]
    assert export.main(argv) == 2
    err = one_error_line(capsys)
    assert re.fullmatch(
        r"error: .*yolov3-tiny.cfg:\d+: \[\w+\] layer \d+: the model does not fit: about "
        r"[\d.]+ GiB needed up to this layer \(export, trace and check, 8192x8192 px\), 16 GiB "
        r"YOLO_MEMORY_AVAILABLE; use a smaller model, image size or batch \(the need is an "
        r"estimate: set YOLO_MEMORY_AVAILABLE to override the measurement\)\n",
        err,
    ), err
    assert traced == [] and not out.exists()


def test_half_without_cpu_float16_is_one_line(tmp_path, monkeypatch, capsys):
    """A torch whose CPU has no float16 convolution (before 2.1) gets one line, not a trace."""
    real = Darknet.forward

    def no_cpu_half(self, x):
        if x.dtype == torch.float16:
            raise RuntimeError("\"slow_conv2d_cpu\" not implemented for 'Half'")
        return real(self, x)

    monkeypatch.setattr(Darknet, "forward", no_cpu_half)
    argv = ["--cfg", str(TINY), "--img-size", str(IMG), "-o", str(tmp_path), "--no-verify"]
    assert export.main([*argv, "--include", "torchscript", "--half"]) == 2
    assert "cannot run this model in float16 on the CPU" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@needs_ort
def test_onnxruntime_telemetry_is_off(monkeypatch):
    """onnxruntime 1.32 sends usage events to events.data.microsoft.com from its own threads
    unless ORT_DISABLE_TELEMETRY is set when it starts (tests/scenarios/test_offline.py saw
    the connections); the export's check sets it before importing onnxruntime."""
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    model_export._import_onnxruntime()
    assert os.environ["ORT_DISABLE_TELEMETRY"] == "1"


# A child process with faulthandler's alternate signal stack (pytest enables it) and a Python
# SIGCHLD handler (torch's DataLoader leaves one): two compiled models, each from its own
# ``openvino_core()`` (argv[1] "kept") or a bare ``Core()`` ("bare"), freed in the order they
# were made, then a child process that ends; prints whether the stack is the one it started on.
_COMPILES_FREED_FIRST_IN_FIRST_OUT = """
import ctypes, faulthandler, signal, subprocess, sys
import openvino as ov, torch
from models import export
def stack():
    s = export._SignalStack()
    ctypes.CDLL(None).sigaltstack(None, ctypes.byref(s))
    return s.sp, s.size
faulthandler.enable()
signal.signal(signal.SIGCHLD, lambda *args: None)
before = stack()
net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.MaxPool2d(2)).eval()
ir = ov.convert_model(net, example_input=torch.zeros(1, 3, 32, 32))
f32, models = {"INFERENCE_PRECISION_HINT": "f32"}, []
for _ in range(2):
    if sys.argv[1] == "kept":
        with export.openvino_core() as core:
            models.append((core, core.compile_model(ir, "CPU", f32)))
    else:
        core = ov.Core()
        models.append((core, core.compile_model(ir, "CPU", f32)))
del core
while models:
    models.pop(0)
subprocess.run(["true"], check=True)
print(stack() == before)
"""


@needs_openvino
@pytest.mark.skipif(os.name != "posix", reason="sigaltstack(2) is POSIX")
def test_openvino_leaves_the_signal_stack_as_it_found_it(tmp_path):
    """Was: the pytest worker running tests/scripts/test_gpu_check.py died of SIGSEGV on
    AVX512-BF16 CPUs once this file had run in it (the export's bf16 compile failed there, and
    pytest kept the failed test's traceback, and with it OpenVINO's objects). OpenVINO's CPU
    plugin gives the thread a signal stack for each compiled model and puts back the one it
    found when the model goes; freed first-in first-out, the thread is left on the first one's
    freed stack, and the next signal handled there (a child's SIGCHLD) kills the process. On an
    AVX512-BF16 AMD EPYC (Zen 4) the bare sequence below dies so (SIGSEGV, measured); through
    ``openvino_core()`` every model finds and puts back the caller's stack."""
    cmd = [sys.executable, "-c", _COMPILES_FREED_FIRST_IN_FIRST_OUT, "kept"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]
