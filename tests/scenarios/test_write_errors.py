"""A full disk, a read-only place and a file where a folder should be, at every place a script
writes (train.py's run folder, validation.py --save-dir, predict.py --output,
tools/convert_weights.py, tools/export.py): one line on stderr, exit status 2, the previous
files intact byte for byte and no temporary file left.

We run as root, which ignores permissions, so a full disk and a read-only file system are
simulated below the scripts: :func:`failing_disk` makes ``open`` for writing in one folder fail
as the kernel would (ENOSPC at the write, EROFS at the open), and ``torch.save`` then raises
its own ``RuntimeError("... unexpected pos ...")`` as it does on a real full disk.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    NANO_CFG,
    rank_envs,
    run_warm_ranks,
    train_argv,
    validation_argv,
    worker_cmd,
)

import predict
import train as train_script
import validation
from build_utils.atomic import make_output_dir, write_error
from build_utils.errors import OutputError
from build_utils.parse_config import format_model_cfg, parse_model_cfg, rewrite_cfg_classes
from models.darknet import Darknet
from tools import convert_weights, export
from train_utils import checkpoint as ck

IMG = 64
NAMES = ["circle", "square", "triangle", "star", "cross"]


class _FullFile:
    """A file on a full disk: it opens, every write fails with ENOSPC."""

    def __init__(self, f: Any):
        self._f = f

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def failing_disk(
    monkeypatch: pytest.MonkeyPatch, root: Path, code: int, name: str = "", skip: int = 0
) -> None:
    """From now on, opening a file under ``root`` (whose name contains ``name``) for writing
    fails with ``code``, after the first ``skip`` such opens: ENOSPC fails the writes, anything
    else the open itself; a read-only file system also refuses new folders."""
    real_open, real_mkdir = builtins.open, os.mkdir
    root = root.resolve()
    seen = [0]

    def inside(file: Any) -> bool:
        if not isinstance(file, (str, bytes, os.PathLike)):
            return False
        path = Path(os.fsdecode(file)).resolve()
        return (path == root or root in path.parents) and name in path.name

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wxa+") and inside(file):
            seen[0] += 1
            if seen[0] > skip:
                if code != errno.ENOSPC:
                    raise OSError(code, os.strerror(code), os.fsdecode(file))
                return _FullFile(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if code == errno.EROFS and inside(path) and not os.path.exists(path):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def one_error_line(capsys: pytest.CaptureFixture[str], *parts: str) -> str:
    """The single ``error:`` line on stderr (the last; log lines may come before it), which
    names every one of ``parts``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert "Traceback" not in err, err
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for part in parts:
        assert part in errors[0], err
    return errors[0]


def no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 5-class nano checkpoint with confident heads, carrying its cfg and class names."""
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), len(NAMES))
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(IMG, IMG))
    with torch.no_grad():
        for i in model.yolo_layers:
            bias = model.module_list[i - 1].Conv2d.bias.view(3, -1)
            bias[:, 4] = 5.0
            bias[:, 5] = 5.0
    path = tmp_path_factory.mktemp("w") / "w.pt"
    cfg = format_model_cfg(blocks)
    path.with_suffix(".cfg").write_text(cfg)  # for Darknet .weights, which carry no cfg
    ck.save_checkpoint({"model": model.state_dict(), "epoch": -1, "names": NAMES, "cfg": cfg}, path)
    return path


# ---- the helper -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "why", "fix"),
    [
        (errno.ENOSPC, "No space left on device", "free some space or choose another --o"),
        (errno.EROFS, "Read-only file system", "make it writable or choose another --o"),
        (errno.EACCES, "Permission denied", "make it writable or choose another --o"),
        (errno.EISDIR, "r/last.pt is a folder, not a file", "move it away"),
    ],
)
def test_write_error_names_place_reason_and_fix(code: int, why: str, fix: str) -> None:
    e = write_error(OSError(code, os.strerror(code)), Path("r") / "last.pt", "--o")
    assert isinstance(e, OutputError)
    assert str(e) == f"cannot write {Path('r') / 'last.pt'}: {why}; {fix}" or (
        code == errno.EISDIR and str(e).startswith(f"cannot write r/last.pt: {why}; {fix}")
    )


def test_make_output_dir_file_in_the_way(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file")
    for target in (blocker, blocker / "x" / "y"):
        with pytest.raises(OutputError, match=f"{blocker} is a file where a folder should be"):
            make_output_dir(target, "--output-dir")
    assert blocker.read_text() == "a file"


# ---- checkpoints ----------------------------------------------------------------------------


def test_save_checkpoint_full_disk_keeps_previous(tmp_path, monkeypatch) -> None:
    """torch.save's "unexpected pos" RuntimeError on a full disk is one OutputError line."""
    path = tmp_path / "last.pt"
    ck.save_checkpoint({"epoch": 1, "model": {"w": torch.ones(300)}}, path)
    before = path.read_bytes()
    failing_disk(monkeypatch, tmp_path, errno.ENOSPC)
    with pytest.raises(OutputError, match="cannot write .*last.pt: No space left on device"):
        ck.save_checkpoint({"epoch": 2, "model": {"w": torch.zeros(300)}}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_save_checkpoint_torch_unexpected_pos(tmp_path, monkeypatch) -> None:
    """torch.save as it fails on a real full disk: part of the data written, then its zip
    writer's RuntimeError without an OSError behind it."""
    path = tmp_path / "best.pt"
    ck.save_checkpoint({"epoch": 1}, path)
    before = path.read_bytes()

    def full_disk_save(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 228 vs 0")

    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(OutputError, match=r"best.pt: the write failed \(is the disk full\?\)"):
        ck.save_checkpoint({"epoch": 2}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]


def test_train_full_disk_at_second_checkpoint(make_shapes_data, tmp_path, monkeypatch, console):
    """The disk fills after epoch 0's last.pt (torch.save fails as it does on a full disk): the
    run stops at epoch 1's with one line, exit 2, and last.pt still holds epoch 0 byte for byte
    (it does not train on without checkpoints)."""
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"
    real_save, saved = torch.save, {}

    def save_then_fill_disk(obj: Any, f: Any) -> None:
        if not saved:
            real_save(obj, f)
            saved["epoch0"] = True
            return
        saved["last.pt"] = (out / "last.pt").read_bytes()
        f.write(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", save_then_fill_disk)
    argv = train_argv(data, out, "--no-savebest", epochs=2, batch=2, img=IMG)
    assert train_script.main(argv) == 2
    one_error_line(console, f"cannot write {out / 'last.pt'}: the write failed", "--output-dir")
    assert (out / "last.pt").read_bytes() == saved["last.pt"]
    assert ck.load_checkpoint(out / "last.pt")["epoch"] == 0
    assert no_temp_files(out)


def test_train_log_on_a_full_disk_is_one_warning(make_shapes_data, tmp_path, monkeypatch, console):
    """train.log's lines cannot be written: one warning, not logging's traceback per line."""
    data = make_shapes_data(n_train=4, n_val=2)
    out = tmp_path / "run"
    failing_disk(monkeypatch, out, errno.ENOSPC, name="train.log")
    assert train_script.main(train_argv(data, out, epochs=1, batch=2, img=IMG)) == 0
    err = console.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    warnings = [line for line in err.splitlines() if "the log goes on on the console" in line]
    assert len(warnings) == 1, err
    assert f"cannot write {out / 'train.log'}: No space left on device" in warnings[0]
    assert ck.load_checkpoint(out / "last.pt")["epoch"] == 0


def test_train_output_dir_is_a_file(make_shapes_data, tmp_path, console) -> None:
    data = make_shapes_data(n_train=4, n_val=2)
    blocker = tmp_path / "run"
    blocker.write_text("mine")
    assert train_script.main(train_argv(data, blocker / "sub", img=IMG)) == 2
    one_error_line(console, f"{blocker} is a file where a folder should be")
    assert blocker.read_text() == "mine"


# ---- validation.py --save-dir ---------------------------------------------------------------


def _validate(data: Path, weights: Path, save: Path, *extra: str) -> int:
    argv = validation_argv(NANO_CFG, data, weights, "--save-dir", str(save), *extra, img=IMG)
    return validation.main(argv)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_validation_save_dir_full_or_read_only(
    shapes_data, weights, tmp_path, monkeypatch, console, code
) -> None:
    save = tmp_path / "val"
    assert _validate(shapes_data, weights, save) == 0
    before = snapshot(save)
    assert "per_class.csv" in before
    console.readouterr()
    failing_disk(monkeypatch, save, code)
    assert _validate(shapes_data, weights, save, "--exist-ok") == 2  # replace the report
    one_error_line(console, f"cannot write {save}", os.strerror(code), "--save-dir")
    assert snapshot(save) == before


def test_validation_save_dir_is_a_file(shapes_data, weights, tmp_path, console) -> None:
    save = tmp_path / "val"
    save.write_text("mine")
    assert _validate(shapes_data, weights, save) == 2
    one_error_line(console, f"{save} is a file where a folder should be", "--save-dir")
    assert save.read_text() == "mine"


# ---- predict.py --output --------------------------------------------------------------------


def _predict(weights: Path, source: Path, out: Path, *extra: str) -> int:
    argv = ["--weights", str(weights), "--source", str(source), "--output", str(out)]
    return predict.main([*argv, "--img-size", str(IMG), "--device", "cpu", *extra])


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_predict_output_full_or_read_only(
    shapes_data, weights, tmp_path, monkeypatch, console, code
) -> None:
    source = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    out = tmp_path / "out"
    assert _predict(weights, source, out, "--save-txt") == 0
    before = snapshot(out)
    assert len(before) == 2  # the picture and its label file
    console.readouterr()
    failing_disk(monkeypatch, out, code)
    # --exist-ok: into the folder that holds the first run's predictions (else out2 is used).
    assert _predict(weights, source, out, "--save-txt", "--exist-ok") == 2
    one_error_line(console, f"cannot write {out}", os.strerror(code), "--output")
    assert snapshot(out) == before


def test_predict_output_is_a_file(shapes_data, weights, tmp_path, console) -> None:
    source = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    out = tmp_path / "out"
    out.write_text("mine")
    assert _predict(weights, source, out) == 2
    one_error_line(console, f"{out} is a file where a folder should be", "--output")
    assert out.read_text() == "mine"


# ---- tools ----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".weights", ".pt"])
def test_convert_weights_full_disk(weights, tmp_path, monkeypatch, console, suffix) -> None:
    """Both directions: a .pt to Darknet .weights, and that .weights back to a .pt."""
    src, cfg = weights, []
    if suffix == ".pt":
        src, cfg = tmp_path / "src" / "w.weights", ["--cfg", str(weights.with_suffix(".cfg"))]
        src.parent.mkdir()
        assert convert_weights.main(["--weights", str(weights), "-o", str(src)]) == 0
    out = tmp_path / "out"
    dst = out / f"converted{suffix}"
    argv = ["--weights", str(src), *cfg, "-o", str(dst)]
    assert convert_weights.main(argv) == 0
    before = snapshot(out)
    console.readouterr()
    failing_disk(monkeypatch, out, errno.ENOSPC)
    # --exist-ok: over the first conversion (without it, refused before any write).
    assert convert_weights.main([*argv, "--exist-ok"]) == 2
    one_error_line(console, f"cannot write {dst}: No space left on device", "--output")
    assert snapshot(out) == before


def test_export_onnx_full_disk(weights, tmp_path, monkeypatch, console) -> None:
    pytest.importorskip("onnx")
    out = tmp_path / "out"
    dst = out / f"{Path(weights).stem}.onnx"
    argv = ["--weights", str(weights), "-o", str(out), "--img-size", str(IMG), "--no-verify"]
    assert export.main(argv) == 0
    before = snapshot(out)
    console.readouterr()
    failing_disk(monkeypatch, out, errno.ENOSPC)
    assert export.main([*argv, "--exist-ok"]) == 2
    one_error_line(console, f"cannot write {dst}: No space left on device", "--output")
    assert snapshot(out) == before


# ---- DDP: rank 0 alone writes -------------------------------------------------------------


@pytest.mark.slow
def test_ddp_full_disk_stops_every_rank(make_shapes_data, tmp_path) -> None:
    """Two gloo ranks; rank 0's checkpoint of epoch 1 hits a full disk. Both ranks stop at once
    with the same error line and exit 2 (rank 1 does not wait for rank 0 at the epoch's end),
    and last.pt still holds epoch 0."""
    data = make_shapes_data(n_train=8, n_val=4)
    out = tmp_path / "run"
    argv = train_argv(data, out, "--no-savebest", "--dist-timeout", "120", epochs=2, img=IMG)
    cmd = worker_cmd("full_disk_train", *argv)
    ranks = run_warm_ranks([cmd, cmd], rank_envs())
    results = [(out, err) for _, out, err in ranks]
    errors = [[ln for ln in err.splitlines() if ln.startswith("error:")] for _, err in results]
    assert [code for code, _, _ in ranks] == [2, 2], results
    assert all("Traceback" not in err for _, err in results), results
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert errors[0][0].startswith("error: saving epoch 1 failed on rank 0 (")
    assert f"cannot write {out / 'last.pt'}: the write failed" in errors[0][0]
    assert ck.load_checkpoint(out / "last.pt")["epoch"] == 0
    assert no_temp_files(out)
