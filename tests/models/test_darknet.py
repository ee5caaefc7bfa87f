"""models/darknet.py and models/layers.py: building, parameter counts, forward conventions,
decoding, Darknet's layer semantics (max-pooling, new_coords, stopbackward, BatchNorm epsilon),
fuse, info. The comparison with OpenCV's Darknet importer is in test_darknet_opencv.py."""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from build_utils.errors import ConfigError
from build_utils.parse_config import ACTIVATIONS, parse_model_cfg, rewrite_cfg_classes
from models.darknet import DARKNET_BN_EPS, ULTRALYTICS_BN_EPS, Darknet
from models.layers import (
    ACTIVATION_FACTORIES,
    DarknetMaxPool,
    FeatureConcat,
    WeightedFeatureFusion,
    YOLOLayer,
)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
CORPUS_DIR = SHARED / "darknet-cfg"
CORPUS = sorted(CORPUS_DIR.glob("*.cfg")) if SHARED.is_dir() else []
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
DARKNET_DIR = REPO / "cfg" / "darknet"
DARKNET_CFGS = sorted(DARKNET_DIR.glob("*.cfg"))

# Figures stated in the issue for the standard 80-class networks (lineage counts).
ISSUE_PARAMS = {
    "yolov3-spp.cfg": 62_998_749,
    "yolov3.cfg": 61_949_149,
    "yolov3-tiny.cfg": 8_852_366,
}


def require_shared() -> None:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (it only exists beside the development checkout)")


def readme_params() -> dict[str, int]:
    """The parameter table of the corpus README (figures counted by the ultralytics code)."""
    text = (CORPUS_DIR / "README.md").read_text()
    return {
        m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"\| (\S+\.cfg) \| ([\d,]+) \|", text)
    }


def expected_params(blocks: list[dict]) -> int:
    """Parameters of a cfg counted layer by layer, independently of models/: conv weights
    filters * in / groups * k * k, plus 2 * filters BatchNorm affine or filters bias; weighted
    shortcuts one weight per input. Channels are tracked the way Darknet defines them."""
    ch = [blocks[0].get("channels", 3)]  # ch[0]: input; ch[i + 1]: output of layer i
    total = 0
    for i, b in enumerate(blocks[1:]):
        t = b["type"]
        if t == "convolutional":
            k, f, g = b.get("size", 1), b.get("filters", 1), b.get("groups", 1)
            total += f * (ch[-1] // g) * k * k + (2 * f if b.get("batch_normalize", 0) else f)
            ch.append(f)
        elif t == "route":
            idx = [i + r if r < 0 else r for r in b["layers"]]
            ch.append(sum(ch[j + 1] for j in idx) // b.get("groups", 1))
        elif t == "shortcut":
            if b.get("weights_type", "none") != "none":
                total += len(b["from"]) + 1
            ch.append(ch[-1])
        else:  # maxpool, upsample, dropout, yolo keep the channels
            ch.append(ch[-1])
    return total


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_head_shapes(model: Darknet, bs: int, h: int, w: int) -> list[tuple[int, ...]]:
    heads = [model.module_list[i] for i in model.yolo_layers]
    return [(bs, m.na, h // int(m.stride), w // int(m.stride), m.no) for m in heads]


def check_forward(model: Darknet, h: int, w: int) -> None:
    x = torch.rand(1, 3, h, w)
    shapes = expected_head_shapes(model, 1, h, w)
    with torch.no_grad():
        model.train()
        out = model(x)
        assert [tuple(o.shape) for o in out] == shapes
        model.eval()
        det, raw = model(x)
    assert [tuple(r.shape) for r in raw] == shapes
    n = sum(s[1] * s[2] * s[3] for s in shapes)
    assert det.shape == (1, n, model.nc + 5)
    assert torch.isfinite(det).all()
    assert (det[..., 4:] >= 0).all() and (det[..., 4:] <= 1).all()


# --------------------------------------------------------------------------------------------
# The corpus: every cfg builds, counts right and runs on a square and a non-square input in both
# modes (small sizes: test_darknet_opencv.py checks what full-size models compute).


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_corpus_builds_counts_and_runs(path):
    torch.manual_seed(0)
    blocks = parse_model_cfg(path)
    model = Darknet(path)
    expected = expected_params(blocks)
    assert n_params(model) == expected
    published = readme_params()
    if path.name in published:
        assert expected == published[path.name]
    if path.name in ISSUE_PARAMS:
        assert expected == ISSUE_PARAMS[path.name]
    check_forward(model, 128, 128)
    check_forward(model, 96, 128)


def test_corpus_is_present():
    require_shared()
    names = {p.name for p in CORPUS}
    assert {"yolov3-spp.cfg", "yolov4.cfg", "yolov4-tiny.cfg", "yolov3-tiny.cfg"} <= names
    assert set(readme_params()) <= names


@pytest.mark.parametrize("name", sorted(ISSUE_PARAMS))
def test_own_cfg_parameter_counts(name):
    path = REPO / "cfg" / name
    assert expected_params(parse_model_cfg(path)) == ISSUE_PARAMS[name]
    assert n_params(Darknet(path)) == ISSUE_PARAMS[name]


@pytest.mark.parametrize("name", ["yolov3-spp.cfg", "yolov3.cfg", "yolov3-tiny.cfg"])
def test_own_cfg_has_the_reference_layer_shapes(name):
    require_shared()
    ours = Darknet(REPO / "cfg" / name).state_dict()
    ref = Darknet(CORPUS_DIR / name).state_dict()
    assert list(ours) == list(ref)
    assert all(ours[k].shape == ref[k].shape for k in ref)


def test_head_strides_are_derived_not_assumed():
    require_shared()
    assert Darknet(CORPUS_DIR / "yolov3-spp.cfg").strides == [32, 16, 8]
    assert Darknet(CORPUS_DIR / "yolov4.cfg").strides == [8, 16, 32]  # heads in the other order
    assert Darknet(CORPUS_DIR / "yolov3-tiny.cfg").strides == [32, 16]


def test_activations_are_not_dropped():
    require_shared()
    path = CORPUS_DIR / "yolov4.cfg"
    blocks = parse_model_cfg(path)
    model = Darknet(path)
    n_mish = sum(b.get("activation") == "mish" for b in blocks if b["type"] == "convolutional")
    assert n_mish > 50
    assert sum(isinstance(m, nn.Mish) for m in model.modules()) == n_mish


def test_activation_lists_agree():
    assert set(ACTIVATIONS) == set(ACTIVATION_FACTORIES)


# --------------------------------------------------------------------------------------------
# cfg/darknet: Darknet's own YOLOv3/v4/v7 cfgs


def darknet_readme_params() -> dict[str, int]:
    text = (DARKNET_DIR / "README.md").read_text()
    return {
        m[1]: int(m[2].replace(",", ""))
        for m in re.finditer(r"^\| (\S+\.cfg) \| ([\d,]+) \|", text, re.M)
    }


def test_darknet_folder_holds_the_30_documented_cfgs():
    assert len(DARKNET_CFGS) == 30
    assert set(darknet_readme_params()) == {p.name for p in DARKNET_CFGS}


@pytest.mark.parametrize("path", DARKNET_CFGS, ids=lambda p: p.stem)
def test_darknet_cfg_parameter_counts(path):
    # Counted from the parsed blocks alone; test_darknet_opencv.py checks the built models.
    assert expected_params(parse_model_cfg(path)) == darknet_readme_params()[path.name]


def test_darknet_cfg_features():
    def build(name: str) -> Darknet:
        return Darknet(DARKNET_DIR / name)

    csp = build("yolov4-csp.cfg")
    heads = [csp.module_list[i] for i in csp.yolo_layers]
    assert all(h.new_coords and h.scale_x_y == 2.0 for h in heads)
    # The heads' logistic activation moved into the heads: the convs end without one.
    assert all(not hasattr(csp.module_list[i - 1], "activation") for i in csp.yolo_layers)
    assert csp.strides == [8, 16, 32] and csp.bn_eps == DARKNET_BN_EPS
    frozen = build("yolov4-p5-frozen.cfg")
    assert frozen.stopbackward == {231: 1}
    assert not any(p.requires_grad for p in frozen.module_list[:232].parameters())
    assert all(p.requires_grad for p in frozen.module_list[232:].parameters())
    assert build("yolov4-custom.cfg").stopbackward == {104: 800}
    assert build("yolov3-openimages.cfg").hyperparams["batch"] == 1  # the first of two


# --------------------------------------------------------------------------------------------
# Darknet's max-pooling


def darknet_maxpool_reference(
    x: torch.Tensor, size: int, stride: int | tuple[int, int], padding: int
):
    """src/maxpool_layer.c forward_maxpool_layer, written as its loops: (c, h, w) -> (c, oh, ow).
    ``stride``: one int or (stride_y, stride_x)."""
    sy, sx = (stride, stride) if isinstance(stride, int) else stride
    c, h, w = x.shape
    oh, ow = (h + padding - size) // sy + 1, (w + padding - size) // sx + 1
    offset = -(padding // 2)
    out = torch.empty(c, oh, ow)
    for k in range(c):
        for i in range(oh):
            for j in range(ow):
                best = -math.inf
                for n in range(size):
                    for m in range(size):
                        y, xx = offset + i * sy + n, offset + j * sx + m
                        if 0 <= y < h and 0 <= xx < w:
                            best = max(best, float(x[k, y, xx]))
                out[k, i, j] = best
    return out


def test_tiny_size2_stride1_maxpool_pads_with_minus_infinity():
    model = Darknet(REPO / "cfg" / "yolov3-tiny.cfg")
    pool = model.module_list[11]
    assert isinstance(pool, DarknetMaxPool)
    x = -torch.tensor([[3.0, 1, 2], [4, 5, 6], [7, 8, 9]]).view(1, 1, 3, 3)
    # Each output is the max of the window starting there, outside pixels never winning: the
    # lineage's zero padding gave 0 on the last row and column.
    expected = -torch.tensor([[1.0, 1, 2], [4, 5, 6], [7, 8, 9]])
    assert torch.equal(pool(x)[0, 0], expected)
    assert pool(torch.rand(1, 2, 13, 13)).shape[-2:] == (13, 13)


@pytest.mark.parametrize(
    "size, stride, padding, n",
    [
        (2, 1, 1, 5),  # YOLOv3-tiny: one pixel after the image
        (2, 2, 1, 7),  # odd input: Darknet gives 4 outputs, plain pooling 3
        (2, 2, 1, 8),
        (5, 1, 4, 6),  # SPP
        (13, 1, 12, 3),  # SPP on a map smaller than the window
        (3, 2, 2, 9),
        (3, 1, 1, 6),  # odd padding: 0 before, 1 after
        (3, 3, 0, 10),  # no padding: the last input column is in no window
        (4, 2, 3, 9),
    ],
)
def test_maxpool_matches_darknets_loops(size, stride, padding, n):
    x = -torch.rand(3, n, n + 1, generator=torch.Generator().manual_seed(n)) - 0.1
    pool = DarknetMaxPool(size, (stride, stride), padding)
    expected = darknet_maxpool_reference(x, size, stride, padding)
    got = pool(x[None])[0]
    assert got.shape == expected.shape
    assert pool.out_size(n, 0) == expected.shape[1] and pool.out_size(n + 1, 1) == expected.shape[2]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("stride", [(1, 2), (2, 1)])
def test_maxpool_with_different_strides(stride):
    x = torch.randn(2, 9, 10, generator=torch.Generator().manual_seed(0))
    got = DarknetMaxPool(2, stride, 1)(x[None])[0]
    assert torch.equal(got, darknet_maxpool_reference(x, 2, stride, 1))


# --------------------------------------------------------------------------------------------
# Small hand-made networks


CFG_STRIDES = """[net]
channels=3
[convolutional]
batch_normalize=1
filters=8
size=3
stride=2
pad=1
activation=mish
[maxpool]
size=2
stride=2
[convolutional]
filters=8
size=3
stride=1
pad=1
activation=swish
[upsample]
stride=2
[route]
layers=-1,0
[convolutional]
filters=14
size=1
stride=1
pad=1
activation=linear
[yolo]
mask=0,1
anchors=4,6, 8,12
classes=2
"""


def test_stride_tracking_through_pool_upsample_and_route(tmp_path):
    path = tmp_path / "s.cfg"
    path.write_text(CFG_STRIDES)
    model = Darknet(path)
    assert model.strides == [2.0]  # conv /2, pool /2, upsample x2
    head = model.module_list[model.yolo_layers[0]]
    assert torch.equal(head.anchor_vec, torch.tensor([[2.0, 3.0], [4.0, 6.0]]))
    model.eval()
    det, raw = model(torch.rand(2, 3, 32, 48))
    assert raw[0].shape == (2, 2, 16, 24, 7) and det.shape == (2, 2 * 16 * 24, 7)


def test_routes_must_join_the_same_resolution(tmp_path):
    text = CFG_STRIDES.replace("layers=-1,0", "layers=-1,-2")  # /2 after upsample with /4
    path = tmp_path / "r.cfg"
    path.write_text(text)
    with pytest.raises(
        ConfigError, match=r"r\.cfg:22: \[route\]: layers=\[-1, -2\] have different"
    ):
        Darknet(path)


def test_conv_groups_must_divide_channels(tmp_path):
    text = CFG_STRIDES.replace("filters=14", "filters=14\ngroups=3")
    path = tmp_path / "g.cfg"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"g\.cfg:25: \[convolutional\]: groups=3 must divide"):
        Darknet(path)


def test_head_needs_matching_channels_when_not_fed_by_a_conv(tmp_path):
    text = CFG_STRIDES.replace(
        "activation=linear\n[yolo]",
        "activation=linear\n[dropout]\n[maxpool]\nsize=1\nstride=1\n[yolo]",
    )
    text = text.replace("filters=14", "filters=15")
    path = tmp_path / "h.cfg"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"h\.cfg:33: \[yolo\]: the head's input has 15 channels"):
        Darknet(path)


def test_heads_must_agree_on_classes(tmp_path):
    second = "[route]\nlayers=-2\n[convolutional]\nfilters=21\nsize=1\nactivation=linear\n"
    second += "[yolo]\nmask=0\nanchors=4,6, 8,12\nclasses=16\n"
    path = tmp_path / "c.cfg"
    path.write_text(CFG_STRIDES + second)
    with pytest.raises(ConfigError, match=r"c\.cfg:42: \[yolo\]: the \[yolo\] layers disagree"):
        Darknet(path)


def test_a_model_needs_a_head(tmp_path):
    path = tmp_path / "n.cfg"
    path.write_text("[net]\n[convolutional]\nfilters=4\nactivation=leaky\n")
    with pytest.raises(ConfigError, match=r"n\.cfg: the cfg has no \[yolo\] layer"):
        Darknet(path)


def test_route_groups_take_one_chunk_of_each_layer():
    a = torch.arange(4.0).view(1, 4, 1, 1)
    b = torch.arange(10.0, 16.0).view(1, 6, 1, 1)
    out = FeatureConcat([0, 1], groups=2, group_id=1)(None, [a, b])
    assert out.flatten().tolist() == [2, 3, 13, 14, 15]
    assert torch.equal(FeatureConcat([1])(None, [a, b]), b)


def test_shortcut_fusion():
    x = torch.ones(1, 4, 2, 2)
    a = torch.full((1, 2, 2, 2), 3.0)
    out = WeightedFeatureFusion([0])(x, [a])
    assert out[0, :, 0, 0].tolist() == [4, 4, 1, 1]  # fewer channels: added to the leading ones
    assert out.data_ptr() != x.data_ptr() and x.max() == 1  # the input is not modified
    weighted = WeightedFeatureFusion([0], weight=True)
    assert torch.allclose(weighted(x, [torch.ones(1, 4, 2, 2)]), torch.ones(1, 4, 2, 2))  # 2 * 0.5


def test_weighted_shortcut_builds_with_lineage_keys(tmp_path):
    text = "[net]\n" + "[convolutional]\nfilters=21\nsize=1\nactivation=leaky\n" * 2
    text += "[shortcut]\nfrom=-2\nweights_type=per_feature\nactivation=leaky\n"
    text += "[yolo]\nmask=0\nanchors=4,6\nclasses=2\n"
    text = text.replace("filters=21", "filters=7", 2)
    path = tmp_path / "w.cfg"
    path.write_text(text)
    model = Darknet(path)
    assert model.state_dict()["module_list.2.w"].shape == (2,)
    assert isinstance(model.module_list[2].act, nn.LeakyReLU)
    assert n_params(model) == expected_params(parse_model_cfg(path))


# --------------------------------------------------------------------------------------------
# Decoding conventions


def test_yolo_layer_decodes_a_hand_built_output():
    anchors = [[10.0, 13.0], [16.0, 30.0]]
    layer = YOLOLayer(anchors, nc=2, stride=8).eval()
    ny, nx = 2, 3
    p = torch.zeros(1, 2, ny, nx, 7)  # (bs, na, ny, nx, no), then packed as the conv output
    p[0, 1, 1, 2] = torch.tensor(
        [math.log(3), -math.log(3), math.log(2), 0.0, 0.0, math.log(3), -math.log(4)]
    )
    conv_out = p.permute(0, 1, 4, 2, 3).reshape(1, 2 * 7, ny, nx)
    det, raw = layer(conv_out)
    assert torch.equal(raw, p)
    assert det.shape == (1, 2 * ny * nx, 7)
    row = det[0, 1 * ny * nx + 1 * nx + 2]  # anchor 1, gy 1, gx 2
    # cx = (sigmoid(log 3) + gx) * stride = (0.75 + 2) * 8; cy = (0.25 + 1) * 8
    # w = 2 * 16, h = 1 * 30; objectness sigmoid(0) = 0.5; classes 0.75 and 0.2
    expected = torch.tensor([22.0, 10.0, 32.0, 30.0, 0.5, 0.75, 0.2])
    torch.testing.assert_close(row, expected)
    first = det[0, 0]  # anchor 0, cell (0, 0), all logits 0
    torch.testing.assert_close(first, torch.tensor([4.0, 4.0, 10.0, 13.0, 0.5, 0.5, 0.5]))


def test_yolo_layer_scale_x_y_and_single_class():
    layer = YOLOLayer([[20.0, 40.0]], nc=1, stride=16, scale_x_y=2.0).eval()
    p = torch.zeros(1, 1, 1, 1, 6)
    p[..., 0] = math.log(3)  # sigmoid 0.75 -> 0.75 * 2 - 0.5 = 1.0
    p[..., 5] = -10.0  # ignored: a single class scores 1
    det, _ = layer(p.permute(0, 1, 4, 2, 3).reshape(1, 6, 1, 1))
    torch.testing.assert_close(det[0, 0], torch.tensor([16.0, 8.0, 20.0, 40.0, 0.5, 1.0]))


def test_yolo_layer_training_output_and_lazy_grid():
    layer = YOLOLayer([[1.0, 1.0]] * 3, nc=80, stride=32)
    raw = layer(torch.zeros(2, 255, 4, 5))
    assert raw.shape == (2, 3, 4, 5, 85) and layer.grid is None  # no decoding in training
    layer.eval()
    layer(torch.zeros(1, 255, 4, 5))
    assert layer.grid.shape == (1, 1, 4, 5, 2)
    det, _ = layer(torch.zeros(1, 255, 3, 2))  # another size: the grid is rebuilt
    assert layer.grid.shape == (1, 1, 3, 2, 2)
    assert det[0, -1, :2].tolist() == [(1 + 0.5) * 32, (2 + 0.5) * 32]


def test_anchors_are_buffers_outside_the_state_dict():
    layer = YOLOLayer([[10.0, 13.0]], nc=3, stride=8)
    assert "anchors" in dict(layer.named_buffers()) and "anchor_vec" in dict(layer.named_buffers())
    assert layer.state_dict() == {}
    layer = layer.to(torch.float64)
    assert layer.anchors.dtype == torch.float64


def test_model_eval_decodes_end_to_end(tmp_path):
    # conv with zero weights: the head sees its bias everywhere, so every box is predictable.
    path = tmp_path / "e.cfg"
    path.write_text(CFG_STRIDES)
    model = Darknet(path).eval()
    head_conv = model.module_list[5].Conv2d
    with torch.no_grad():
        head_conv.weight.zero_()
        head_conv.bias.zero_()
    det, _ = model(torch.rand(1, 3, 8, 12))
    assert det.shape == (1, 2 * 4 * 6, 7)
    grid_x = torch.arange(6.0).repeat(4)
    grid_y = torch.arange(4.0).repeat_interleave(6)
    for a, (aw, ah) in enumerate([(4.0, 6.0), (8.0, 12.0)]):
        d = det[0, a * 24 : (a + 1) * 24]
        torch.testing.assert_close(d[:, 0], (grid_x + 0.5) * 2)
        torch.testing.assert_close(d[:, 1], (grid_y + 0.5) * 2)
        assert torch.all(d[:, 2] == aw) and torch.all(d[:, 3] == ah)
        assert torch.all(d[:, 4:] == 0.5)


def test_yolo_layer_new_coords_decode():
    # Darknet's get_yolo_box with new_coords=1 on the conv's logistic outputs x:
    # cx = (gx + x * s - (s - 1) / 2) * stride, w = x_w ** 2 * 4 * anchor_w, no exp.
    layer = YOLOLayer([[10.0, 13.0], [16.0, 30.0]], nc=2, stride=8, scale_x_y=2.0, new_coords=True)
    layer.eval()
    p = torch.zeros(1, 2, 2, 3, 7)
    l3, l4 = math.log(3), math.log(4)
    p[0, 1, 1, 2] = torch.tensor([l3, -l3, l3, 0.0, 0.0, l3, -l4])  # sigmoids .75 .25 .75 .5
    det, raw = layer(p.permute(0, 1, 4, 2, 3).reshape(1, 14, 2, 3))
    assert torch.equal(raw, p)  # logits, as for the other heads
    # cx = (2 + 0.75 * 2 - 0.5) * 8, cy = (1 + 0.25 * 2 - 0.5) * 8, w = 0.75**2 * 4 * 16,
    # h = 0.5**2 * 4 * 30; objectness and classes are the sigmoids.
    expected = torch.tensor([24.0, 8.0, 36.0, 30.0, 0.5, 0.75, 0.2])
    torch.testing.assert_close(det[0, 6 + 1 * 3 + 2], expected)
    torch.testing.assert_close(det[0, 0, :4], torch.tensor([4.0, 4.0, 10.0, 13.0]))  # logits 0


def cfg_blocks(tmp_path: Path, text: str) -> list[dict]:
    path = tmp_path / "m.cfg"
    path.write_text(text)
    return parse_model_cfg(path)


NEW_COORDS_HEAD = """[convolutional]
size=1
stride=1
pad=1
filters=14
activation=logistic
[yolo]
mask=0,1
anchors=4,6, 8,12
classes=2
new_coords=NC
scale_x_y=2.0
"""


def test_new_coords_head_takes_the_convs_sigmoid(tmp_path):
    base = CFG_STRIDES[: CFG_STRIDES.index("[convolutional]\nfilters=14")]
    darknet = Darknet(cfg_blocks(tmp_path, base + NEW_COORDS_HEAD.replace("NC", "1")))
    plain = Darknet(cfg_blocks(tmp_path, base + NEW_COORDS_HEAD.replace("NC", "0")))
    plain.load_state_dict(darknet.state_dict())  # the activation holds no parameters
    assert not hasattr(darknet.module_list[5], "activation")
    assert isinstance(plain.module_list[5].activation, nn.Sigmoid)
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (raw,) = darknet.train()(x)
        (conv_out,) = plain.train()(x)  # what Darknet's conv outputs: sigmoids
    torch.testing.assert_close(torch.sigmoid(raw), conv_out)


def test_new_coords_needs_a_logistic_head_conv(tmp_path):
    base = CFG_STRIDES[: CFG_STRIDES.index("[convolutional]\nfilters=14")]
    text = base + NEW_COORDS_HEAD.replace("NC", "1").replace("logistic", "leaky")
    with pytest.raises(ConfigError, match=r"activation=logistic \(it has activation=leaky\)"):
        cfg_blocks(tmp_path, text)


# --------------------------------------------------------------------------------------------
# stopbackward


STOP_CFG = """[net]
batch=4
[convolutional]
batch_normalize=1
filters=4
size=3
stride=2
pad=1
activation=leaky
[convolutional]
batch_normalize=1
filters=4
size=3
stride=1
pad=1
activation=leaky
stopbackward=STOP
[route]
layers=-2,-1
[convolutional]
filters=14
size=1
activation=linear
[yolo]
mask=0,1
anchors=4,6, 8,12
classes=2
"""


def _step(model: Darknet, bs: int = 2) -> None:
    model.zero_grad(set_to_none=True)
    out = model.train()(torch.rand(bs, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    sum(o.square().mean() for o in out).backward()


def test_stopbackward_1_freezes_the_layer_and_all_before(tmp_path):
    model = Darknet(cfg_blocks(tmp_path, STOP_CFG.replace("STOP", "1")))
    assert model.stopbackward == {1: 1}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model)
    for i in (0, 1):  # frozen: no gradients, BatchNorm statistics untouched (eval mode)
        m = model.module_list[i]
        assert not m.training and all(p.grad is None for p in m.parameters())
        assert torch.equal(
            m.BatchNorm2d.running_mean, before[f"module_list.{i}.BatchNorm2d.running_mean"]
        )
    assert model.module_list[3].Conv2d.weight.grad.abs().sum() > 0
    assert model.seen == 0  # only counted for stopbackward=N > 1


def test_stopbackward_n_zeroes_gradients_for_n_iterations(tmp_path):
    # N=2 with [net] batch=4: iterations 0 and 1 are the first 8 images.
    model = Darknet(cfg_blocks(tmp_path, STOP_CFG.replace("STOP", "2")))
    assert model.stopbackward == {1: 2} and all(p.requires_grad for p in model.parameters())
    for seen_after in (2, 4, 6, 8):
        _step(model)
        assert model.seen == seen_after
        for i in (0, 1):
            grads = [p.grad for p in model.module_list[i].parameters()]
            assert all(g is not None and not g.any() for g in grads)  # zeros, for DDP
        assert model.module_list[3].Conv2d.weight.grad.abs().sum() > 0
    _step(model)  # iteration 2: the whole network trains
    assert model.seen == 8  # no longer counted
    assert all(p.grad.abs().sum() > 0 for p in model.module_list[0].parameters())
    with torch.no_grad():
        model.eval()(torch.rand(1, 3, 16, 16))
    assert model.seen == 8


# --------------------------------------------------------------------------------------------
# BatchNorm epsilon


def test_batchnorm_epsilon_is_darknets_unless_the_cfg_says_otherwise(tmp_path):
    text = STOP_CFG.replace("stopbackward=STOP\n", "")
    model = Darknet(cfg_blocks(tmp_path, text))
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert model.bn_eps == DARKNET_BN_EPS == 1e-5 and all(bn.eps == 1e-5 for bn in bns)
    lineage = Darknet(cfg_blocks(tmp_path, text.replace("batch=4", "batch=4\nbn_eps=0.0001")))
    bns = [m for m in lineage.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(m.eps == ULTRALYTICS_BN_EPS for m in bns)
    assert Darknet(cfg_blocks(tmp_path, text), bn_eps=1e-3).module_list[0].BatchNorm2d.eps == 1e-3


def test_batchnorm_normalises_as_darknet(tmp_path):
    # src/blas.c normalize_cpu: (x - mean) / sqrt(var + 1e-5), then scale and bias. With a small
    # variance the epsilon matters: 1 / sqrt(1e-4 + 1e-5) = 95.35, the lineage's 1e-4 gives 70.71.
    model = Darknet(cfg_blocks(tmp_path, STOP_CFG.replace("stopbackward=STOP\n", ""))).eval()
    seq = model.module_list[0]
    with torch.no_grad():
        seq.Conv2d.weight.zero_()
        seq.Conv2d.weight[:, 0, 1, 1] = 1.0  # the centre pixel of channel 0
        seq.BatchNorm2d.running_mean.fill_(0.25)
        seq.BatchNorm2d.running_var.fill_(1e-4)
        seq.BatchNorm2d.weight.fill_(0.5)
        seq.BatchNorm2d.bias.fill_(-1.0)
        out = seq.BatchNorm2d(seq.Conv2d(torch.ones(1, 3, 2, 2)))
    expected = 0.5 * (1 - 0.25) / math.sqrt(1e-4 + 1e-5) - 1.0
    torch.testing.assert_close(out[0, :, 0, 0], torch.full((4,), expected))


def test_head_bias_initialisation():
    torch.manual_seed(0)
    model = Darknet(NANO)
    for i in model.yolo_layers:
        head = model.module_list[i]
        conv = model.module_list[i - 1].Conv2d
        bound = 1 / math.sqrt(conv.in_channels)  # PyTorch's default bias init range
        b = conv.bias.detach().view(head.na, head.no)
        assert (b[:, 4] - (-4.5)).abs().max() <= bound
        cls_prior = math.log(0.6 / (80 - 0.99))
        assert (b[:, 5:] - cls_prior).abs().max() <= bound
        assert b[:, :4].abs().max() <= bound


# --------------------------------------------------------------------------------------------
# The nano model, blocks input, fuse, info


@pytest.fixture(scope="module")
def nano() -> Darknet:
    torch.manual_seed(0)
    model = Darknet(NANO)
    # Non-trivial BatchNorm statistics, so that fusing has something to fold.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def test_nano_keeps_the_yolov3_spp_topology(nano):
    blocks = parse_model_cfg(NANO)
    assert nano.strides == [32, 16, 8]
    pools = [(b["size"], b["stride"]) for b in blocks if b["type"] == "maxpool"]
    assert pools == [(5, 1), (9, 1), (13, 1)]
    downsampling = [b for b in blocks if b["type"] == "convolutional" and b.get("stride") == 2]
    assert len(downsampling) == 5
    assert sum(b["type"] == "shortcut" for b in blocks) == 5
    assert sum(b["type"] == "upsample" for b in blocks) == 2
    assert 500_000 <= n_params(nano) <= 1_600_000
    assert n_params(nano) == expected_params(blocks)


def test_nano_trains_a_step():
    torch.manual_seed(0)
    model = Darknet(NANO)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = model(torch.rand(2, 3, 128, 160))
    loss = sum(o.square().mean() for o in out)
    loss.backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())


def test_multi_scale_and_non_square(nano):
    nano.eval()
    with torch.no_grad():
        for h, w in [(320, 320), (256, 384), (320, 320)]:
            _, raw = nano(torch.rand(1, 3, h, w))
            assert [r.shape[2:4] for r in raw] == [(h // s, w // s) for s in (32, 16, 8)]


def test_darknet_accepts_rewritten_blocks():
    blocks = rewrite_cfg_classes(parse_model_cfg(NANO), 3)
    model = Darknet(blocks).eval()
    assert model.nc == 3 and model.cfg_path == str(NANO)
    assert model.hyperparams["type"] == "net" and len(model.module_defs) == len(blocks) - 1
    det, raw = model(torch.rand(1, 3, 64, 64))
    assert det.shape[-1] == 8 and raw[0].shape[-1] == 8
    assert blocks[1]["_lines"]  # the caller's blocks are not consumed


def test_fuse_matches_unfused(nano):
    nano.eval()
    x = torch.rand(2, 3, 160, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        det, raw = nano(x)
        keys = set(nano.state_dict())
        fused = copy.deepcopy(nano).fuse()
        det_f, raw_f = fused(x)
    assert fused.fused and not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert set(nano.state_dict()) == keys  # the original keeps its checkpoint layout
    torch.testing.assert_close(det_f, det, rtol=1e-4, atol=1e-4)
    for a, b in zip(raw_f, raw):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_info(nano, caplog):
    with caplog.at_level(logging.INFO, logger="models.darknet"):
        count, gflops = nano.info(320, verbose=True)
    assert count == n_params(nano)
    assert 0.5 < gflops < 5.0
    assert any("GFLOPs at 320x320" in r.getMessage() for r in caplog.records)
    assert any("shortcut" in r.getMessage() for r in caplog.records)  # the layer table


def test_info_restores_training_mode():
    model = Darknet(REPO / "cfg" / "yolov3-tiny.cfg")
    model.train()
    model.info(64)
    assert model.training


def test_the_lineages_imports_from_models_work_and_load_lazily():
    """``from models import Darknet`` is how ultralytics/yolov3 and the tutorial's yolov3_spp
    scripts import the model: kept, without importing every submodule for ``models.loss``."""
    import subprocess
    import sys

    code = (
        "import sys; import models.loss; assert 'models.weights' not in sys.modules; "
        "from models import Darknet, YOLOLayer, load_darknet_weights, save_weights; "
        "from models.darknet import Darknet as D; assert Darknet is D"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
