"""models/weights.py (Darknet .weights) and the .pt weight loading of train_utils/checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from build_utils.errors import CheckpointError
from build_utils.parse_config import parse_model_cfg, rewrite_cfg_classes
from models.darknet import Darknet
from models.weights import load_darknet_weights, save_weights
from train_utils.checkpoint import (
    load_state_dict_file,
    load_state_dict_flexible,
    load_weights,
    save_weights_pt,
)

REPO = Path(__file__).resolve().parents[2]
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
TINY = REPO / "cfg" / "yolov3-tiny.cfg"
BN_COUNTER = "num_batches_tracked"  # not part of the Darknet format


def randomised(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter and BatchNorm statistic set to distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(BN_COUNTER):
                t.fill_(7)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


def darknet_values(blocks: list[dict]) -> int:
    """Float32 values a .weights file holds for ``blocks``, counted independently of models/."""
    ch, total = [blocks[0].get("channels", 3)], 0
    for i, b in enumerate(blocks[1:]):
        if b["type"] == "convolutional":
            f, k, g = b.get("filters", 1), b.get("size", 1), b.get("groups", 1)
            total += f * (ch[-1] // g) * k * k + (4 * f if b.get("batch_normalize", 0) else f)
            ch.append(f)
        elif b["type"] == "route":
            idx = [i + r if r < 0 else r for r in b["layers"]]
            ch.append(sum(ch[j + 1] for j in idx) // b.get("groups", 1))
        else:
            ch.append(ch[-1])
    return total


@pytest.fixture(scope="module")
def nano_files(tmp_path_factory) -> tuple[Darknet, Path, Path]:
    """A randomised nano model saved as .pt and as .weights."""
    root = tmp_path_factory.mktemp("weights")
    model = randomised(Darknet(NANO)).eval()
    model.seen = 123_456_789_012  # needs 64 bits
    save_weights_pt(model, root / "a.pt")
    save_weights(model, root / "a.weights")
    return model, root / "a.pt", root / "a.weights"


def test_weights_file_layout(nano_files):
    model, _, weights = nano_files
    data = weights.read_bytes()
    assert np.frombuffer(data, "<i4", 3).tolist() == [0, 2, 0]
    assert int(np.frombuffer(data, "<i8", 1, 12)[0]) == 123_456_789_012
    n_values = (len(data) - 20) // 4
    assert n_values == darknet_values(parse_model_cfg(NANO))
    # First conv: BN bias, weight, mean, var (8 each), then its 8 x 3 x 3 x 3 weights.
    first = np.frombuffer(data, "<f4", 4 * 8 + 216, 20)
    bn, conv = model.module_list[0].BatchNorm2d, model.module_list[0].Conv2d
    expected = torch.cat(
        [bn.bias, bn.weight, bn.running_mean, bn.running_var, conv.weight.flatten()]
    )
    assert np.array_equal(first, expected.detach().numpy())


def test_pt_weights_pt_round_trip_is_identical(nano_files, tmp_path):
    _, pt, weights = nano_files
    restored = Darknet(NANO)
    load_darknet_weights(restored, weights)
    assert restored.seen == 123_456_789_012
    save_weights_pt(restored, tmp_path / "b.pt")
    a, b = load_state_dict_file(pt), load_state_dict_file(tmp_path / "b.pt")
    assert list(a) == list(b)
    for k in a:
        if not k.endswith(BN_COUNTER):
            assert torch.equal(a[k], b[k]), k


def test_models_loaded_from_pt_and_weights_give_identical_outputs(nano_files):
    model, pt, weights = nano_files
    from_pt, from_weights = Darknet(NANO), Darknet(NANO)
    load_weights(from_pt, pt)
    load_weights(from_weights, weights)
    x = torch.rand(1, 3, 128, 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.eval()(x)[0]
        outs = [m.eval()(x)[0] for m in (from_pt, from_weights)]
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


def test_no_bias_convs_and_int32_seen_header(tmp_path):
    # yolov3-tiny has convs without BatchNorm (bias in the file) and a pool with padding.
    model = randomised(Darknet(TINY), seed=3)
    save_weights(model, tmp_path / "t.weights")
    body = (tmp_path / "t.weights").read_bytes()[20:]
    # Rewrite as a version 0.1.0 file, whose `seen` is 32 bits.
    old = np.asarray([0, 1, 0, 42], "<i4").tobytes() + body
    (tmp_path / "old.weights").write_bytes(old)
    restored = Darknet(TINY)
    load_darknet_weights(restored, tmp_path / "old.weights")
    assert restored.seen == 42
    for k, v in model.state_dict().items():
        if not k.endswith(BN_COUNTER):
            assert torch.equal(restored.state_dict()[k], v), k


@pytest.mark.parametrize(
    "header",
    [
        np.asarray([0, 2, 5], "<i4").tobytes() + np.asarray([9_876_543_210], "<i8").tobytes(),
        np.asarray([0, 1, 0, 42], "<i4").tobytes(),  # 32-bit seen
    ],
    ids=["v0.2.5", "v0.1.0"],
)
def test_darknet_files_round_trip_byte_for_byte(tmp_path, header):
    # Darknet writes version 0.2.5 headers; whatever the version, loading and saving a file
    # must give it back unchanged (values bit for bit, NaN payloads included).
    values = np.random.default_rng(0).standard_normal(darknet_values(parse_model_cfg(TINY)))
    values = values.astype("<f4")
    values[7] = np.frombuffer(np.asarray([0x7FC01234], "<u4").tobytes(), "<f4")[0]
    original = header + values.tobytes()
    (tmp_path / "in.weights").write_bytes(original)
    model = Darknet(TINY)
    load_darknet_weights(model, tmp_path / "in.weights")
    save_weights(model, tmp_path / "out.weights")
    assert (tmp_path / "out.weights").read_bytes() == original
    assert not list(tmp_path.glob("*.tmp"))


def test_weighted_shortcut_round_trip(tmp_path):
    cfg = tmp_path / "w.cfg"
    cfg.write_text(
        "[net]\n"
        + "[convolutional]\nbatch_normalize=1\nfilters=7\nsize=3\npad=1\nactivation=leaky\n" * 2
        + "[shortcut]\nfrom=-2\nweights_type=per_feature\n"
        + "[convolutional]\nfilters=7\nsize=1\nactivation=linear\n"
        + "[yolo]\nmask=0\nanchors=4,6\nclasses=2\n"
    )
    model = randomised(Darknet(cfg), seed=5)
    save_weights(model, tmp_path / "w.weights")
    restored = Darknet(cfg)
    load_darknet_weights(restored, tmp_path / "w.weights")
    assert torch.equal(restored.module_list[2].w, model.module_list[2].w)


def _write_values(path: Path, n_values: int, header: bytes | None = None) -> None:
    head = header or np.asarray([0, 2, 0], "<i4").tobytes() + np.asarray([0], "<i8").tobytes()
    path.write_bytes(head + np.zeros(n_values, "<f4").tobytes())


def test_truncated_file_is_an_error_and_loads_nothing(nano_files, tmp_path):
    _, _, weights = nano_files
    needed = darknet_values(parse_model_cfg(NANO))
    cut = tmp_path / "cut.weights"
    cut.write_bytes(weights.read_bytes()[:-4])
    model = Darknet(NANO)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pattern = rf"cut\.weights: truncated .* needs {needed:,} float32 values, the file holds "
    pattern += rf"{needed - 1:,}$"
    with pytest.raises(CheckpointError, match=pattern):
        load_darknet_weights(model, cut)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_too_long_file_is_an_error(nano_files, tmp_path):
    _, _, weights = nano_files
    long = tmp_path / "long.weights"
    long.write_bytes(weights.read_bytes() + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"long\.weights: too long, or for another cfg"):
        load_darknet_weights(Darknet(NANO), long)


def test_weights_for_another_cfg(nano_files):
    _, _, weights = nano_files
    with pytest.raises(CheckpointError, match=r"for another cfg: .*yolov3-tiny\.cfg"):
        load_darknet_weights(Darknet(TINY), weights)


@pytest.mark.parametrize(("file_classes", "cfg_classes"), [(5, 80), (80, 3)])
def test_weights_of_another_class_count_name_it(file_classes, cfg_classes, tmp_path):
    """Was: only the value counts, for a cfg not edited for the weights' classes (Darknet's
    usual workflow: `predict.py --cfg yolov3.cfg --weights my5classes.weights`). The count the
    hint names is checked against the cfg rewritten for it, counted independently."""
    blocks = parse_model_cfg(NANO)
    path = tmp_path / "w.weights"
    save_weights(Darknet(rewrite_cfg_classes(blocks, file_classes)), path)
    values = (path.stat().st_size - 20) // 4  # a 0.2 header: 3 int32 + int64 seen
    assert values == darknet_values(rewrite_cfg_classes(blocks, file_classes))
    with pytest.raises(CheckpointError) as e:
        load_darknet_weights(Darknet(rewrite_cfg_classes(blocks, cfg_classes)), path)
    assert str(e.value).endswith(
        f"; it holds this cfg's values for {file_classes} classes (the cfg has {cfg_classes}): "
        f"give the class names or data of those {file_classes} (--names/--data: the heads are "
        f"rewritten for them), or a cfg for them (tools/make_cfg.py {NANO} --classes "
        f"{file_classes})"  # convert_weights.py has no --names/--data: make_cfg is its way
    )
    load_darknet_weights(Darknet(rewrite_cfg_classes(blocks, file_classes)), path)  # as it says


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"", r"too short for a Darknet weights header"),
        (np.asarray([0, 2, 0, 0], "<i4").tobytes(), r"too short for a Darknet v0\.2 header"),
        (
            np.asarray([0, 2, 0, 0, 0, 1], "<i4").tobytes() + b"\0\0",
            r"not a whole number of float32",
        ),
    ],
)
def test_damaged_headers(tmp_path, content, pattern):
    path = tmp_path / "bad.weights"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=pattern):
        load_darknet_weights(Darknet(TINY), path)


def test_missing_weights_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_darknet_weights(Darknet(TINY), tmp_path / "none.weights")


def test_cutoff_partial_backbone_file(nano_files, tmp_path):
    model, _, _ = nano_files
    save_weights(model, tmp_path / "backbone.weights", cutoff=21)  # the residual backbone
    blocks = parse_model_cfg(NANO)
    partial = tmp_path / "backbone.weights"
    assert (partial.stat().st_size - 20) // 4 == darknet_values(blocks[:22])
    with pytest.raises(CheckpointError, match=r"ends exactly after layer 19: cutoff=20"):
        load_darknet_weights(Darknet(NANO), partial)  # without cutoff: truncated, with a hint
    restored = Darknet(NANO)
    load_darknet_weights(restored, partial, cutoff=21)
    ref, got = model.state_dict(), restored.state_dict()
    for k in ref:
        if k.endswith(BN_COUNTER):
            continue
        layer = int(k.split(".")[1])
        assert torch.equal(ref[k], got[k]) == (layer < 21), k


def test_cutoff_on_a_full_file_loads_the_first_layers(nano_files):
    model, _, weights = nano_files
    restored = Darknet(NANO)
    load_darknet_weights(restored, weights, cutoff=5)
    assert torch.equal(restored.module_list[3].Conv2d.weight, model.module_list[3].Conv2d.weight)
    assert not torch.equal(
        restored.module_list[5].Conv2d.weight, model.module_list[5].Conv2d.weight
    )


def test_fused_model_cannot_be_saved_or_loaded(tmp_path, nano_files):
    _, _, weights = nano_files
    fused = Darknet(TINY).eval().fuse()
    with pytest.raises(CheckpointError, match=r"fused .* before fuse\(\)"):
        save_weights(fused, tmp_path / "f.weights")
    with pytest.raises(CheckpointError, match="fused"):
        load_darknet_weights(fused, weights)


# --------------------------------------------------------------------------------------------
# .pt files and state_dicts


def lineage_keys(blocks: list[dict]) -> dict[str, tuple[int, ...]]:
    """The state_dict of the lineage's Darknet for a cfg, derived from the cfg alone."""
    keys, ch = {}, [blocks[0].get("channels", 3)]
    for i, b in enumerate(blocks[1:]):
        if b["type"] == "convolutional":
            f, k = b["filters"], b["size"]
            keys[f"module_list.{i}.Conv2d.weight"] = (f, ch[-1], k, k)
            if b.get("batch_normalize", 0):
                for name in ("weight", "bias", "running_mean", "running_var"):
                    keys[f"module_list.{i}.BatchNorm2d.{name}"] = (f,)
                keys[f"module_list.{i}.BatchNorm2d.num_batches_tracked"] = ()
            else:
                keys[f"module_list.{i}.Conv2d.bias"] = (f,)
            ch.append(f)
        elif b["type"] == "route":
            ch.append(sum(ch[(i + r if r < 0 else r) + 1] for r in b["layers"]))
        else:
            ch.append(ch[-1])
    return keys


def test_lineage_checkpoint_loads_strictly(tmp_path):
    # A checkpoint as the lineage publishes it: {'model': state_dict, ...} with these keys.
    cfg = REPO / "cfg" / "yolov3-spp.cfg"
    keys = lineage_keys(parse_model_cfg(cfg))
    sd = {
        k: torch.full(s, 3, dtype=torch.long) if not s else torch.full(s, 0.5)
        for k, s in keys.items()
    }
    torch.save(
        {"epoch": 10, "best_fitness": 0.5, "model": sd, "optimizer": None}, tmp_path / "l.pt"
    )
    model = Darknet(cfg)
    assert set(model.state_dict()) == set(keys)
    model.load_state_dict(load_state_dict_file(tmp_path / "l.pt"), strict=True)
    load_weights(model, tmp_path / "l.pt", strict=True)
    assert torch.all(model.module_list[0].Conv2d.weight == 0.5)


def test_checkpoint_forms(tmp_path):
    model = randomised(Darknet(TINY))
    sd = model.state_dict()
    torch.save(sd, tmp_path / "bare.pt")
    torch.save({"model": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "ddp.pt")
    for name in ("bare.pt", "ddp.pt"):
        loaded = load_state_dict_file(tmp_path / name)
        assert list(loaded) == list(sd)
        assert all(torch.equal(loaded[k], sd[k]) for k in sd)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"not a checkpoint", r"cannot read checkpoint: .*not a PyTorch checkpoint"),
        ({"model": None, "epoch": 3}, r"not a checkpoint: no model weights"),
        ({"epoch": 3}, r"not a checkpoint: no model weights"),
        ([1, 2, 3], r"not a checkpoint: the file holds a list"),
    ],
)
def test_bad_checkpoints(tmp_path, content, pattern):
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(CheckpointError, match=r"bad\.pt: " + pattern):
        load_state_dict_file(path)


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"model": nn.Linear(2, 2)}, tmp_path / "obj.pt")  # a whole module, not a state_dict
    with pytest.raises(CheckpointError, match="which weights_only loading refuses"):
        load_state_dict_file(tmp_path / "obj.pt")


def test_strict_load_of_another_class_count_names_the_fix(nano_files):
    _, pt, _ = nano_files
    model = Darknet(rewrite_cfg_classes(parse_model_cfg(NANO), 3))
    with pytest.raises(
        CheckpointError,
        match=r"shape: module_list\.34\.Conv2d\.bias \(255,\) vs model \(24,\).*tools/make_cfg\.py",
    ):
        load_weights(model, pt, strict=True)


def test_load_state_dict_flexible_skips_the_heads(nano_files):
    source, pt, _ = nano_files
    model = Darknet(rewrite_cfg_classes(parse_model_cfg(NANO), 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    skipped = load_state_dict_flexible(model, {**load_state_dict_file(pt), "epoch": 5})
    heads = [i - 1 for i in model.yolo_layers]
    assert skipped == sorted(
        f"module_list.{i}.Conv2d.{p}" for i in heads for p in ("weight", "bias")
    )
    src = source.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k] if k in skipped else src[k]), k


def test_load_state_dict_flexible_reports_both_sides():
    model = nn.Sequential(nn.Linear(2, 3))
    sd = {"module.0.weight": torch.ones(3, 2), "module.extra": torch.ones(1)}
    assert load_state_dict_flexible(model, sd) == ["0.bias", "extra"]
    assert torch.all(model[0].weight == 1)


def test_load_weights_non_strict_for_pt(nano_files):
    _, pt, _ = nano_files
    model = Darknet(rewrite_cfg_classes(parse_model_cfg(NANO), 1))
    assert len(load_weights(model, pt, strict=False)) == 6


def test_darknet_backbone_files_initialise_the_layers_they_hold(nano_files, tmp_path):
    """``--weights darknet53.conv.74``: a file that ends after a layer loads those layers (the
    cutoff is found from its size); evaluation-style strict loading still refuses it."""
    source, _, _ = nano_files
    cut = 10
    backbone = tmp_path / "nano.conv.9"  # Darknet's naming: layers 0..9
    save_weights(source, backbone, cutoff=cut)
    model = Darknet(NANO)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert load_weights(model, backbone, strict=False) == []
    src = source.state_dict()
    for k, v in model.state_dict().items():
        if k.endswith(BN_COUNTER):
            continue
        layer = int(k.split(".")[1])
        assert torch.equal(v, src[k] if layer < cut else before[k]), k
    with pytest.raises(CheckpointError, match="ends exactly after layer 9: cutoff=10"):
        load_weights(Darknet(NANO), backbone, strict=True)
    # Without a telling name the header is recognised: neither a zip nor a pickle.
    renamed = tmp_path / "backbone.bin"
    renamed.write_bytes(backbone.read_bytes())
    assert load_weights(Darknet(NANO), renamed, strict=False) == []


def _sparse_weights(path: Path, size: int) -> Path:
    """A Darknet header (v0.2.0, seen 0) and ``size`` bytes in all, sparse (no disk used)."""
    with path.open("wb") as f:
        f.write(np.array([0, 2, 0], "<i4").tobytes() + np.array([0], "<i8").tobytes())
        f.truncate(size)
    return path


def test_a_40_gb_sparse_weights_file_is_refused_unread(tmp_path):
    import resource

    path = _sparse_weights(tmp_path / "big.weights", 40 << 30)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError) as info:
        load_darknet_weights(Darknet(NANO), path)
    assert str(info.value) == (
        f"{path}: 40 GiB, over the limit of 8 GiB (bytes per weights or checkpoint file); "
        "set YOLO_MAX_WEIGHTS_BYTES to raise it"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 << 10  # KiB


def test_only_the_values_the_model_takes_are_read(tmp_path, monkeypatch):
    """With the limit raised, a file too long for the model is refused from its size, and a
    backbone load (cutoff) reads only the layers' values: never the whole 40 GB."""
    import resource

    monkeypatch.setenv("YOLO_MAX_WEIGHTS_BYTES", str(64 << 30))
    path = _sparse_weights(tmp_path / "big.weights", 40 << 30)
    model = Darknet(NANO)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=r"too long, or for another cfg: .* needs 1,50"):
        load_darknet_weights(model, path)
    assert load_darknet_weights(model, path, cutoff=2) == 2  # zeros (the sparse file's)
    assert float(model.module_list[0].Conv2d.weight.abs().sum()) == 0.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 << 10  # KiB
