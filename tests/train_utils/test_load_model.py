"""The training model's ``--weights`` (train_utils/load_model.py): _initialise_weights says so
when ``--weights`` fits the model fully; Darknet .weights run at their cfg's size."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import NANO_CFG

from build_utils.errors import CheckpointError
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes, write_model_cfg
from models.darknet import Darknet
from models.weights import save_weights
from train_utils import load_model
from train_utils.checkpoint import read_weights, save_checkpoint, save_weights_pt
from train_utils.cli import DEFAULT_IMG_SIZE, parse_args


def test_fully_matching_weights_are_reported(tmp_path, caplog):
    torch.manual_seed(0)
    source = Darknet(NANO_CFG, img_size=(64, 64))
    path = tmp_path / "w.pt"
    save_checkpoint({"model": source.state_dict(), "epoch": -1}, path)
    torch.manual_seed(1)
    model = Darknet(NANO_CFG, img_size=(64, 64))
    config = SimpleNamespace(weights=str(path), trust_checkpoint=False)
    with caplog.at_level(logging.INFO):
        load_model._initialise_weights(model, config)
    n = len(model.state_dict())
    assert f"--weights {path}: all {n} tensors loaded" in caplog.text
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_darknet_weights_run_at_their_cfgs_size(tmp_path, caplog):
    """Was: validation.py and predict.py ran a Darknet .weights file at 512 px whatever its cfg
    said (a model trained at 64 px scored at 512); Darknet's `detector map`/`test` run at the
    cfg's [net] size. Now that size, rounded up to 32, unless --img-size or the run says."""
    import predict

    cfg = tmp_path / "m.cfg"
    text = NANO_CFG.read_text().replace("width=320", "width=90").replace("height=320", "height=64")
    cfg.write_text(text)
    darknet = tmp_path / "m.weights"
    save_weights(Darknet(cfg), darknet)
    pt = tmp_path / "m.pt"
    save_weights_pt(Darknet(cfg), pt)
    with caplog.at_level(logging.INFO):
        assert load_model.default_img_size(read_weights(darknet), cfg) == 96
    assert f"--img-size 96: the [net] size of {cfg}, as Darknet runs .weights" in caplog.text
    assert load_model.default_img_size(read_weights(pt), cfg) == DEFAULT_IMG_SIZE
    for extra, want in (([], 96), (["--img-size", "128"], 128)):
        argv = ["--weights", str(darknet), "--cfg", str(cfg), "--source", "x.jpg", *extra]
        args = parse_args(predict.get_parser(), argv)
        predict.load_model(args)
        assert args.img_size == want


def test_class_names_of_another_count_than_the_checkpoint_are_one_line(tmp_path, caplog):
    """Was: 'rewriting the heads for 2 classes' and then '6 tensors do not fit the model built
    from the cfg' for `validation.py/predict.py --data` with 2 classes on a 5-class checkpoint."""
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO_CFG), 5)
    write_model_cfg(blocks, tmp_path / "model.cfg")
    model = Darknet(blocks, img_size=(64, 64))
    path = tmp_path / "best.pt"
    cfg_text = (tmp_path / "model.cfg").read_text()
    save_checkpoint({"model": model.state_dict(), "epoch": -1, "cfg": cfg_text}, path)
    weights = read_weights(path)
    with pytest.raises(CheckpointError) as e, caplog.at_level(logging.WARNING):
        load_model.model_from_weights(weights, None, 2, 64)
    assert str(e.value) == (
        f"{path}: trained for 5 classes, but the class names given number 2; "
        "pass the data (or names) it was trained on"
    )
    assert "rewriting the heads" not in caplog.text
    assert load_model.model_from_weights(weights, None, 5, 64).nc == 5


def test_the_heads_rewrite_is_said_by_one_rank(caplog):
    """Was: every rank of a DDP run printed "has classes=80 but the dataset has 5; rewriting
    the heads"; the training model is built with ``say=dist.is_main``."""
    from build_utils.parse_config import yolo_classes
    from models.darknet import model_blocks_for

    for say in (False, True):
        caplog.clear()
        blocks = model_blocks_for(NANO_CFG, 5, say=say)
        assert {yolo_classes(b) for b in blocks if b["type"] == "yolo"} == {5}
        assert ("rewriting the heads for 5 classes" in caplog.text) is say
