"""``train.py --recipe darknet`` end to end on the CPU: it trains a Darknet cfg with the cfg's
own training keys, resumes exactly, continues the iteration count of a ``.weights`` file (or
starts at 0 with ``--clear``), trains under two gloo processes, and writes ``.weights`` that
Darknet itself loads and scores as our validation does."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, read_results, run_training, torchrun, train_argv

from build_utils.errors import CheckpointError
from models.darknet import Darknet
from models.weights import load_darknet_weights
from tests.darknet_ref.runs import rewrite_cfg
from tools.make_cfg import make_cfg
from train_utils import trainer
from train_utils.checkpoint import load_checkpoint
from train_utils.darknet_schedule import DarknetSettings, current_rate
from train_utils.engine import NonFiniteLossError, iterations_name
from train_utils.reporting import TIMING_COLUMNS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

SIDE = 64
# 4 images an iteration in 2 passes, 6 iterations; the rate falls 10x at 4; EMA from 3.
NET = {
    "width": SIDE,
    "height": SIDE,
    "batch": 4,
    "subdivisions": 2,
    "max_batches": 6,
    "burn_in": 2,
    "learning_rate": 0.005,
    "policy": "steps",
    "steps": 4,
    "scales": 0.1,
    "ema_alpha": 0.9,
    "mosaic": 1,  # not implemented here: named in the warning
}


def tiny_cfg(tmp: Path) -> Path:
    """yolov3-tiny at a quarter of its width, for 5 classes."""
    source = REPO_ROOT / "cfg/darknet/yolov3-tiny.cfg"
    return make_cfg(source, nc=5, width=0.25, output=tmp / "tiny.cfg")


def recipe_cfg(tmp: Path, **net: object) -> Path:
    """:func:`tiny_cfg` with the training keys of ``NET`` (``net`` overrides them)."""
    return rewrite_cfg(tiny_cfg(tmp), tmp / "tiny-recipe.cfg", net={**NET, **net})


def recipe_argv(data: Path, out: Path, cfg: Path, *extra: str) -> list[str]:
    argv = train_argv(data, out, cfg=cfg, epochs=None, batch=None, img=None, multi_scale=None)
    return [*argv, "--recipe", "darknet", "--eval-iterations", "3", *extra]


@pytest.fixture(scope="module")
def full_run(shapes_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    cfg = recipe_cfg(tmp)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The data as a Darknet user writes it: with backup=, Darknet's weights folder.
        root = shapes_data.parent
        data = tmp / "darknet.data"
        data.write_text(
            f"classes=5\ntrain={root}/train.txt\nvalid={root}/val.txt\n"
            f"names={root}/shapes.names\nbackup={tmp}/backup/\n"
        )
        run_training(recipe_argv(data, tmp / "full", cfg))
    finally:
        torch.set_num_threads(n)
    return tmp, cfg


def test_trains_with_the_cfgs_keys_and_writes_darknet_weights(full_run):
    tmp, cfg = full_run
    out = tmp / "full"
    rows = read_results(out / "results.csv")
    # A row per round of --eval-iterations 3, its `epoch` the iteration.
    assert [r["epoch"] for r in rows] == ["3", "6"]
    settings = DarknetSettings.from_block(Darknet(cfg).hyperparams)
    for r in rows:  # the cfg's steps schedule, Darknet's burn-in
        assert float(r["lr"]) == pytest.approx(current_rate(settings, int(r["epoch"])), rel=1e-6)
    assert float(rows[1]["lr"]) == pytest.approx(0.0005, rel=1e-6)
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["recipe"] == "darknet" and ckpt["epoch"] == 6 and ckpt["seen"] == 6 * 4
    assert ckpt["config"]["batch_size"] == 2  # one pass: batch / subdivisions
    assert ckpt["darknet_ema"]["shadow"], "ema_alpha: the average starts at max_batches / 2"
    # Darknet's .weights of the same model, its header counting the images seen.
    model = Darknet(out / "model.cfg")
    load_darknet_weights(model, out / "last.weights")
    assert model.seen == 24
    for k, v in model.state_dict().items():
        if v.dtype.is_floating_point:
            assert torch.equal(v, ckpt["model"][k]), k
    assert (out / "best.weights").is_file()
    log = (out / "train.log").read_text()
    assert re.search(r"\[net\] max_batches\s+6\s+\[net\]\s+honoured", log)
    assert re.search(r"\[yolo\] iou_loss\s+mse\s+default\s+honoured", log)
    assert "does not implement these keys" in log and "mosaic=1" in log
    assert "done: 6 iterations" in log
    assert f"backup={tmp}/backup is not used: the weights are saved in the run folder {out}" in log
    assert not (tmp / "backup").exists()
    # Darknet's cost has no box/obj/cls parts: left out, not written as NaN.
    assert "nan" not in log.lower() and all(r["box_loss"] == "" for r in rows)
    assert all(float(r["loss"]) > 0 for r in rows)


def test_resume_is_exact(full_run, shapes_data, monkeypatch, caplog):
    tmp, cfg = full_run
    part = tmp / "part"
    real = trainer.train_darknet_iterations

    def interrupt_second_round(state, loader, first, last, opts):
        if first == 4:
            raise KeyboardInterrupt
        return real(state, loader, first, last, opts)

    monkeypatch.setattr(trainer, "train_darknet_iterations", interrupt_second_round)
    with pytest.raises(KeyboardInterrupt):
        run_training(recipe_argv(shapes_data, part, cfg))
    monkeypatch.setattr(trainer, "train_darknet_iterations", real)
    assert load_checkpoint(part / "last.pt")["epoch"] == 3
    with caplog.at_level(logging.INFO):
        run_training(recipe_argv(shapes_data, part, cfg, "--resume"))
    assert any(m.startswith("done: 3 iterations (6 in all) in") for m in caplog.messages)

    a, b = load_checkpoint(tmp / "full" / "last.pt"), load_checkpoint(part / "last.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for pid, state in a["optimizer"]["state"].items():
        assert torch.equal(state["weight_updates"], b["optimizer"]["state"][pid]["weight_updates"])
    for k, v in a["darknet_ema"]["shadow"].items():
        assert torch.equal(v, b["darknet_ema"]["shadow"][k]), k
    ra, rb = read_results(tmp / "full" / "results.csv"), read_results(part / "results.csv")
    for x, y in zip(ra, rb, strict=True):
        for column in TIMING_COLUMNS:
            x.pop(column), y.pop(column)
        assert x == y


def test_resume_with_the_other_recipe_is_refused(full_run, shapes_data):
    tmp, cfg = full_run
    last = tmp / "other" / "last.pt"  # a copy: a failed start leaves the run's folder alone
    last.parent.mkdir()
    shutil.copy(tmp / "full" / "last.pt", last)
    argv = train_argv(shapes_data, None, "--resume", str(last), "--recipe", "default", cfg=cfg)
    with pytest.raises(CheckpointError, match="trained with --recipe darknet, which --recipe"):
        run_training(argv)


def test_a_diverging_rate_names_the_iterations_and_the_cfgs_rate(shapes_data, tmp_path):
    """The advice is the recipe's: the cfg's learning_rate, not --hyp's lr0 nor --amp."""
    cfg = recipe_cfg(tmp_path, learning_rate=1e30)
    with pytest.raises(NonFiniteLossError) as e:
        run_training(recipe_argv(shapes_data, tmp_path / "run", cfg))
    assert re.fullmatch(
        r"non-finite loss in iterations 1-3 \(2 mini-batches each\); offending batch: "
        r"\S+\.\w+, \S+\.\w+\. Lower the "
        r"cfg's learning_rate \(or lengthen its burn_in\), or check these images' labels",
        str(e.value),
    )
    assert iterations_name(1, 3, 1) == "iterations 1-3"  # without subdivisions: no more said


def test_weights_seen_continues_the_count_and_clear_restarts(full_run, shapes_data):
    tmp, _ = full_run
    longer = recipe_cfg(tmp / "full", max_batches=8)  # the same model, 2 more iterations
    weights = str(tmp / "full" / "last.weights")
    run_training(recipe_argv(shapes_data, tmp / "more", longer, "--weights", weights))
    assert [r["epoch"] for r in read_results(tmp / "more" / "results.csv")] == ["8"]
    assert "seen 24 images = 6 iterations" in (tmp / "more" / "train.log").read_text()
    run_training(recipe_argv(shapes_data, tmp / "clear", longer, "--weights", weights, "--clear"))
    assert [r["epoch"] for r in read_results(tmp / "clear" / "results.csv")] == ["3", "6", "8"]


def test_two_gloo_processes(full_run, shapes_data):
    tmp, cfg = full_run
    out = tmp / "ddp"
    proc = torchrun("train_multi_GPU.py", recipe_argv(shapes_data, out, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in read_results(out / "results.csv")] == ["3", "6"]
    log = (out / "train.log").read_text()
    assert "device cpu x 2 process(es) | 6 iterations of 2 x 2 images a process" in log
    assert log.count("done: 6 iterations") == 1
    assert "SyncBatchNorm skipped: --recipe darknet (Darknet's BatchNorm)" in log
    ckpt = load_checkpoint(out / "last.pt")
    # Each process trains the cfg's batch; Darknet multiplies the rate by the processes.
    lr = float(read_results(out / "results.csv")[-1]["lr"])
    assert lr == pytest.approx(2 * 0.0005, rel=1e-6) and ckpt["seen"] == 24
    model = Darknet(out / "model.cfg")
    load_darknet_weights(model, out / "last.weights")
    assert model.seen == 24


def darknet_layout(data: Path, split: str) -> Path:
    """A Darknet ``.data`` file for ``data``'s ``split`` (Darknet reads each image's labels
    beside it, not from a labels/ folder, and its lists by absolute path)."""
    root = data.parent
    images = [root / line for line in (root / f"{split}.txt").read_text().split()]
    for image in images:
        label = root / split / "labels" / image.with_suffix(".txt").name
        image.with_suffix(".txt").write_text(label.read_text())
    listing = root / f"{split}-darknet.txt"
    listing.write_text("".join(f"{p}\n" for p in images))
    out = root / f"{split}-darknet.data"
    names = root / "shapes.names"
    out.write_text(f"classes=5\ntrain={listing}\nvalid={listing}\nnames={names}\nbackup={root}\n")
    return out


def test_darknet_scores_our_weights_as_our_validation(darknet_program, make_shapes_data, tmp_path):
    """Darknet loads the run's last.weights and its `detector map` gives the mAP@0.5 our
    validation gave the same weights. Square images at the network's side: Darknet resizes,
    we letterbox, both leave them as they are. The scores are computed differently (Darknet:
    every box with objectness above 0.005, per-class NMS at 0.45, the first matched truth;
    COCO: boxes above 0.001, a truth matched once, 101 recall points), so they agree closely
    but not bit for bit; a .weights layout Darknet misread would score near 0."""
    size = (SIDE, SIDE)
    data = make_shapes_data(n_train=8, n_val=8, img_size_range=size, obj_size_range=(12, 0.6))
    # A model trained on the images it is scored on scores well in a few seconds.
    (data.parent / "train.txt").write_text((data.parent / "val.txt").read_text())
    net = {"width": SIDE, "height": SIDE, "batch": 8, "subdivisions": 1, "max_batches": 100}
    net.update(burn_in=10, learning_rate=0.01, hue=0, saturation=1, exposure=1, flip=0)
    yolo = {"jitter": 0, "random": 0}
    cfg = rewrite_cfg(tiny_cfg(tmp_path), tmp_path / "r.cfg", net=net, yolo=yolo)
    out = tmp_path / "run"
    run_training(recipe_argv(data, out, cfg, "--eval-iterations", "100"))
    ours = float(read_results(out / "results.csv")[-1]["mAP50"])
    assert ours > 0.5, "too little trained to compare scores"

    darknet_data = darknet_layout(data, "val")
    args = ["detector", "map", darknet_data, out / "model.cfg", out / "last.weights"]
    proc = subprocess.run(
        [str(darknet_program), *map(str, args), "-points", "101"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.search(r"mean average precision \(mAP@0\.50\) = ([0-9.]+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    assert float(found.group(1)) == pytest.approx(ours, abs=0.03)
