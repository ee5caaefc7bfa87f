"""The flags a YOLOv5 user types: --imgsz/--img/--batch, --project/--name, --optimizer
SGD|Adam|AdamW (and the old --adam), --cos-lr/--linear-lr, --label-smoothing, --save-period;
each checked against an independent computation, and runs of older versions still resume."""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import HYP_YAML, NANO_CFG, read_results, run_training, train_argv, validation_argv
from torch import nn

import predict
import validation
from build_utils.errors import ConfigError
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes
from models.darknet import Darknet
from models.loss import compute_loss
from train_utils.checkpoint import load_checkpoint, save_checkpoint
from train_utils.cli import parse_args
from train_utils.config import build_config, get_args_parser, load_hyp
from train_utils.distributed.process_group import DistInfo
from train_utils.optim import build_optimizer, build_scheduler, lr_lambda, optimizer_kind
from train_utils.rounds import keeps_epoch
from train_utils.trainer import run

IMG = 64
CPU = torch.device("cpu")
# Fields added by this change: a checkpoint of an older version records none of them.
NEW_FIELDS = ("lr_schedule", "label_smoothing", "save_period")


def _base(data: Path) -> list[str]:
    return ["--data", str(data), "--cfg", str(NANO_CFG), "--hyp", str(HYP_YAML)]


def test_yolov5_spellings_parse_to_the_same_settings(shapes_data):
    parse = get_args_parser().parse_args
    args = parse([*_base(shapes_data), "--imgsz", "160", "--batch", "8"])
    assert (args.img_size, args.batch_size) == (160, 8)
    assert parse([*_base(shapes_data), "--img", "96"]).img_size == 96
    for typed, stored in [("SGD", "sgd"), ("Adam", "adam"), ("AdamW", "adamw"), ("adamw", "adamw")]:
        assert parse([*_base(shapes_data), "--optimizer", typed]).optimizer == stored
    assert parse(_base(shapes_data)).optimizer == "sgd"
    assert parse([*_base(shapes_data), "--adam"]).optimizer == "adam"
    assert parse(_base(shapes_data)).lr_schedule == "cosine"
    assert parse([*_base(shapes_data), "--cos-lr"]).lr_schedule == "cosine"
    assert parse([*_base(shapes_data), "--linear-lr"]).lr_schedule == "linear"
    # YOLOv5's --noautoanchor (was: "unrecognized arguments", though the README named it).
    assert parse([*_base(shapes_data), "--noautoanchor"]).autoanchor is False
    assert parse([*_base(shapes_data), "--autoanchor"]).autoanchor is True
    val = validation.get_parser().parse_args(["--weights", "w.pt", "--batch", "3", "--imgsz", "64"])
    assert (val.batch_size, val.img_size) == (3, 64)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--adam", "--optimizer", "sgd"], "--optimizer: not allowed with argument --adam"),
        (["--cos-lr", "--linear-lr"], "argument --linear-lr: not allowed with argument --cos-lr"),
        (["--optimizer", "rmsprop"], "adamw"),
    ],
)
def test_contradicting_or_unknown_choices_exit_2(shapes_data, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        get_args_parser().parse_args([*_base(shapes_data), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--label-smoothing", "1"], r"--label-smoothing must be a number in \[0, 1\), got 1.0"),
        (["--label-smoothing", "-0.1"], "--label-smoothing must be a number in"),
        (["--save-period", "-2"], "--save-period must be >= -1, got -2"),
        # Were tracebacks from numpy's and torch's generators, after the run folder was made.
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--seed", str(10**23)], r"--seed must be in \[0, 9223372036854775807\], got 1000"),
        (["--project", "p", "--output-dir", "o"], "--output-dir is the run folder itself"),
    ],
)
def test_bad_values_are_one_config_error(shapes_data, argv, message):
    with pytest.raises(ConfigError, match=message):
        build_config(get_args_parser().parse_args([*_base(shapes_data), *argv]))


def test_project_and_name_choose_the_run_folder(shapes_data, tmp_path):
    def folder(*argv: str) -> tuple[Path, bool]:
        config = build_config(get_args_parser().parse_args([*_base(shapes_data), *argv]))
        return config.output_dir, config.auto_named

    proj = tmp_path / "runs" / "train"
    assert folder("--project", str(proj), "--name", "exp") == (proj / "exp", False)
    assert folder("--project", str(proj)) == (proj / "exp", False)  # YOLOv5's default name
    assert folder("--name", "x") == (Path("runs") / "x", False)
    assert folder("--output-dir", str(tmp_path / "o")) == (tmp_path / "o", False)
    out, auto = folder()
    assert out.parent == Path("runs") and auto
    assert folder("--project", str(proj), "--name", "a/b") == (proj / "a" / "b", False)


@pytest.mark.parametrize("name", ["..", "../x", "a/../../x", ".", "/abs/run"])
@pytest.mark.parametrize("project", [[], ["--project", "p"]])
def test_a_name_that_leaves_the_project_is_refused(shapes_data, name, project):
    """``--name ..`` wrote the run's files into the project's parent (the working folder, with
    the user's own files in it); an absolute name anywhere."""
    args = get_args_parser().parse_args([*_base(shapes_data), *project, "--name", name])
    with pytest.raises(ConfigError, match=r"--name .* would leave --project"):
        build_config(args)


def test_adamw_decays_conv_weights_decoupled_and_nothing_else():
    """One AdamW step against the formula: p - lr * wd * p - lr * g / (|g| + eps) for conv
    weights (the first step's bias-corrected moments are g and g^2), no decay for BN and bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    hyp = {"weight_decay": 0.1, "momentum": 0.9}
    lr = 0.01
    opt = build_optimizer(model, hyp, lr, "adamw")
    assert isinstance(opt, torch.optim.AdamW) and optimizer_kind(opt.state_dict()) == "adamw"
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"bn": 0.0, "weights": 0.1, "bias": 0.0}
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.rand(2, 3, 8, 8)).square().mean().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    conv_weights = {id(model[0].weight), id(model[2].weight)}
    for p, p0, g in zip(model.parameters(), before, grads):
        wd = 0.1 if id(p) in conv_weights else 0.0
        expected = p0 * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
    # Adam's state is not AdamW's: the two are told apart (a resume refuses to mix them).
    assert optimizer_kind(build_optimizer(model, hyp, lr, "adam").state_dict()) == "adam"


def test_linear_schedule_is_yolov5s_and_cosine_is_unchanged():
    epochs, lrf, lr0 = 10, 0.1, 0.01
    params = [nn.Parameter(torch.zeros(1))]
    opt_linear, opt_cosine = torch.optim.SGD(params, lr=lr0), torch.optim.SGD(params, lr=lr0)
    linear = build_scheduler(opt_linear, epochs, lrf, "linear")
    cosine = build_scheduler(opt_cosine, epochs, lrf)
    for epoch in range(epochs + 2):
        x = min(epoch, epochs)
        assert linear.get_last_lr()[0] == pytest.approx(lr0 * ((1 - x / epochs) * (1 - lrf) + lrf))
        # The default is the lineage's cosine, bit for bit.
        assert cosine.get_last_lr()[0] == lr0 * lr_lambda(epochs, lrf)(epoch)
        cos = ((1 + math.cos(x * math.pi / epochs)) / 2) * (1 - lrf) + lrf
        assert cosine.get_last_lr()[0] == pytest.approx(lr0 * cos)
        opt_linear.step(), opt_cosine.step()  # no gradients: only the scheduler's order matters
        linear.step(), cosine.step()


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("anchor_vec", torch.tensor([[1.0, 1.0]]))
        self.stride = 8.0


class _Model(nn.Module):
    nc = 3
    yolo_layers = (0,)

    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList([_Head()])


def test_label_smoothing_class_targets_match_an_independent_bce():
    """One target, one anchor: the class loss is the mean BCE against 1 - eps/2 (its class)
    and eps/2 (the others), computed here from the logits directly."""
    eps = 0.2
    hyp = dict(load_hyp(HYP_YAML), cls=1.0, cls_pw=1.0, fl_gamma=0.0, iou_t=0.0)
    torch.manual_seed(0)
    pred = torch.randn(1, 1, 2, 2, 5 + _Model.nc)
    targets = torch.tensor([[0.0, 2.0, 0.3, 0.6, 0.2, 0.2]])  # class 2, centre in cell (0, 1)
    loss = compute_loss([pred], targets, _Model(), hyp, label_smoothing=eps)["cls_loss"]
    logits = pred[0, 0, 1, 0, 5:]
    t = torch.tensor([eps / 2, eps / 2, 1 - eps / 2])
    p = torch.sigmoid(logits)
    expected = -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()
    torch.testing.assert_close(loss, expected)
    plain = compute_loss([pred], targets, _Model(), hyp)["cls_loss"]
    one_hot = torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(plain, nn.functional.binary_cross_entropy(p, one_hot))


def test_save_period_epochs():
    assert [e for e in range(7) if keeps_epoch(e, 3)] == [2, 5]
    assert [e for e in range(3) if keeps_epoch(e, 1)] == [0, 1, 2]
    assert not any(keeps_epoch(e, n) for e in range(5) for n in (0, -1))


def _resume(path: Path, *extra: str):
    """``train.py --resume PATH`` (and ``extra``), as typed: every other flag from the run."""
    config = build_config(parse_args(get_args_parser(), ["--resume", str(path), *extra]))
    return run(config, DistInfo.single(CPU))


def _run_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return train_argv(data, out, *extra, img=IMG, batch=8, nbs=8, epochs=2)


def _same_weights(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca["epoch"] == cb["epoch"]
    for key in ("model", "train_model"):
        assert ca[key].keys() == cb[key].keys()
        for k in ca[key]:
            assert torch.equal(ca[key][k], cb[key][k]), (key, k)


@pytest.mark.slow
def test_save_period_checkpoints_resume_exactly(make_shapes_data, tmp_path):
    """A 2-epoch AdamW, linear-LR, label-smoothed run with --save-period 1 keeps epoch0.pt and
    epoch1.pt; ``--resume epoch0.pt`` alone continues with the run's own optimizer, schedule and
    smoothing in a new folder (the finished run is not written over) and ends where the
    uninterrupted run ended."""
    data = make_shapes_data()
    full = tmp_path / "full"
    extra = ("--save-period", "1", "--optimizer", "AdamW", "--linear-lr")
    summary = run_training(_run_argv(data, full, *extra, "--label-smoothing", "0.1"))
    assert summary.output_dir == full
    assert {p.name for p in full.glob("epoch*.pt")} == {"epoch0.pt", "epoch1.pt"}
    assert load_checkpoint(full / "epoch0.pt")["epoch"] == 0
    _same_weights(full / "epoch1.pt", full / "last.pt")
    last_before = (full / "last.pt").read_bytes()

    config = build_config(parse_args(get_args_parser(), ["--resume", str(full / "epoch0.pt")]))
    assert (config.optimizer, config.lr_schedule, config.label_smoothing) == (
        "adamw",
        "linear",
        0.1,
    )
    resumed = _resume(full / "epoch0.pt")
    assert resumed.output_dir == tmp_path / "full2"
    assert (full / "last.pt").read_bytes() == last_before  # the finished run is kept whole
    _same_weights(full / "last.pt", resumed.output_dir / "last.pt")
    # --exist-ok: in the run's own folder, the previous run (epoch0.pt with it) moved aside.
    again = _resume(full / "epoch0.pt", "--exist-ok")
    assert again.output_dir == full
    (moved,) = full.glob("replaced-*")
    assert (moved / "last.pt").read_bytes() == last_before
    _same_weights(moved / "last.pt", full / "last.pt")


@pytest.mark.slow
def test_checkpoint_of_an_older_version_resumes_exactly(make_shapes_data, tmp_path):
    """A checkpoint whose recorded arguments lack the new fields (and name its optimizer in the
    old lowercase spelling) resumes as that version trained: SGD, cosine, no smoothing, no
    periodic saves; the result equals the uninterrupted run. The run is started with YOLOv5's
    spellings (--imgsz, --batch, --project/--name)."""
    data = make_shapes_data()
    argv = train_argv(data, tmp_path / "unused", img=None, batch=None, epochs=2, nbs=8)
    cut = argv.index("--output-dir")
    argv[cut : cut + 2] = ["--project", str(tmp_path / "runs" / "train"), "--name", "exp"]
    argv += ["--imgsz", str(IMG), "--batch", "8", "--save-period", "1"]
    full = run_training(argv).output_dir
    assert full == tmp_path / "runs" / "train" / "exp"
    config = build_config(
        parse_args(get_args_parser(), ["--project", str(full.parent), "--resume"])
    )
    assert config.output_dir == full  # bare --resume: the newest last.pt under --project
    # --resume with --project/--name: that run's own arguments (not the default data file),
    # that run even when another one under --project is newer.
    (full.parent / "newer").mkdir()
    (full.parent / "newer" / "last.pt").write_bytes((full / "epoch0.pt").read_bytes())
    by_name = ["--project", str(full.parent), "--name", "exp", "--resume"]
    config = build_config(parse_args(get_args_parser(), by_name))
    assert config.output_dir == full and config.resume == str(full / "last.pt")
    assert config.data.path == data and config.img_size == IMG and config.batch_size == 8
    old = tmp_path / "old"
    ckpt = load_checkpoint(full / "epoch0.pt")
    for key in NEW_FIELDS:
        del ckpt["config"][key]
    assert ckpt["config"]["optimizer"] == "sgd"
    old.mkdir()
    save_checkpoint(ckpt, old / "last.pt")
    (old / "hyp.yaml").write_bytes((full / "hyp.yaml").read_bytes())

    config = build_config(parse_args(get_args_parser(), ["--resume", str(old / "last.pt")]))
    assert (config.lr_schedule, config.label_smoothing, config.save_period) == ("cosine", 0.0, -1)
    resumed = _resume(old / "last.pt")
    assert resumed.output_dir == old  # its own last.pt: continued in place
    assert not list(old.glob("epoch*.pt"))
    _same_weights(full / "last.pt", old / "last.pt")


@pytest.fixture(scope="module")
def nano_checkpoint(tmp_path_factory) -> Path:
    """A 5-class nano model carrying its cfg and class names (no run: flags give the rest)."""
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 5)
    torch.manual_seed(0)
    model = Darknet(blocks, img_size=(IMG, IMG))
    path = tmp_path_factory.mktemp("nano") / "model.pt"
    names = ["circle", "square", "triangle", "star", "cross"]
    save_checkpoint({"model": model.state_dict(), "epoch": -1, "names": names}, path)
    return path


def test_validation_and_predict_take_project_and_name(
    shapes_data, nano_checkpoint, tmp_path, capsys
):
    """``--project DIR --name exp`` writes DIR/exp, then DIR/exp2 (YOLOv5's numbering);
    ``--exist-ok`` reuses DIR/exp; with the script's own folder flag it is one line, exit 2."""
    val = validation_argv(NANO_CFG, shapes_data, nano_checkpoint, img=IMG)
    project = tmp_path / "runs" / "val"
    for _ in range(2):
        assert validation.main([*val, "--project", str(project), "--name", "exp"]) == 0
    assert sorted(p.name for p in project.iterdir()) == ["exp", "exp2"]
    assert (project / "exp2" / "per_class.csv").is_file()
    assert validation.main([*val, "--project", str(project), "--exist-ok"]) == 0
    assert sorted(p.name for p in project.iterdir()) == ["exp", "exp2"]

    image = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    pred = ["--weights", str(nano_checkpoint), "--cfg", str(NANO_CFG), "--source", str(image)]
    pred += ["--img-size", str(IMG), "--device", "cpu"]
    detect = tmp_path / "runs" / "detect"
    for _ in range(2):
        assert predict.main([*pred, "--project", str(detect), "--name", "exp"]) == 0
    assert (detect / "exp" / image.name).is_file() and (detect / "exp2" / image.name).is_file()
    capsys.readouterr()

    for main, argv, flag in [
        (validation.main, [*val, "--save-dir", str(tmp_path / "v")], "--save-dir"),
        (predict.main, [*pred, "--output", str(tmp_path / "p")], "--output"),
    ]:
        assert main([*argv, "--name", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: {flag} is the output folder itself, --project/--name its parent and "
            "name: give one or the other"
        ]
    assert not (tmp_path / "v").exists() and not (tmp_path / "p").exists()
    inner = tmp_path / "runs" / "inner"
    for main, argv in [(validation.main, val), (predict.main, pred)]:
        assert main([*argv, "--project", str(inner), "--name", "../up"]) == 2
        assert "would leave --project" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "up").exists()


def test_predict_nosave_writes_labels_only(shapes_data, nano_checkpoint, tmp_path, capsys):
    """YOLOv5's ``detect.py --nosave``: was "unrecognized arguments", exit 2. Now no drawn
    picture or video; --save-txt's labels still written; alone, no folder is left."""
    folder = shapes_data.parent / "val" / "images"
    clip = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"mp4v"), 5, (IMG, IMG))
    for i in range(2):
        writer.write(np.full((IMG, IMG, 3), 60 * i, np.uint8))
    writer.release()
    pred = ["--weights", str(nano_checkpoint), "--cfg", str(NANO_CFG), "--img-size", str(IMG)]
    pred += ["--device", "cpu", "--source", str(folder), str(clip), "--nosave"]
    out = tmp_path / "out"
    assert predict.main([*pred, "--save-txt", "--output", str(out)]) == 0
    images = sorted(p.stem for p in folder.glob("*.jpg"))
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == sorted(
        [f"labels/clip_{n}.txt" for n in (1, 2)] + [f"labels/images/{s}.txt" for s in images]
    )
    assert predict.main([*pred, "--output", str(tmp_path / "none")]) == 0
    assert not (tmp_path / "none").exists()
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            f"{len(images)} images and 2 video frames predicted (--nosave: no drawn pictures) "
            "(nothing written)"
        )
    )


@pytest.mark.slow
def test_a_yolov5_command_trains_and_a_second_run_gets_exp2(shapes_data, tmp_path, monkeypatch):
    """The issue's acceptance: ``train.py --data shapes.yaml --imgsz 64 --batch 8 --project
    runs/train --name exp`` (a YOLOv5 data.yaml and YOLOv5's flags) trains; the same command again
    writes runs/train/exp2 and leaves exp as it was."""
    import train

    names = (shapes_data.parent / "shapes.names").read_text().split()
    yaml = tmp_path / "shapes.yaml"
    yaml.write_text(
        f"path: {shapes_data.parent}\ntrain: train/images\nval: val/images\nnames: {names}\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["--data", "shapes.yaml", "--imgsz", "64", "--batch", "8", "--project", "runs/train"]
    argv += ["--name", "exp", "--cfg", str(NANO_CFG), "--epochs", "1", "--workers", "0"]
    argv += ["--no-multi-scale", "--hyp", str(HYP_YAML)]
    assert train.main(argv) == 0
    exp = tmp_path / "runs" / "train" / "exp"
    first = {p.name: p.read_bytes() for p in exp.iterdir() if p.is_file() and p.suffix == ".pt"}
    assert set(first) == {"last.pt", "best.pt"}
    run_args = load_checkpoint(exp / "last.pt")["config"]
    assert (run_args["img_size"], run_args["batch_size"]) == (64, 8)
    assert len(read_results(exp / "results.csv")) == 1
    assert train.main(argv) == 0
    assert sorted(p.name for p in exp.parent.iterdir()) == ["exp", "exp2"]
    assert {n: (exp / n).read_bytes() for n in first} == first  # exp untouched
    assert len(read_results(exp.parent / "exp2" / "results.csv")) == 1


# ---- the flags of YOLOv5's train.py that were refused before ---------------------------------

YOLOV5_HYP = """lr0: 0.01
lrf: 0.01
momentum: 0.937
weight_decay: 0.0005
warmup_epochs: 3.0
warmup_momentum: 0.8
warmup_bias_lr: 0.1
box: 0.05
cls: 0.5
cls_pw: 1.0
obj: 1.0
obj_pw: 1.0
iou_t: 0.20
anchor_t: 4.0
fl_gamma: 0.0
hsv_h: 0.015
hsv_s: 0.7
hsv_v: 0.4
degrees: 0.0
translate: 0.1
scale: 0.5
shear: 0.0
perspective: 0.0
flipud: 0.0
fliplr: 0.5
mosaic: 1.0
mixup: 0.0
copy_paste: 0.0
"""


def test_a_yolov5_hyp_file_is_taken_with_a_line_per_mapped_key(tmp_path, caplog):
    """hyp.scratch-low.yaml as YOLOv5 ships it (was: refused one unknown key per run)."""
    path = tmp_path / "hyp.scratch-low.yaml"
    path.write_text(YOLOV5_HYP)
    with caplog.at_level("INFO"):
        hyp = load_hyp(path)
    assert (hyp["giou"], hyp["cls"], hyp["obj"]) == (0.05, 0.5, 1.0)
    assert (hyp["warmup_momentum"], hyp["anchor_t"], hyp["mosaic"]) == (0.8, 4.0, True)
    said = [r.getMessage() for r in caplog.records]
    assert f"{path}:8: YOLOv5's 'box' is this project's 'giou'" in said[0]
    assert [line.split(": ", 1)[1] for line in said[1:]] == [
        "perspective: 0 (YOLOv5's, off; not offered here)",
        "mixup: 0 (YOLOv5's, off; not offered here)",
        "copy_paste: 0 (YOLOv5's, off; not offered here)",
    ]


def test_every_unknown_hyp_key_is_named_at_once(tmp_path):
    path = tmp_path / "hyp.yaml"
    text = HYP_YAML.read_text() + "lr_0: 1\nmomentum_2: 0.9\nanchors: 3\n"
    path.write_text(text)
    first = len(HYP_YAML.read_text().splitlines()) + 1
    with pytest.raises(ConfigError) as info:
        load_hyp(path)
    assert str(info.value).startswith(
        f"{path}:{first}: unknown hyperparameters 'lr_0' (line {first}), 'momentum_2' "
        f"(line {first + 1}), 'anchors' (line {first + 2}); known keys: giou, "
    )


@pytest.mark.parametrize("key", ["perspective", "mixup", "copy_paste"])
def test_a_yolov5_augmentation_not_offered_here_is_refused_when_on(tmp_path, key):
    path = tmp_path / "hyp.yaml"
    path.write_text(YOLOV5_HYP.replace(f"{key}: 0.0", f"{key}: 0.5"))
    with pytest.raises(ConfigError, match=f"'{key}' = 0.5: YOLOv5's {key} augmentation is not"):
        load_hyp(path)


def test_warmup_momentum_ramps_as_yolov5s(shapes_data):
    """YOLOv5's np.interp of the momentum from warmup_momentum to momentum over the warm-up."""
    from train_utils.engine import TrainOptions, _warm_up

    model = nn.Conv2d(3, 4, 3)
    hyp = {**load_hyp(HYP_YAML), "warmup_momentum": 0.8, "momentum": 0.9}
    optimizer = build_optimizer(model, hyp, 0.01)
    opts = TrainOptions(device=CPU, hyp=hyp, warmup_iters=10)
    for ni, want in ((0, 0.8), (5, 0.85), (10, 0.9)):
        _warm_up(optimizer, [0.01] * len(optimizer.param_groups), ni, opts)
        assert all(g["momentum"] == pytest.approx(want) for g in optimizer.param_groups), ni
    adam = build_optimizer(model, hyp, 0.01, "adam")
    _warm_up(adam, [0.01] * len(adam.param_groups), 0, opts)
    assert all(g["betas"] == (0.8, 0.999) for g in adam.param_groups)


@pytest.mark.parametrize(
    "argv, mode",
    [
        (["--freeze", "10"], "0-9"),
        (["--freeze", "0"], "none"),
        (["--freeze", "0", "1", "2"], "0,1,2"),
        (["--freeze-layers", "3-5,7"], "3-5,7"),
        (["--freeze-layers"], "all-but-heads"),
    ],
)
def test_yolov5_freeze_counts_and_layer_lists(shapes_data, tmp_path, argv, mode):
    argv = [*_base(shapes_data), "--output-dir", str(tmp_path), *argv]
    config = build_config(parse_args(get_args_parser(), argv))
    assert config.freeze_layers == mode
    model = Darknet(NANO_CFG)
    from models.darknet import frozen_layer_indices

    want = {"0-9": range(10), "none": [], "0,1,2": [0, 1, 2], "3-5,7": [3, 4, 5, 7]}
    if mode in want:
        assert frozen_layer_indices(model, mode) == list(want[mode])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--freeze", "-1"], "--freeze takes layer counts or indices >= 0"),
        (["--freeze-layers", "heads"], "--freeze-layers 'heads' is not one of none, backbone"),
        (["--freeze-layers", "5-2"], "freeze layers '5-2': 5-2 is not a range"),
        (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
    ],
)
def test_bad_yolov5_flag_values_are_one_line(shapes_data, tmp_path, argv, message):
    argv = [*_base(shapes_data), "--output-dir", str(tmp_path), *argv]
    with pytest.raises(ConfigError, match=message):
        build_config(parse_args(get_args_parser(), argv))


def test_freezing_more_layers_than_the_model_has_is_one_line():
    from models.darknet import frozen_layer_indices

    with pytest.raises(ConfigError, match=r"freeze layers '0-99': the model has layers 0-59"):
        frozen_layer_indices(Darknet(NANO_CFG), "0-99")


def test_autobatch_fits_a_line_through_the_measured_peaks():
    from train_utils.autobatch import fit_batch

    # 1 GiB fixed + 0.5 GiB an image; 60 % of 16 GiB = 9.6 GiB -> (9.6 - 1) / 0.5 = 17.2 -> 17
    gib = 2**30
    peaks = [gib + 0.5 * gib * b for b in (1, 2, 4, 8)]
    assert fit_batch((1, 2, 4, 8), peaks, 16 * gib, 0.6) == 17
    assert fit_batch((1, 2), [5 * gib, 5 * gib], 16 * gib, 0.6) == 1024  # no growth measured
    assert fit_batch((1, 2), [9 * gib, 10 * gib], 16 * gib, 0.6) == 1  # the floor


@pytest.mark.slow
def test_yolov5_train_flags_run_as_typed(shapes_data, tmp_path, caplog):
    """--batch -1 --freeze 10 --noval --nosave --noplots --sync-bn and a YOLOv5 hyp file in
    one run: batch 16 on the CPU (recorded for --resume), no pictures, no best.pt, last.pt."""
    hyp = tmp_path / "hyp.scratch-low.yaml"
    hyp.write_text(YOLOV5_HYP)
    out = tmp_path / "run"
    argv = train_argv(shapes_data, out, epochs=2, batch=None, hyp=hyp, img=IMG)
    argv += ["--batch", "-1", "--freeze", "10", "--noval", "--nosave", "--noplots", "--sync-bn"]
    with caplog.at_level("INFO"):
        run_training(argv)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "--batch-size -1: autobatch measures GPU memory; on the CPU batch 16" in said
    assert "freeze 0-9: 10 of 60 layers frozen" in said
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["config"]["batch_size"] == 16 and ckpt["config"]["freeze_layers"] == "0-9"
    assert not (out / "best.pt").exists()
    assert not list(out.glob("*.png")) and not list(out.glob("*.jpg"))
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["1"]  # --noval


def test_predict_writes_runs_predict_exp_numbered_as_yolov5_writes_runs_detect_exp(
    shapes_data, nano_checkpoint, tmp_path, monkeypatch, caplog
):
    """Was: the default output was runs/predict itself, so its pictures lay beside the
    runs/predict/NAME folders of --name."""
    caplog.set_level("INFO", logger="predict")
    image = sorted((shapes_data.parent / "val" / "images").glob("*.jpg"))[0]
    pred = ["--weights", str(nano_checkpoint), "--cfg", str(NANO_CFG), "--source", str(image)]
    pred += ["--img-size", str(IMG), "--device", "cpu"]
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert predict.main(pred) == 0
    assert predict.main([*pred, "--name", "mine"]) == 0
    runs = tmp_path / "runs" / "predict"
    assert sorted(p.name for p in runs.iterdir()) == ["exp", "exp2", "mine"]
    assert all((runs / name / image.name).is_file() for name in ("exp", "exp2", "mine"))
    assert "1 image drawn in runs/predict/exp" in caplog.messages  # was: "1 images"
