"""Tests for train_utils/checkpoint.py: atomic save, weights_only round trips, error messages."""

from __future__ import annotations

import argparse
import os
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from build_utils.errors import CheckpointError, OutputError
from train_utils import checkpoint as ck


def tiny_model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.Conv2d(width, 2, 1))


def training_state() -> dict:
    """A checkpoint with real optimizer (momentum), LambdaLR and GradScaler states."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model(torch.rand(2, 3, 8, 8)).sum().backward()
    opt.step()  # creates the momentum buffers
    sched.step()
    return {
        "version": ck.CHECKPOINT_VERSION,
        "epoch": 3,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "ema": tiny_model().state_dict(),
        "ema_updates": np.int64(42),
        "best_fitness": np.float64(0.25),
        "config": argparse.Namespace(img_size=416, data=Path("data/coco.data"), lr=np.float32(0.5)),
        "results": np.array([0.1, 0.2]),
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_round_trip_weights_only(tmp_path: Path) -> None:
    ckpt = training_state()
    path = tmp_path / "last.pt"
    ck.save_checkpoint(ckpt, path)
    # The file itself must load with plain weights_only=True, not just through our loader.
    raw = torch.load(path, map_location="cpu", weights_only=True)
    loaded = ck.load_checkpoint(path)
    assert_same(raw, loaded)
    assert_same(ck.to_plain(ckpt), loaded)
    assert loaded["version"] == ck.CHECKPOINT_VERSION and loaded["epoch"] == 3
    assert loaded["best_fitness"] == 0.25 and type(loaded["best_fitness"]) is float
    assert loaded["ema_updates"] == 42
    assert loaded["config"] == {"img_size": 416, "data": "data/coco.data", "lr": 0.5}
    assert loaded["scheduler"]["lr_lambdas"] == [None]
    assert loaded["scaler"]["scale"] == 1024.0
    assert torch.equal(loaded["results"], torch.tensor([0.1, 0.2], dtype=torch.float64))

    # The states go back into fresh objects.
    model = tiny_model()
    model.load_state_dict(loaded["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    opt.load_state_dict(loaded["optimizer"])
    assert all("momentum_buffer" in s for s in opt.state.values()) and len(opt.state) == 6
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    sched.load_state_dict(loaded["scheduler"])
    assert sched.last_epoch == 1
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(loaded["scaler"])
    assert scaler.get_scale() == 1024.0


def test_weights_files_hold_the_unwrapped_model(tmp_path: Path) -> None:
    model = tiny_model()
    ck.save_weights_pt(nn.DataParallel(model), tmp_path / "w.pt")
    ckpt = ck.load_checkpoint(tmp_path / "w.pt")
    assert list(ckpt["model"]) == list(model.state_dict())  # no "module." prefix
    assert ckpt["optimizer"] is None and ckpt["epoch"] == -1


def test_to_plain() -> None:
    got = ck.to_plain(OrderedDict(a=np.float32(1.5), b=[np.int64(2), (np.bool_(True), Path("x"))]))
    assert got == OrderedDict(a=1.5, b=[2, (True, "x")])
    assert type(got) is OrderedDict and type(got["a"]) is float and type(got["b"][1][0]) is bool
    arr = ck.to_plain(np.arange(6).reshape(2, 3)[:, ::2])  # non-contiguous view
    assert torch.equal(arr, torch.tensor([[0, 2], [3, 5]]))
    t = torch.ones(2)
    assert ck.to_plain(t) is t


def test_atomic_save_keeps_old_file_on_crash(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "last.pt"
    ck.save_checkpoint({"epoch": 1, "model": {"w": torch.ones(3)}}, path)
    real_save = torch.save

    def crash_mid_write(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")  # a partial zip header, then the crash
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint({"epoch": 2, "model": {"w": torch.zeros(3)}}, path)
    monkeypatch.setattr(torch, "save", real_save)

    old = ck.load_checkpoint(path)
    assert old["epoch"] == 1 and torch.equal(old["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # temp file removed


def test_save_error_is_output_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OutputError, match=f"{blocker} is a file where a folder should be"):
        ck.save_checkpoint({"epoch": 0}, blocker / "sub" / "last.pt")


def test_save_creates_parent_and_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "weights" / "best.pt"
    ck.save_checkpoint({"epoch": 1}, path)
    ck.save_checkpoint({"epoch": 2}, path)
    assert ck.load_checkpoint(path)["epoch"] == 2
    assert os.listdir(path.parent) == ["best.pt"]


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    ck.save_checkpoint(training_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt") as info:
        ck.load_checkpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b"Darknet weights are not pickles\n"])
def test_garbage_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "yolov3.weights"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="truncated, corrupt or not a PyTorch checkpoint"):
        ck.load_checkpoint(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="file not found"):
        ck.load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        ck.load_checkpoint(tmp_path)


@pytest.mark.parametrize("obj,kind", [([1, 2], "list"), (torch.ones(2), "Tensor")])
def test_not_a_dict(tmp_path: Path, obj, kind: str) -> None:
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    with pytest.raises(CheckpointError, match=f"not a checkpoint: the file holds a {kind}"):
        ck.load_checkpoint(path)


def test_untrusted_objects_need_trust(tmp_path: Path, caplog) -> None:
    path = tmp_path / "foreign.pt"
    # What other trainers save: numpy scalars and whole namespaces.
    torch.save({"epoch": np.int64(3), "opt": argparse.Namespace(x=1)}, path)
    with pytest.raises(CheckpointError, match="pass --trust-checkpoint only if the file comes"):
        ck.load_checkpoint(path)
    loaded = ck.load_checkpoint(path, trust=True)
    assert loaded["opt"].x == 1
    assert "trusted source" in caplog.text


def test_extract_state_dict_variants() -> None:
    sd = tiny_model().state_dict()
    keys = list(sd)
    ddp_sd = {f"module.{k}": v for k, v in sd.items()}
    compiled = {f"_orig_mod.{k}": v for k, v in sd.items()}
    both = {f"module._orig_mod.{k}": v for k, v in sd.items()}  # DDP of a compiled model
    for obj in (
        sd,
        ddp_sd,
        compiled,
        both,
        {"model": sd, "optimizer": None, "epoch": 3},
        {"model": None, "ema": sd, "epoch": -1},
        {"state_dict": ddp_sd},
        {"ema": {"state_dict": sd, "updates": 10}},
    ):
        got = ck.extract_state_dict(obj)
        assert list(got) == keys
        assert all(torch.equal(got[k], sd[k]) for k in keys)


@pytest.mark.parametrize(
    "obj,match",
    [
        ({"epoch": 3, "best": 0.5}, "keys 'epoch', 'best'"),
        ({}, "keys none"),
        ([torch.ones(1)], "a list"),
        ({"model": {"a": 1}}, "keys 'model'"),
    ],
)
def test_extract_state_dict_rejects(obj, match: str) -> None:
    with pytest.raises(CheckpointError, match=f"not a checkpoint: no model weights.*{match}"):
        ck.extract_state_dict(obj, path="x.pt")


def test_trusted_file_needing_foreign_code(tmp_path: Path) -> None:
    path = tmp_path / "foreign.pt"
    torch.save({"model": nn.Identity()}, path)
    raw = path.read_bytes()
    # Point the pickled class at a module that does not exist here, as another repository's
    # checkpoint (models.yolo.Model) would.
    path.write_bytes(raw.replace(b"torch.nn.modules.linear", b"torch.nn.modules.lineaX"))
    with pytest.raises(CheckpointError, match="pickles objects from code that is not available"):
        ck.load_checkpoint(path, trust=True)


def test_lineage_checkpoints_with_numpy_values_load_weights_only(tmp_path: Path) -> None:
    """The lineage saved best_fitness as a numpy scalar or 1-element array: those numpy types,
    and only those, are allowed; they come back as Python numbers and tensors."""
    sd = tiny_model().state_dict()
    path = tmp_path / "lineage.pt"
    torch.save(
        {
            "epoch": 12,
            "best_fitness": np.array([0.4123]),
            "training_results": "0 1 2\n",
            "model": sd,
            "optimizer": None,
            "extra": np.float64(0.25),
            "n": np.int64(7),
        },
        path,
    )
    loaded = ck.load_checkpoint(path)
    assert loaded["extra"] == 0.25 and type(loaded["extra"]) is float
    assert loaded["n"] == 7 and type(loaded["n"]) is int
    assert torch.equal(loaded["best_fitness"], torch.tensor([0.4123], dtype=torch.float64))
    assert all(torch.equal(loaded["model"][k], v) for k, v in sd.items())
    model = tiny_model()
    assert ck.load_weights(model, path) == []
    # A numpy array of Python objects is not a numpy number: still refused.
    torch.save({"model": sd, "names": np.array(["a", None], dtype=object)}, tmp_path / "obj.pt")
    with pytest.raises(CheckpointError, match="pass --trust-checkpoint only if"):
        ck.load_checkpoint(tmp_path / "obj.pt")


@pytest.mark.parametrize("reader", ["load_checkpoint", "weights_kind"])
def test_a_40_gb_sparse_checkpoint_is_refused_unread(tmp_path: Path, reader: str) -> None:
    import resource

    path = tmp_path / "big.pt"
    with path.open("wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(40 << 30)  # sparse: no disk used
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError) as info:
        getattr(ck, reader)(path)
    assert str(info.value) == (
        f"{path}: 40 GiB, over the limit of 8 GiB (bytes per weights or checkpoint file); "
        "set YOLO_MAX_WEIGHTS_BYTES to raise it"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 << 10  # KiB


def test_a_fifo_named_pt_is_refused_without_opening_it(tmp_path: Path) -> None:
    path = tmp_path / "pipe.pt"
    os.mkfifo(path)  # opening it would block until a writer came
    with pytest.raises(CheckpointError, match=r"pipe\.pt: a FIFO \(named pipe\), not a regular"):
        ck.read_weights(path)


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: p.write_bytes(b"\xff\xd8\xff\xe0" + bytes(64)), "not a weights file but a JPEG"),
        (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64)), "not a weights file but a PNG"),
        (lambda p: p.write_text("classes=5\ntrain=x.txt\n"), "not a weights file but a text file"),
        (
            lambda p: torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(p)),
            "a TorchScript export, which torch.jit.load runs",
        ),
        # Refused before train.py makes a run folder (was: after, leaving failed-<time>/).
        (lambda p: p.write_bytes(b""), "an empty file (0 bytes), not weights; pass a .pt"),
    ],
    ids=["jpeg", "png", "text", "torchscript", "empty"],
)
def test_what_is_not_a_weights_file_says_what_it_is(tmp_path: Path, make, said: str) -> None:
    """--weights or --resume given an image, a .data file or an export: one line naming what it
    is (was: Darknet's 'truncated' error, or torch's weights_only=False advice)."""
    path = tmp_path / "given.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.save's deprecation notice
        make(path)
    with pytest.raises(CheckpointError) as info:
        ck.weights_kind(path)
    assert str(info.value).startswith(f"{path}: {said}") and "weights_only" not in str(info.value)
