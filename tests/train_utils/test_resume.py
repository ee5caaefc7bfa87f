"""train_utils/resume.py: what --resume accepts (the model's weights, every recorded value, each
checked by the part that owns it) and how it puts the state back; one CheckpointError line for
anything damaged, before any state is half restored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoint import tiny_model
from test_checkpoint import training_state as numpy_training_state

from build_utils.errors import CheckpointError, ConfigError
from train_utils import checkpoint as ck
from train_utils import resume
from train_utils.engine import TrainState


def training_state() -> dict:
    """test_checkpoint's training state as a checkpoint file holds it (numpy values plain)."""
    return ck.to_plain(numpy_training_state())


def test_a_checkpoint_of_the_model_is_resumable_with_prefixes_stripped() -> None:
    ckpt = training_state()
    weights = ckpt["model"]
    ckpt["model"] = {f"module.{k}": v for k, v in weights.items()}  # saved from a DDP wrapper
    sd = resume.check_resumable(ckpt, tiny_model(width=4).state_dict())
    assert list(sd) == list(weights) and all(torch.equal(sd[k], weights[k]) for k in weights)
    model = tiny_model()
    model.load_state_dict(sd)
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_validate_resume_other_model() -> None:
    ckpt = training_state()
    other = tiny_model(width=8).state_dict()
    with pytest.raises(CheckpointError) as info:
        resume.check_resumable(ckpt, other, path="runs/last.pt")
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
        resume.check_resumable(ckpt, model_sd)


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
        resume.check_resumable(ckpt, tiny_model().state_dict())


def test_weights_only_file_is_not_resumable() -> None:
    with pytest.raises(CheckpointError, match="missing 'optimizer', 'epoch'; use --weights"):
        resume.check_resumable({"model": tiny_model().state_dict()}, {})


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
    "epoch_of_400_digits": (_set(("epoch",), 10**400), "epoch 100000000000... (401 digits)"),
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
        resume.check_resumable(loaded, model.state_dict(), path)
        resume.restore_state(loaded, TrainState(model, model, opt, sched, scaler), path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message, message
    assert "\n" not in message and len(message) < 400


def test_an_undamaged_training_state_still_resumes(tmp_path: Path) -> None:
    ckpt = training_state()
    model, opt, sched, scaler = _fresh_training_objects()
    resume.check_resumable(ckpt, model.state_dict())
    loop = resume.restore_state(ckpt, TrainState(model, model, opt, sched, scaler))
    assert (loop.epoch, loop.best, loop.best_epoch) == (3, 0.25, 3)
    assert sched.last_epoch == 1 and scaler.get_scale() == 1024.0
    assert opt.state_dict()["state"][0]["momentum_buffer"].shape == (4, 3, 3, 3)


def _results(folder: Path, rows: list[tuple[int, str]]) -> None:
    lines = ["epoch,mAP50-95", *(f"{e},{v}" for e, v in rows)]
    (folder / "results.csv").write_text("\n".join(lines) + "\n")


def test_a_folder_holding_another_runs_results_is_refused(tmp_path: Path) -> None:
    # Was: `cp runs/a/last.pt runs/b/ && train.py --resume runs/b/last.pt` cut runs/b's
    # results.csv at a's epoch and replaced its best.pt with a's, without a word.
    last = tmp_path / "last.pt"
    ckpt = {"epoch": 2, "best_epoch": 1, "best_fitness": 0.25}
    _results(tmp_path, [(0, "0.125"), (1, "0.25"), (2, "0.2"), (3, "0.3")])
    resume.check_results_are_its_own(ckpt, last)  # its own run's (later rows: redone)
    _results(tmp_path, [(0, "0.5"), (1, "0.0009"), (2, "0.75")])
    with pytest.raises(ConfigError) as e:
        resume.check_results_are_its_own(ckpt, last)
    assert str(e.value) == (
        f"--resume {last}: {tmp_path / 'results.csv'} is another run's (epoch 1: mAP50-95 0.0009; "
        f"this checkpoint's best epoch 1 had mAP50-95 0.25): continuing there would mix the two "
        f"runs' files; resume the checkpoint from its own run's folder, or start a new run from "
        f"it with --weights {last}"
    )
    _results(tmp_path, [(0, "0.5")])  # a shorter run's
    with pytest.raises(ConfigError, match=r"is another run's \(epoch 1: no row;"):
        resume.check_results_are_its_own(ckpt, last)


@pytest.mark.parametrize("ckpt", [{"epoch": 0, "best_fitness": None}, {"epoch": 0}])
def test_results_are_not_judged_without_an_evaluation_or_a_file(tmp_path: Path, ckpt) -> None:
    last = tmp_path / "last.pt"
    resume.check_results_are_its_own({"epoch": 0, "best_fitness": 0.5}, last)  # no results.csv
    _results(tmp_path, [(0, "0.1")])
    resume.check_results_are_its_own(ckpt, last)  # never evaluated: nothing to judge by


def test_a_darknet_recipe_cfg_with_other_net_keys_points_at_last_weights() -> None:
    """--recipe darknet: raising max_batches is trained on from last.weights (its seen count),
    as Darknet does, not from last.pt (which starts at iteration 0)."""
    saved = "[net]\nwidth=64\nmax_batches=1\n\n[maxpool]\nsize=1\n"
    edited = saved.replace("max_batches=1", "max_batches=3")
    with pytest.raises(CheckpointError) as e:
        resume.check_resume_cfg(
            saved, edited, "t.cfg", "runs/x/model.cfg", "runs/x/last.pt", "darknet"
        )
    assert str(e.value) == (
        "runs/x/last.pt: --cfg t.cfg is not the checkpoint's: its training keys differ: at [net], "
        "'max_batches=1' in the checkpoint, 'max_batches=3' in the cfg; resume with the run's own "
        "cfg (--cfg runs/x/model.cfg), or start a new run from these weights with --weights "
        "runs/x/last.weights (it continues at its iteration)"
    )
    with pytest.raises(
        CheckpointError, match=r"is another model than the checkpoint's: at \[net\]"
    ):
        resume.check_resume_cfg(saved, edited, "t.cfg", "runs/x/model.cfg", "runs/x/last.pt")
