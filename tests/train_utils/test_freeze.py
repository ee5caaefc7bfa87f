"""Every ``--freeze-layers`` mode trains: frozen layers end the run bitwise as loaded (weights and
BatchNorm statistics), the others learn, and the [yolo] layers are never frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import NANO_CFG, REPO_ROOT, run_training, train_argv

from models.darknet import Darknet, backbone_end, model_blocks_for
from train_utils.checkpoint import load_checkpoint
from train_utils.config import load_data_config

TINY_CFG = REPO_ROOT / "cfg" / "yolov3-tiny.cfg"
IMG = 64


def _expected_frozen(model: Darknet, mode: str) -> set[int]:
    """The layers ``mode`` should freeze, from the cfg's structure (not from freeze())."""
    if mode == "backbone":
        return set(range(backbone_end(model) + 1))
    heads = set(model.yolo_layers)
    head_convs = {i - 1 for i in heads}
    return set(range(len(model.module_list))) - heads - head_convs


def _layer_tensors(state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    prefix = f"module_list.{i}."
    return {k: v for k, v in state.items() if k.startswith(prefix)}


@pytest.mark.parametrize("cfg", [NANO_CFG, TINY_CFG], ids=["nano", "tiny"])
@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        (["--freeze-layers"], "all-but-heads"),  # the lineage's bare form
        (["--freeze-layers", "all-but-heads"], "all-but-heads"),
        (["--freeze-layers", "backbone"], "backbone"),
    ],
    ids=["bare", "all-but-heads", "backbone"],
)
def test_freeze_mode_trains_and_keeps_the_frozen_layers(
    make_shapes_data, tmp_path: Path, cfg: Path, flags: list[str], mode: str
) -> None:
    shapes_data = make_shapes_data(n_train=8, n_val=2, img_size_range=(64, 96))
    nc = load_data_config(shapes_data).nc
    torch.manual_seed(0)
    model = Darknet(model_blocks_for(cfg, nc), img_size=IMG)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(init, tmp_path / "init.pt")
    out = tmp_path / "run"
    argv = train_argv(
        shapes_data,
        out,
        *flags,
        "--weights",
        str(tmp_path / "init.pt"),
        "--notest",
        cfg=cfg,
        img=IMG,
        batch=4,
    )
    summary = run_training(argv)
    assert summary.epochs_run == 1

    trained = load_checkpoint(out / "last.pt")["train_model"]
    frozen = _expected_frozen(model, mode)
    with_params = {i for i, m in enumerate(model.module_list) if any(True for _ in m.parameters())}
    assert frozen & with_params and with_params - frozen
    for i in with_params:
        layer = _layer_tensors(trained, i)
        unchanged = {k for k, v in layer.items() if torch.equal(v, init[k])}
        if i in frozen:
            # Weights and BatchNorm statistics (eval mode) exactly as loaded.
            assert unchanged == set(layer), (i, sorted(set(layer) - unchanged))
        else:
            assert not any(k.endswith(".weight") for k in unchanged), (i, sorted(unchanged))
            if any("running_mean" in k for k in layer):
                assert not any("running_mean" in k for k in unchanged), i
    log = (out / "train.log").read_text()
    n_frozen = len(frozen)
    assert f"freeze {mode}: {n_frozen} of {len(model.module_list)} layers frozen" in log
