"""A checkpoint written before resume moved into one module (main @ 74e09e9) still resumes, and
continues as the code that wrote it continued the same run.

``checkpoint_74e09e9/`` holds that run's ``epoch0.pt`` and ``model.cfg``, made with that commit
checked out (143 KB: a micro model, five convolutions and one YOLO head)::

    python -c "from data.make_shapes import make_dataset; \\
        make_dataset('shapes', 8, 4, img_size_range=(96, 128), seed=0, workers=1)"
    python train.py --data shapes/shapes.data --cfg micro.cfg --epochs 2 --batch-size 4 \\
        --img-size 64 --device cpu --workers 0 --save-period 1 --output-dir runs/old

``OLD_EPOCH_1`` is the second row of that run's results.csv: what the old code computed for
epoch 1 without stopping. The data is generated again here with the same call; if
data/make_shapes.py ever draws other images for it, these figures have to be made again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import read_results

import train
from data.make_shapes import make_dataset
from train_utils.checkpoint import CHECKPOINT_VERSION

FIXTURE = Path(__file__).with_name("checkpoint_74e09e9")
OLD_EPOCH_1 = {
    "box_loss": 4.043107509613037,
    "obj_loss": 0.8956969976425171,
    "cls_loss": 1.209349513053894,
    "loss": 6.148154258728027,
    "lr": 0.000505,
    "mAP50": 0.02922523021532922,
    "mAP50-95": 0.0031565464238731567,
}


@pytest.mark.slow
def test_a_checkpoint_of_main_at_74e09e9_resumes_as_that_code_continued(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the run recorded its data and folder as relative paths
    make_dataset("shapes", 8, 4, img_size_range=(96, 128), seed=0, workers=1)
    run = tmp_path / "runs" / "old"
    shutil.copytree(FIXTURE, run)
    assert train.main(["--resume", "runs/old/epoch0.pt"]) == 0
    rows = read_results(run / "results.csv")
    assert [row["epoch"] for row in rows] == ["1"]
    for name, value in OLD_EPOCH_1.items():
        assert float(rows[0][name]) == pytest.approx(value, rel=1e-4), name
    last = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (last["version"], last["epoch"]) == (CHECKPOINT_VERSION, 1)


def test_a_checkpoint_moved_away_from_its_run_files_asks_for_its_cfg(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Was: ``model.cfg: model cfg not found; pass an existing .cfg to --cfg``, naming a file the
    user never gave. (Any checkpoint does; this file's is at hand.)"""
    monkeypatch.chdir(tmp_path)
    shutil.copy(FIXTURE / "epoch0.pt", tmp_path)
    assert train.main(["--resume", "epoch0.pt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "error: --resume epoch0.pt: the run's cfg is neither at micro.cfg nor beside the "
        "checkpoint (model.cfg); pass the cfg it trained with to --cfg"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch0.pt"]
