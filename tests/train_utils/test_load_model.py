"""The training model's ``--weights`` (train_utils/load_model.py): _initialise_weights says so
when ``--weights`` fits the model fully."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from conftest import NANO_CFG

from models.darknet import Darknet
from train_utils import load_model
from train_utils.checkpoint import save_checkpoint


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
