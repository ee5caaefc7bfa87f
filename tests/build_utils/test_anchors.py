"""Anchors against label sizes (build_utils/anchors.py) and the anchor check at training start
(train_utils/autoanchor.py, --autoanchor)."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NANO_CFG, train_argv, validation_argv

import validation
from build_utils import anchors as anchors_lib
from build_utils.parse_config import parse_model_cfg
from train_utils.autoanchor import (
    BPR_WARN_BELOW,
    cfg_anchors,
    check_anchors,
    training_label_sizes,
    with_anchors,
)
from train_utils.config import build_config, get_args_parser
from train_utils.distributed.process_group import DistInfo
from train_utils.trainer import run

IMG = 128
CPU = DistInfo.single(torch.device("cpu"))
# Needles and plates: no shapes-data box (roughly square, 8-64 px at 128 px) gets IoU > 0.2.
BAD_ANCHORS = "1,40,  2,60,  3,90,  40,1,  60,2,  90,3,  1,120,  120,1,  2,2"


# ---------------------------------------------------------------------------------------------
# build_utils.anchors


def test_fit_matches_a_hand_computation():
    wh = np.array([[10, 10], [20, 40], [100, 5]], float)
    anchors = np.array([[10, 10], [20, 20]], float)
    # IoUs: label 1: 1 and 100/400; label 2: 100/800 and 400/800; label 3: 50/550 and 100/800.
    fit = anchors_lib.anchor_fit(wh, anchors, 0.2)
    assert fit.bpr == pytest.approx(2 / 3)
    assert fit.mean_best_iou == pytest.approx((1 + 0.5 + 0.125) / 3)
    assert fit.anchors_above == pytest.approx((2 + 1 + 0) / 3)
    assert fit.n_labels == 3 and "0.6667" in fit.describe()
    assert anchors_lib.fitness(wh, anchors, 0.2) == pytest.approx((1 + 0.5) / 3)


def test_label_sizes_are_letterboxed_pixels():
    labels = [np.array([[0, 0.5, 0.5, 0.5, 0.5]], np.float32), np.zeros((0, 5), np.float32)]
    shapes = np.array([[200, 100], [50, 50]])
    # Long side 200 -> 100 px: the box is 50 x 25 px.
    np.testing.assert_allclose(anchors_lib.label_sizes(labels, shapes, 100), [[50, 25]])
    assert anchors_lib.label_sizes([], np.zeros((0, 2)), 100).shape == (0, 2)
    wh = np.array([[1.0, 30.0], [3.0, 3.0]])
    assert anchors_lib.too_small(wh).tolist() == [True, False]


def test_kmeans_recovers_clusters():
    rng = np.random.default_rng(0)
    centres = np.array([[10, 12], [30, 60], [100, 80]], float)
    wh = np.concatenate([c * rng.uniform(0.95, 1.05, (200, 2)) for c in centres])
    anchors = anchors_lib.kmeans_iou(wh, 3, rng)
    np.testing.assert_allclose(anchors, centres, rtol=0.05)
    evolved = anchors_lib.evolve(wh, anchors, 0.2, 100, rng)
    assert anchors_lib.fitness(wh, evolved, 0.2) >= anchors_lib.fitness(wh, anchors, 0.2)
    with pytest.raises(Exception, match="too few"):
        anchors_lib.kmeans_iou(wh[:2], 3, rng)


# ---------------------------------------------------------------------------------------------
# train_utils.autoanchor


def test_cfg_anchors_follow_the_masks():
    blocks = parse_model_cfg(NANO_CFG)
    used = cfg_anchors(blocks)
    assert used.shape == (9, 2)
    assert sorted(map(tuple, used.tolist())) == sorted(
        map(tuple, np.array(blocks[-1]["anchors"]).reshape(-1, 2).tolist())
    )
    new = np.arange(1, 19, dtype=float).reshape(9, 2)
    changed = with_anchors(blocks, new)
    assert blocks[-1]["anchors"][:2] == [10, 13]  # the input is left alone
    assert all(b["anchors"] == new.reshape(-1).tolist() for b in changed if b["type"] == "yolo")


def _cfg_with(path: Path, anchors: str) -> Path:
    text = re.sub(r"(?m)^anchors\s*=.*$", f"anchors={anchors}", NANO_CFG.read_text())
    path.write_text(text)
    return path


def _flags(data: Path, cfg: Path, out: Path, *extra: str) -> list[str]:
    """One epoch of ``cfg`` in batches of 4 (nominal 4)."""
    return train_argv(data, out, *extra, cfg=cfg, batch=4, nbs=4, img=IMG)


def _config(*argv: str):
    return build_config(get_args_parser().parse_args(list(argv)))


def test_poor_anchors_warn_with_the_command(make_shapes_data, tmp_path, caplog):
    data = make_shapes_data(n_train=6, n_val=2)
    cfg = _cfg_with(tmp_path / "bad.cfg", BAD_ANCHORS)
    config = _config(*_flags(data, cfg, tmp_path / "run"))
    blocks = parse_model_cfg(cfg)
    with caplog.at_level(logging.INFO, logger="train_utils.autoanchor"):
        assert check_anchors(blocks, config, CPU) is blocks
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "--autoanchor" in warning[0]
    expected = (
        f"python tools/kmeans_anchors.py --data {data} --cfg {cfg} --img-size {IMG} "
        f"--iou-t 0.2 --out-cfg {tmp_path / 'bad-anchors.cfg'}"
    )
    assert expected in warning[0]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("best possible recall" in m and "anchors per label" in m for m in info)


def test_good_anchors_pass_quietly(make_shapes_data, tmp_path, caplog):
    data = make_shapes_data(n_train=6, n_val=2)
    config = _config(*_flags(data, NANO_CFG, tmp_path / "run", "--autoanchor"))
    wh = training_label_sizes(config)
    rng = np.random.default_rng(0)
    good = anchors_lib.kmeans_iou(wh, 9, rng)
    cfg = _cfg_with(tmp_path / "good.cfg", anchors_lib.format_anchors(good))
    config = _config(*_flags(data, cfg, tmp_path / "run", "--autoanchor"))
    blocks = parse_model_cfg(cfg)
    with caplog.at_level(logging.INFO, logger="train_utils.autoanchor"):
        assert check_anchors(blocks, config, CPU) is blocks
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("best possible recall 1.0000" in r.getMessage() for r in caplog.records)


def test_resume_without_a_checkpoint_reads_nothing(make_shapes_data, tmp_path, caplog):
    data = make_shapes_data(n_train=2, n_val=2)
    config = _config(*_flags(data, NANO_CFG, tmp_path, "--autoanchor"))
    # A training list that does not exist: resuming must not read the labels at all (and the
    # missing last.pt is the trainer's to report).
    gone = dataclasses.replace(config.data, train=tmp_path / "gone.txt")
    config = dataclasses.replace(config, resume="auto", data=gone)
    blocks = parse_model_cfg(NANO_CFG)
    with caplog.at_level(logging.INFO, logger="train_utils.autoanchor"):
        assert check_anchors(blocks, config, CPU) is blocks
    assert "skipped" in caplog.records[-1].getMessage()


@pytest.mark.slow
def test_autoanchor_trains_with_better_anchors(make_shapes_data, tmp_path):
    data = make_shapes_data(n_train=8, n_val=2)
    cfg = _cfg_with(tmp_path / "bad.cfg", BAD_ANCHORS)
    out = tmp_path / "run"
    config = _config(*_flags(data, cfg, out, "--autoanchor"))
    run(config, CPU)

    written = parse_model_cfg(out / "model.cfg")
    new = cfg_anchors(written)
    old = cfg_anchors(parse_model_cfg(cfg))
    assert not np.array_equal(new, old)
    wh = training_label_sizes(config)
    iou_t = config.hyp["iou_t"]
    old_bpr = anchors_lib.anchor_fit(wh, old, iou_t).bpr
    new_bpr = anchors_lib.anchor_fit(wh, new, iou_t).bpr
    assert old_bpr < BPR_WARN_BELOW and new_bpr > old_bpr
    # The same seed gives the same anchors: a second decision agrees with the trained model.
    assert check_anchors(parse_model_cfg(cfg), config, CPU)[-1]["anchors"] == written[-1]["anchors"]
    # Resumed with the original --cfg, the run keeps the anchors it trained with.
    resumed = dataclasses.replace(config, resume=str(out / "last.pt"))
    resumed_blocks = check_anchors(parse_model_cfg(cfg), resumed, CPU)
    np.testing.assert_array_equal(cfg_anchors(resumed_blocks), new)
    code = validation.main(
        validation_argv(
            out / "model.cfg", data, out / "last.pt", "--save-dir", str(tmp_path / "val"), img=IMG
        )
    )
    assert code == 0
