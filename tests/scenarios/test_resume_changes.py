"""``--resume`` with changed flags: what can change does (with a warning saying what changed),
what cannot (another optimizer's state, another model by its cfg text) is one line, exit 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import HYP_YAML, NANO_CFG, read_results, run_training, train_argv

import train as train_script
from build_utils.errors import ConfigError
from models.darknet import Darknet
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint
from train_utils.config import load_hyp
from train_utils.optim import build_optimizer, load_optimizer_state, lr_lambda

IMG = 64


def _argv(data: Path, out: Path, *extra: str, **kw) -> list[str]:
    return train_argv(data, out, *extra, **{"img": IMG, "batch": 8, "nbs": 8, **kw})


@pytest.fixture(scope="module")
def one_epoch(shapes_data, tmp_path_factory) -> Path:
    """A finished 1-epoch run (no freeze, SGD) of the nano cfg; tests copy it."""
    out = tmp_path_factory.mktemp("one_epoch") / "run"
    run_training(_argv(shapes_data, out))
    return out


def _copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


def _resume(data: Path, run: Path, *extra: str, cfg: Path = NANO_CFG) -> list[str]:
    """Continue ``run`` for a second epoch, the first run's flags typed again (as a user would),
    with ``extra`` on top."""
    return _argv(data, run, "--resume", str(run / "last.pt"), *extra, cfg=cfg, epochs=2)


@pytest.mark.slow
def test_changed_optimizer_is_one_line(shapes_data, one_epoch, tmp_path, capsys, console):
    run = _copy_run(one_epoch, tmp_path)
    code = train_script.main(_resume(shapes_data, run, "--optimizer", "adam"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err
    assert len(errors) == 1 and "holds sgd optimizer state" in errors[0], err
    assert f"--weights {run / 'last.pt'}" in errors[0]
    assert load_checkpoint(run / "last.pt")["epoch"] == 0  # nothing written over


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [("none", "backbone"), ("backbone", "none")])
def test_changed_freeze_resumes(shapes_data, tmp_path, caplog, before, after):
    run = tmp_path / "run"
    run_training(_argv(shapes_data, run, "--freeze-layers", before))
    first = load_checkpoint(run / "last.pt")
    with caplog.at_level("WARNING"):
        run_training(_resume(shapes_data, run, "--freeze-layers", after))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"freeze_layers: '{before}' -> '{after}'" in said
    second = load_checkpoint(run / "last.pt")
    assert second["epoch"] == 1

    model = Darknet(_blocks(second["cfg"]), img_size=(IMG, IMG))
    frozen = set(model.freeze("backbone"))
    backbone = [
        k for k in first["train_model"] if int(k.split(".")[1]) in frozen and "num_batches" not in k
    ]
    heads = [k for k in first["train_model"] if k.endswith("weight") and k not in backbone]
    assert backbone and heads
    moved = {
        k for k in backbone if not torch.equal(first["train_model"][k], second["train_model"][k])
    }
    # Frozen in the resumed epoch: not one backbone tensor moves; unfrozen: they train again.
    assert (moved == set()) is (after == "backbone")
    assert any(not torch.equal(first["train_model"][k], second["train_model"][k]) for k in heads)
    # The optimizer holds every parameter whatever the freeze; the momentum of the parameters
    # trained before a freeze is kept, untouched, for when they train again.
    n_params = sum(1 for _ in model.parameters())
    assert sum(len(g["params"]) for g in second["optimizer"]["param_groups"]) == n_params
    if after == "backbone":
        frozen_ids = _frozen_ids(model, frozen)
        for i, state in first["optimizer"]["state"].items():
            if i in frozen_ids:
                assert torch.equal(
                    state["momentum_buffer"], second["optimizer"]["state"][i]["momentum_buffer"]
                )


def _blocks(cfg_text: str):
    from build_utils.parse_config import parse_model_cfg_text

    return parse_model_cfg_text(cfg_text, "checkpoint")


def _frozen_ids(model: Darknet, frozen: set[int]) -> set[int]:
    """Optimizer state ids (positions in the optimizer's groups) of the frozen layers' params."""
    opt = build_optimizer(model, load_hyp(HYP_YAML), 0.01)
    params = [p for g in opt.param_groups for p in g["params"]]
    in_frozen = {id(p) for i in frozen for p in model.module_list[i].parameters()}
    return {k for k, p in enumerate(params) if id(p) in in_frozen}


@pytest.mark.slow
def test_cfg_edited_in_place_is_refused(shapes_data, one_epoch, tmp_path, capsys, console):
    run = _copy_run(one_epoch, tmp_path)
    cfg = tmp_path / "edited.cfg"
    text = NANO_CFG.read_text()
    # The second [convolutional]'s activation: the same tensor shapes, another network.
    first = text.index("activation=leaky")
    second = text.index("activation=leaky", first + 1)
    cfg.write_text(text[:second] + "activation=mish" + text[second + len("activation=leaky") :])
    code = train_script.main(_resume(shapes_data, run, cfg=cfg))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err
    assert len(errors) == 1, err
    assert (
        "[convolutional] layer 1, 'activation=leaky' in the checkpoint, 'activation=mish'"
        in (errors[0])
    )
    assert f"--cfg {run / 'model.cfg'}" in errors[0]
    assert load_checkpoint(run / "last.pt")["epoch"] == 0


@pytest.mark.slow
def test_same_cfg_elsewhere_is_quiet(shapes_data, one_epoch, tmp_path, capsys, console):
    run = _copy_run(one_epoch, tmp_path)
    cfg = tmp_path / "elsewhere" / "copy.cfg"
    cfg.parent.mkdir()
    shutil.copy(NANO_CFG, cfg)
    code = train_script.main(_resume(shapes_data, run, cfg=cfg))
    err = capsys.readouterr().err
    assert code == 0, err
    differs = [line for line in err.splitlines() if "differs from the checkpoint" in line]
    assert differs and not [m for m in differs if "cfg: '" in m], differs  # epochs: 1 -> 2 only
    assert load_checkpoint(run / "last.pt")["epoch"] == 1


def test_optimizer_state_of_an_older_frozen_checkpoint_is_placed_by_parameter():
    """Older checkpoints held the trainable parameters only: their state goes to the same
    parameters of an optimizer that holds every one."""
    hyp = load_hyp(HYP_YAML)
    torch.manual_seed(0)
    model = Darknet(NANO_CFG, img_size=(IMG, IMG))
    model.freeze("backbone")
    groups = [
        {**g, "params": [p for p in g["params"] if p.requires_grad]}
        for g in build_optimizer(model, hyp, 0.01).param_groups
    ]
    old = torch.optim.SGD(groups, lr=0.01, momentum=0.9, nesterov=True)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    old.step()
    new = build_optimizer(model, hyp, 0.01)
    load_optimizer_state(new, old.state_dict())
    for g_old, g_new in zip(old.param_groups, new.param_groups, strict=True):
        assert len(g_new["params"]) > len(g_old["params"])
        for p in g_new["params"]:
            if p.requires_grad:
                assert torch.equal(new.state[p]["momentum_buffer"], old.state[p]["momentum_buffer"])
            else:
                assert p not in new.state


@pytest.mark.slow
def test_a_longer_plan_trains_at_its_own_rate_from_the_first_resumed_epoch(
    shapes_data, one_epoch, tmp_path, monkeypatch
):
    """A finished 1-epoch run resumed with --epochs 3 trains epoch 1 at the 3-epoch cosine
    schedule's rate, not at the end of the 1-epoch schedule (was: lr0 * lrf, then a jump)."""
    run = _copy_run(one_epoch, tmp_path)
    seen: dict[int, float] = {}
    real = trainer_module.train_one_epoch

    def record(state, loader, epoch, opts):
        seen[epoch] = state.scheduler.get_last_lr()[0]
        return real(state, loader, epoch, opts)

    monkeypatch.setattr(trainer_module, "train_one_epoch", record)
    run_training(_argv(shapes_data, run, "--resume", str(run / "last.pt"), epochs=3))
    hyp = load_hyp(HYP_YAML)
    schedule = lr_lambda(3, hyp["lrf"])
    assert sorted(seen) == [1, 2]
    for epoch, lr in seen.items():
        assert lr == pytest.approx(hyp["lr0"] * schedule(epoch), rel=1e-12), epoch


@pytest.mark.slow
def test_an_earlier_epoch_resumed_into_a_new_folder_keeps_its_history(
    shapes_data, tmp_path, monkeypatch
):
    """--resume of epoch0.pt beside a later last.pt writes run2 (the later epochs kept), which
    starts with epoch 0's results row and best.pt (was: neither). A checkpoint that finished
    its epochs makes no such folder: there is nothing to train in it (was: run2 with a best.pt
    and no last.pt)."""
    run = tmp_path / "run"
    run_training(_argv(shapes_data, run, "--save-period", "1", epochs=2))
    first = read_results(run / "results.csv")
    with pytest.raises(ConfigError, match="already finished all 2 epochs: nothing to resume"):
        run_training(["--resume", str(run / "epoch1.pt"), "--device", "cpu"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as epoch 1 starts: what run2 holds before it trains

    monkeypatch.setattr(trainer_module, "train_one_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_training(["--resume", str(run / "epoch0.pt"), "--device", "cpu"])
    new = tmp_path / "run2"
    assert read_results(new / "results.csv") == first[:1]
    assert load_checkpoint(new / "best.pt")["epoch"] == 0
    assert (new / "best.pt").read_bytes() == (run / "epoch0.pt").read_bytes()
    assert [r["epoch"] for r in read_results(run / "results.csv")] == ["0", "1"]  # kept
