"""Tests for train_utils/checkpoint.py: atomic save, weights_only round trips, error messages."""

from __future__ import annotations

import argparse
import os
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
    return ck.make_checkpoint(
        model=model,
        epoch=3,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        ema=tiny_model(),
        ema_updates=np.int64(42),
        best_fitness=np.float64(0.25),
        config=argparse.Namespace(img_size=416, data=Path("data/coco.data"), lr=np.float32(0.5)),
        results=np.array([0.1, 0.2]),
    )


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


def test_make_checkpoint_unwraps_ddp_style_modules() -> None:
    model = tiny_model()
    ckpt = ck.make_checkpoint(model=nn.DataParallel(model), epoch=0)
    assert list(ckpt["model"]) == list(model.state_dict())
    assert ckpt["optimizer"] is None and ckpt["scaler"] is None


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
    for obj in (
        sd,
        ddp_sd,
        compiled,
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


def test_validate_resume_ok() -> None:
    ckpt = training_state()
    model = tiny_model()
    ckpt["model"] = {f"module.{k}": v for k, v in ckpt["model"].items()}
    sd = ck.validate_resume_checkpoint(ckpt, model.state_dict())
    model.load_state_dict(sd)


def test_validate_resume_other_model() -> None:
    ckpt = training_state()
    other = tiny_model(width=8).state_dict()
    with pytest.raises(CheckpointError) as info:
        ck.validate_resume_checkpoint(ckpt, other, path="runs/last.pt")
    msg = str(info.value)
    assert msg.startswith("runs/last.pt: checkpoint is for another model: ")
    assert "0.weight: checkpoint (4, 3, 3, 3) vs model (8, 3, 3, 3)" in msg
    assert "; and 2 more; use --weights to initialise from it instead" in msg  # 7 mismatches


def test_validate_resume_missing_and_extra_keys() -> None:
    model_sd = tiny_model().state_dict()
    saved = dict(model_sd)
    del saved["2.bias"]
    saved["3.weight"] = torch.ones(1)
    ckpt = {"model": saved, "optimizer": {}, "epoch": 0}
    with pytest.raises(CheckpointError, match=r"2\.bias missing from checkpoint; 3\.weight not"):
        ck.validate_resume_checkpoint(ckpt, model_sd)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"optimizer": None}, "not a resumable training checkpoint: missing 'optimizer'"),
        ({"epoch": -1}, r"epoch=-1: this file holds weights, not a training state"),
        ({"version": 99}, "schema version 99 is newer"),
    ],
)
def test_validate_resume_not_resumable(change: dict, match: str) -> None:
    ckpt = {**training_state(), **change}
    with pytest.raises(CheckpointError, match=match):
        ck.validate_resume_checkpoint(ckpt, tiny_model().state_dict())


def test_weights_only_file_is_not_resumable() -> None:
    with pytest.raises(CheckpointError, match="missing 'optimizer', 'epoch'; use --weights"):
        ck.validate_resume_checkpoint({"model": tiny_model().state_dict()}, {})


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


def _fresh_training_objects():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    return model, opt, sched, torch.amp.GradScaler("cpu", init_scale=1024.0)


def _set(path: tuple, value):
    """A change to a training checkpoint: the value at ``path`` (keys) replaced, or removed
    when ``value`` is ``_DELETE``."""

    def change(ckpt: dict) -> None:
        *parents, last = path
        target = ckpt
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value(target[last]) if callable(value) else value

    return change


_DELETE = object()
_NAN = float("nan")

GARBAGE_STATES = {
    # name: (change, the one line's fragment)
    "optimizer_a_string": (_set(("optimizer",), "garbage"), "a str, not a dict"),
    "no_state": (_set(("optimizer", "state"), _DELETE), "damaged: no 'state'"),
    "no_param_groups": (_set(("optimizer", "param_groups"), _DELETE), "no 'param_groups'"),
    "state_a_list": (_set(("optimizer", "state"), []), "'state' is a list, not a dict"),
    "groups_of_another_length": (
        _set(("optimizer", "param_groups"), lambda g: g + g),
        "the optimizer state holds 12 parameters, this model's optimizer 6",
    ),
    "params_not_ids": (
        _set(("optimizer", "param_groups", 0, "params"), ["a", "b"]),
        "lists parameters by non-integers",
    ),
    "nan_lr": (_set(("optimizer", "param_groups", 0, "lr"), _NAN), "param group 0: lr nan"),
    "string_lr": (_set(("optimizer", "param_groups", 0, "lr"), "0.01"), "lr '0.01'"),
    "negative_lr": (_set(("optimizer", "param_groups", 0, "lr"), -1.0), "lr -1.0"),
    "string_momentum": (
        _set(("optimizer", "param_groups", 0, "momentum"), "fast"),
        "momentum 'fast'",
    ),
    "wrong_shape": (
        _set(("optimizer", "state", 0, "momentum_buffer"), torch.zeros(7)),
        "parameter 0 momentum_buffer (7,) vs the parameter's (4, 3, 3, 3)",
    ),
    "wrong_dtype": (
        _set(
            ("optimizer", "state", 0, "momentum_buffer"), torch.zeros(4, 3, 3, 3, dtype=torch.int64)
        ),
        "parameter 0: momentum_buffer (a int64 tensor of shape (4, 3, 3, 3))",
    ),
    "string_for_a_tensor": (
        _set(("optimizer", "state", 0, "momentum_buffer"), "abc"),
        "parameter 0: momentum_buffer 'abc'",
    ),
    "nan_in_a_buffer": (
        _set(("optimizer", "state", 0, "momentum_buffer"), lambda t: t * _NAN),
        "parameter 0 momentum_buffer holds NaN or inf",
    ),
    "state_of_no_parameter": (
        _set(("optimizer", "state", 99), {"momentum_buffer": torch.zeros(1)}),
        "state of parameter 99, which no group holds",
    ),
    "scheduler_epoch_a_string": (
        _set(("scheduler", "last_epoch"), "x"),
        "scheduler state is damaged: last_epoch 'x'",
    ),
    "scheduler_nan_base_lr": (
        _set(("scheduler", "base_lrs"), [_NAN]),
        "scheduler state is damaged: base_lrs [nan]",
    ),
    "scheduler_a_list": (_set(("scheduler",), [1, 2]), "'scheduler' is a list, not a Mapping"),
    "ema_of_another_model": (
        _set(("ema",), tiny_model(width=8).state_dict()),
        "the EMA weights do not fit the model (0.weight)",
    ),
    "ema_updates_negative": (_set(("ema_updates",), -5), "ema_updates -5 must be in 0.."),
    "epoch_of_400_digits": (_set(("epoch",), 10**400), "epoch 1000000000000"),
    "best_fitness_a_string": (
        _set(("best_fitness",), "high"),
        "best_fitness 'high' must be a finite number",
    ),
    "budget_nan": (_set(("budget_spent_s",), _NAN), "budget_spent_s nan must be a finite"),
    "cfg_not_text": (_set(("cfg",), 42), "'cfg' is a int, not a str"),
    "amp_scale_nan": (_set(("scaler", "scale"), _NAN), "the AMP scale nan"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE_STATES))
def test_a_damaged_training_state_is_one_checkpoint_error(tmp_path: Path, case: str) -> None:
    """Whatever a damaged or hand-edited checkpoint holds where the training state should be,
    resuming from it is one CheckpointError line, raised before any state is half restored."""
    change, fragment = GARBAGE_STATES[case]
    ckpt = training_state()
    ckpt["budget_spent_s"], ckpt["cfg"] = 1.0, "[net]\n"
    change(ckpt)
    path = tmp_path / "last.pt"
    ck.save_checkpoint(ckpt, path)
    loaded = ck.load_checkpoint(path)
    model, opt, sched, scaler = _fresh_training_objects()
    with pytest.raises(CheckpointError) as info:
        ck.validate_resume_checkpoint(loaded, model.state_dict(), path)
        ck.restore_training_state(loaded, model, opt, sched, scaler, None, path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message, message
    assert "\n" not in message and len(message) < 400


def test_an_undamaged_training_state_still_resumes(tmp_path: Path) -> None:
    ckpt = training_state()
    model, opt, sched, scaler = _fresh_training_objects()
    ck.validate_resume_checkpoint(ckpt, model.state_dict())
    assert ck.restore_training_state(ckpt, model, opt, sched, scaler) == (4, 0.25)
    assert opt.state_dict()["state"][0]["momentum_buffer"].shape == (4, 3, 3, 3)


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
