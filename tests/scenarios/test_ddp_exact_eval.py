"""DDP evaluation is exact: the mAP a 2-process gloo run logs is validation.py's on its last.pt.

Without SyncBatchNorm (CPU/gloo, or ``--compile``) each rank's BatchNorm running statistics move
with its own batches, and the EMA averages them, so unless the ranks share rank 0's evaluated
weights each one scores its shard with a model other than the saved one. At mAP near 0 the gap
cannot show: these runs fine-tune a checkpoint that already scores well above 0.3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    read_results,
    run_command,
    run_training,
    torchrun,
    train_argv,
    validate_run,
)

from data.make_shapes import make_dataset
from models.darknet import Darknet
from train_utils.checkpoint import load_checkpoint
from train_utils.evaluation.coco_eval import faster_coco_eval_available

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
IMG = 64
# Enough from-scratch epochs on 16 one-class images (scored on the same images) for
# mAP@0.5:0.95 ~0.5-0.75 at 64 px in ~20 s on one core (measured).
PRETRAIN_EPOCHS = 45
PRETRAIN_LR = 0.01
FINE_TUNE_LR = 0.0005  # small enough to keep the mAP high after an epoch with a fresh Adam
GOOD_MAP = 0.3
EXACT = 1e-4


def _easy_hyp(path: Path, lr0: float) -> Path:
    """cfg/hyp_demo.yaml (Adam) without augmentation and with learning rate ``lr0``: the fastest
    way for a model to learn (and be scored on) its own training images."""
    hyp = yaml.safe_load((REPO / "cfg" / "hyp_demo.yaml").read_text())
    hyp.update(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, translate=0.0, scale=0.0, fliplr=0.0, lr0=lr0)
    path.write_text(yaml.safe_dump(hyp))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(data, fine-tuning hyp, checkpoint): 16 easy 64 px images whose validation split is the
    training split, and a nano model trained on them to mAP@0.5:0.95 > :data:`GOOD_MAP`."""
    root = tmp_path_factory.mktemp("exact_eval")
    data = make_dataset(
        root / "shapes",
        16,
        4,
        img_size_range=(IMG, IMG),
        seed=0,
        n_classes=1,
        obj_size_range=(20.0, 0.6),
        workers=1,
    )
    data.write_text(data.read_text().replace("valid=val.txt", "valid=train.txt"))
    hyp = _easy_hyp(root / "hyp.yaml", PRETRAIN_LR)
    out = root / "pretrain"
    argv = train_argv(
        data,
        out,
        "--optimizer",
        "adam",
        "--eval-interval",
        str(PRETRAIN_EPOCHS),
        "--no-channels-last",  # not the timed choice: the same checkpoint on every machine
        hyp=hyp,
        epochs=PRETRAIN_EPOCHS,
        img=IMG,
        batch=8,
        nbs=8,
    )
    summary = run_training(argv)
    assert summary.best_map is not None and summary.best_map > GOOD_MAP, summary.best_map
    return data, _easy_hyp(root / "hyp_fine_tune.yaml", FINE_TUNE_LR), out / "last.pt"


def _fine_tune_argv(trained: tuple[Path, Path, Path], out: Path) -> list[str]:
    data, hyp, weights = trained
    # --ema on (the default): the EMA is where the ranks' statistics used to part.
    return train_argv(
        data,
        out,
        "--optimizer",
        "adam",
        "--weights",
        str(weights),
        hyp=hyp,
        epochs=1,
        img=IMG,
        batch=4,
        nbs=8,
    )


def _assert_logged_equals_validation(data: Path, out: Path, tmp_path: Path) -> None:
    rows = read_results(out / "results.csv")
    assert len(rows) == 1
    logged = float(rows[0]["mAP50-95"])
    assert logged > GOOD_MAP, logged  # a value where a different model would show
    single = validate_run(data, out, tmp_path, img=IMG)
    for key, value in single.items():
        assert float(rows[0][key]) == pytest.approx(value, abs=EXACT), key
    if faster_coco_eval_available():  # the default scorer on the gathered detections too
        assert "COCO scoring: faster-coco-eval" in (out / "train.log").read_text()


def _run(cmd: list[str]) -> None:
    proc = run_command(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _torchrun(argv: list[str]) -> None:
    proc = torchrun("train_multi_GPU.py", argv)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_torchrun_fine_tune_logs_the_map_of_last_pt(trained, tmp_path):
    out = tmp_path / "ddp"
    _torchrun(_fine_tune_argv(trained, out))
    _assert_logged_equals_validation(trained[0], out, tmp_path)


def test_spawned_fine_tune_of_the_heads_only(trained, tmp_path):
    """train_multi_GPU.py's own spawn (the other launch path), with frozen parameters (no
    gradients to all-reduce): only the heads' convolutions move, every frozen tensor (BatchNorm
    statistics included) stays as loaded, and the logged mAP is still last.pt's."""
    out = tmp_path / "heads"
    cmd = [sys.executable, str(REPO / "train_multi_GPU.py"), "--nproc-per-node", "2"]
    _run([*cmd, *_fine_tune_argv(trained, out), "--freeze-layers", "all-but-heads"])
    _assert_logged_equals_validation(trained[0], out, tmp_path)
    loaded = load_checkpoint(trained[2])["model"]
    ckpt = load_checkpoint(out / "last.pt")
    heads = {i - 1 for i in Darknet(out / "model.cfg").yolo_layers}
    for key in ("train_model", "model"):
        state = ckpt[key]
        changed = {int(k.split(".")[1]) for k, v in state.items() if not torch.equal(v, loaded[k])}
        assert changed == heads, (key, sorted(changed))
