"""tools/make_cfg.py, tools/convert_weights.py and tools/export.py's ONNX export at any H x W (the
former tools/export_onnx.py), called through main()."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_with_model_cfg

from build_utils.parse_config import parse_model_cfg
from models.darknet import Darknet
from models.export import FORMATS, export_onnx, hw
from models.weights import load_darknet_weights, save_weights
from tools import convert_weights, export, make_cfg
from train_utils.checkpoint import load_state_dict_file, load_weights, read_weights, save_weights_pt
from train_utils.load_model import default_img_size

REPO = Path(__file__).resolve().parents[2]
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
TINY = REPO / "cfg" / "yolov3-tiny.cfg"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# --------------------------------------------------------------------------------------------
# make_cfg


def test_make_cfg_classes(tmp_path):
    out = tmp_path / "nano3.cfg"
    assert make_cfg.main([str(NANO), "--classes", "3", "-o", str(out)]) == 0
    src, dst = parse_model_cfg(NANO), parse_model_cfg(out)
    assert len(src) == len(dst)
    for i, (a, b) in enumerate(zip(src, dst)):
        if b["type"] == "yolo":
            assert b["classes"] == 3 and dst[i - 1]["filters"] == 24
        elif i + 1 < len(dst) and dst[i + 1]["type"] == "yolo":
            assert a["filters"] == 255
        else:
            assert {k: v for k, v in a.items() if k[0] != "_"} == {
                k: v for k, v in b.items() if k[0] != "_"
            }
    model = Darknet(out)
    assert model.nc == 3


def test_make_cfg_from_data_and_default_name(tmp_path):
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(TINY.read_text())
    (tmp_path / "x.names").write_text("a\nb\n")
    (tmp_path / "x.data").write_text("classes=2\ntrain=t.txt\nvalid=v.txt\nnames=x.names\n")
    assert make_cfg.main([str(cfg), "--data", str(tmp_path / "x.data")]) == 0
    blocks = parse_model_cfg(tmp_path / "tiny-2cls.cfg")
    assert [b["classes"] for b in blocks if b["type"] == "yolo"] == [2, 2]


def test_make_cfg_never_writes_over_what_it_reads(tmp_path, capsys):
    # Was: -o naming the source cfg (or the --data file) replaced it with the rewritten cfg.
    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(TINY.read_text())
    (tmp_path / "x.names").write_text("a\nb\n")
    data = tmp_path / "x.data"
    data.write_text("classes=2\ntrain=t.txt\nvalid=v.txt\nnames=x.names\n")
    before = cfg.read_text(), data.read_text()
    assert make_cfg.main([str(cfg), "--classes", "3", "-o", str(cfg)]) == 2
    assert f"--output {cfg} is the cfg this tool reads" in capsys.readouterr().err
    assert make_cfg.main([str(cfg), "--data", str(data), "-o", str(data)]) == 2
    assert f"--output {data} is the --data file this tool reads" in capsys.readouterr().err
    assert (cfg.read_text(), data.read_text()) == before


def test_make_cfg_errors(tmp_path, capsys):
    bad = tmp_path / "bad.cfg"
    bad.write_text("[net]\n[convolutional]\nfilters=x\n")
    assert make_cfg.main([str(bad), "--classes", "3"]) == 2
    assert f"{bad}:3: value 'x'" in one_error_line(capsys)
    assert make_cfg.main([str(NANO), "--classes", "0", "-o", str(tmp_path / "o.cfg")]) == 2
    assert "positive integer" in one_error_line(capsys)
    assert not (tmp_path / "o.cfg").exists()


def test_make_cfg_output_that_is_a_folder_is_one_line(tmp_path, capsys):
    # Was: with --exist-ok (which the first refusal suggests), IsADirectoryError's traceback.
    folder = tmp_path / "out"
    folder.mkdir()
    argv = [str(NANO), "--classes", "3", "-o", str(folder)]
    # The same line without --exist-ok (was: "exists; pass --exist-ok", which cannot help).
    for extra in ([], ["--exist-ok"]):
        assert make_cfg.main([*argv, *extra]) == 2
        line = one_error_line(capsys)
        assert f"cannot write {folder}: {folder} is a folder, not a file" in line
    assert list(folder.iterdir()) == []


def test_make_cfg_width(tmp_path):
    src = tmp_path / "yolov4-tiny.cfg"
    src.write_text((REPO / "cfg" / "darknet" / "yolov4-tiny.cfg").read_text())
    out = make_cfg.make_cfg(src, nc=3, output=tmp_path / "w.cfg", width=0.25)
    a, b = parse_model_cfg(src), parse_model_cfg(out)
    heads = {i - 1 for i, blk in enumerate(b) if blk["type"] == "yolo"}
    for i, (x, y) in enumerate(zip(a, b)):
        if i in heads:
            assert y["filters"] == 3 * (3 + 5)
        elif y["type"] == "convolutional":  # a quarter, rounded up to a multiple of 8
            assert y["filters"] == 8 * -(-x["filters"] // 32)
        elif y["type"] != "yolo":
            assert {k: v for k, v in x.items() if k[0] != "_"} == {
                k: v for k, v in y.items() if k[0] != "_"
            }
    model = Darknet(out)
    assert model.nc == 3 and sum(p.numel() for p in model.parameters()) < 500_000
    assert make_cfg.main([str(src), "--width", "0.5"]) == 0
    assert Darknet(tmp_path / "yolov4-tiny-w0.5.cfg").nc == 80


def test_make_cfg_width_errors(tmp_path, capsys):
    assert make_cfg.main([str(TINY), "--width", "0", "-o", str(tmp_path / "o.cfg")]) == 2
    assert "--width must be a positive number" in one_error_line(capsys)
    # A filter count the flag made, over the cfg limit: the flag is named (was: only file:line,
    # where the file holds another number).
    assert make_cfg.main([str(TINY), "--width", "1e9", "-o", str(tmp_path / "o.cfg")]) == 2
    assert one_error_line(capsys).startswith(f"error: --width 1e+09: {TINY}:")
    assert make_cfg.main([str(TINY), "-o", str(tmp_path / "o.cfg")]) == 2
    assert "nothing to do" in one_error_line(capsys)


def _strip(blocks):
    return [{k: v for k, v in b.items() if k[0] != "_"} for b in blocks]


def test_make_cfg_new_coords(tmp_path):
    """--new-coords reproduces the checked-in demo cfg from the plain nano cfg (only the three
    heads and the convs feeding them change), keeps an existing new_coords head as it is, and
    the model decodes as a new_coords head: a zero logit is the cell's centre and 1x the
    anchor."""
    assert make_cfg.main([str(NANO), "--new-coords", "-o", str(tmp_path / "n.cfg")]) == 0
    made = parse_model_cfg(tmp_path / "n.cfg")
    assert _strip(made) == _strip(parse_model_cfg(REPO / "cfg" / "yolov3-spp-nano-newcoords.cfg"))
    plain = parse_model_cfg(NANO)
    changed = [i for i, (x, y) in enumerate(zip(_strip(plain), _strip(made))) if x != y]
    yolos = [i for i, b in enumerate(plain) if b["type"] == "yolo"]
    assert changed == sorted(yolos + [i - 1 for i in yolos])
    assert all(made[i - 1]["activation"] == "logistic" for i in yolos)
    assert all((made[i]["new_coords"], made[i]["scale_x_y"]) == (1, 2.0) for i in yolos)
    again = make_cfg.make_cfg(tmp_path / "n.cfg", new_coords=True, output=tmp_path / "m.cfg")
    assert _strip(parse_model_cfg(again)) == _strip(made)

    model = Darknet(tmp_path / "n.cfg", img_size=64).eval()
    head = model.module_list[model.yolo_layers[-1]]
    with torch.no_grad():
        det = head.decode(torch.zeros(1, head.na, 2, 2, head.no))
    centres = (torch.tensor([[0.5, 0.5], [1.5, 0.5]]) * head.stride).expand(1, head.na, 2, 2)
    assert torch.allclose(det[0, :, 0, :, :2], centres[0])
    assert torch.allclose(det[0, :, 1, 1, 2:4], head.anchors.float())


def test_make_cfg_new_coords_needs_a_conv(tmp_path, capsys):
    cfg = tmp_path / "pool.cfg"
    text = (REPO / "cfg" / "yolov3-tiny.cfg").read_text()
    cfg.write_text(text)
    blocks = parse_model_cfg(cfg)
    first = next(i for i, b in enumerate(blocks) if b["type"] == "yolo")
    line = blocks[first]["_line"]
    lines = text.splitlines()
    # A [maxpool] between the head's conv and the head: nowhere to put the sigmoid.
    lines.insert(line - 1, "[maxpool]\nsize=1\nstride=1\n")
    cfg.write_text("\n".join(lines) + "\n")
    assert make_cfg.main([str(cfg), "--new-coords", "-o", str(tmp_path / "o.cfg")]) == 2
    assert "--new-coords needs a [convolutional] right before it" in one_error_line(capsys)
    assert not (tmp_path / "o.cfg").exists()


def test_make_cfg_never_replaces_a_runs_model_cfg(tmp_path, capsys):
    """Was: -o runs/demo/model.cfg --exist-ok replaced a training run's own cfg. A run's file
    (results.csv and last.pt beside it) is refused with one line, with or without --exist-ok,
    as convert_weights.py and validation.py refuse it."""
    model_cfg = run_with_model_cfg(tmp_path / "demo", NANO.read_text())
    run = model_cfg.parent
    before = model_cfg.read_bytes()
    for extra in ([], ["--exist-ok"]):
        assert make_cfg.main([str(NANO), "--classes", "3", "-o", str(model_cfg), *extra]) == 2
        assert one_error_line(capsys) == (
            f"error: --output {model_cfg} is a file of the training run in {run}, which is never "
            f"replaced (not even with --exist-ok); choose another --output, e.g. "
            f"{run / 'model-new.cfg'}\n"
        )
        assert model_cfg.read_bytes() == before


# --------------------------------------------------------------------------------------------
# convert_weights


@pytest.fixture(scope="module")
def tiny_pt(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Darknet(TINY)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    path = tmp_path_factory.mktemp("convert") / "tiny.pt"
    save_weights_pt(model, path)
    return path


def test_convert_weights_both_ways(tiny_pt, tmp_path):
    weights, back = tmp_path / "tiny.weights", tmp_path / "back.pt"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(weights)]) == 0
    assert convert_weights.main([str(TINY), str(weights), str(back)]) == 0
    a, b = load_state_dict_file(tiny_pt), load_state_dict_file(back)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.endswith("num_batches_tracked"))
    ckpt = torch.load(back, map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == -1  # weights to start from, never a run to resume


def test_convert_weights_round_trip_keeps_the_darknet_header(tiny_pt, tmp_path, capsys):
    """Was: .weights -> .pt -> .weights wrote 'seen' as 0 (Darknet then trained again from
    iteration 0, burn_in included), and a --recipe darknet run's last.pt converted with seen 0
    although it records its images. Now both give the header back: the file byte for byte."""
    darknet, pt, back = tmp_path / "a.weights", tmp_path / "a.pt", tmp_path / "b.weights"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(darknet)]) == 0
    raw = bytearray(darknet.read_bytes())
    raw[12:20] = np.asarray([123456], dtype="<i8").tobytes()  # seen
    darknet.write_bytes(bytes(raw))
    assert convert_weights.main([str(TINY), str(darknet), str(pt)]) == 0
    assert convert_weights.main([str(TINY), str(pt), str(back)]) == 0
    assert back.read_bytes() == darknet.read_bytes()
    run_ckpt = torch.load(tiny_pt, map_location="cpu", weights_only=True)
    run_ckpt["seen"] = 640  # as a --recipe darknet run's last.pt records it
    torch.save(run_ckpt, tmp_path / "run.pt")
    run_argv = [str(TINY), str(tmp_path / "run.pt"), str(tmp_path / "r.weights")]
    assert convert_weights.main(run_argv) == 0
    assert np.fromfile(tmp_path / "r.weights", dtype="<i8", count=1, offset=12)[0] == 640
    run_ckpt["seen"] = -1
    torch.save(run_ckpt, tmp_path / "bad.pt")
    capsys.readouterr()
    bad_argv = [str(TINY), str(tmp_path / "bad.pt"), str(tmp_path / "x.weights")]
    assert convert_weights.main(bad_argv) == 2
    assert one_error_line(capsys) == (
        f"error: {tmp_path / 'bad.pt'}: 'seen' is -1, not a count of images\n"
    )
    assert not (tmp_path / "x.weights").exists()


def test_convert_weights_takes_a_bare_source_with_output(tiny_pt, tmp_path, capsys):
    """Was: `convert_weights.py best.pt -o best.weights` (the source without --weights) was
    "error: give CFG SRC DST, SRC DST, or --weights SRC [--output DST]". Now it converts; an
    output given twice is still one line, exit 2, nothing written."""
    out = tmp_path / "o.weights"
    assert convert_weights.main(["--cfg", str(TINY), str(tiny_pt), "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()
    other = tmp_path / "p.weights"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(other), "-o", str(out)]) == 2
    assert one_error_line(capsys) == (
        "error: give CFG SRC DST, SRC DST, or [--weights] SRC [--output DST]\n"
    )
    assert not other.exists()


def test_convert_weights_cutoff_writes_a_backbone_as_darknet_partial(tiny_pt, tmp_path, capsys):
    """Was: no way to make a darknet53.conv.74-style file (Darknet's `partial`) but Python.
    --cutoff N writes layers 0..N-1 with seen 0, from a .pt or a .weights; --weights loads it."""
    darknet = tmp_path / "tiny.weights"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(darknet)]) == 0
    raw = bytearray(darknet.read_bytes())
    raw[12:20] = np.asarray([5000], dtype="<i8").tobytes()  # a trained file's seen
    darknet.write_bytes(bytes(raw))
    model = Darknet(TINY)
    expected = Darknet(TINY)
    load_weights(expected, darknet)
    for src in (tiny_pt, darknet):
        assert convert_weights.main(["--cfg", str(TINY), str(src), "--cutoff", "13"]) == 0
        part = src.with_name(f"{src.stem}.conv.12")
        assert np.fromfile(part, dtype="<i8", count=1, offset=12)[0] == 0
        assert load_darknet_weights(model, part, partial=True) == 13
        assert torch.equal(
            model.module_list[12].Conv2d.weight, expected.module_list[12].Conv2d.weight
        )
        part.unlink()
    capsys.readouterr()
    for n, line in (("0", "must be >= 1, got 0"), ("99", "must be in [1, 24], got 99")):
        assert convert_weights.main(["--cfg", str(TINY), str(darknet), "--cutoff", n]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"error: --cutoff {line}"
        assert not darknet.with_name(f"tiny.conv.{int(n) - 1}").exists()


def test_convert_weights_errors(tiny_pt, tmp_path, capsys):
    assert convert_weights.main([str(TINY), str(tiny_pt), str(tmp_path / "x.pt")]) == 2
    assert "one file must end in .weights" in one_error_line(capsys)
    assert convert_weights.main([str(NANO), str(tiny_pt), str(tmp_path / "x.weights")]) == 2
    assert "does not match" in one_error_line(capsys)
    short = tmp_path / "short.weights"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(short)]) == 0
    capsys.readouterr()  # its "wrote" line
    short.write_bytes(short.read_bytes()[:-400])
    assert convert_weights.main([str(TINY), str(short), str(tmp_path / "y.pt")]) == 2
    assert "truncated" in one_error_line(capsys)
    assert not (tmp_path / "y.pt").exists()


@pytest.mark.parametrize("extra", [[], ["--exist-ok"]])
def test_convert_weights_writes_only_the_other_formats_suffix(extra, tiny_pt, tmp_path, capsys):
    """Was: -o my.cfg --exist-ok wrote Darknet binary weights over a cfg (only .weights, .pt and
    .pth names were checked). A checkpoint now converts only to a .weights name, whatever is
    there: one line, exit 2, the file unchanged."""
    cfg = tmp_path / "my.cfg"
    cfg.write_text(TINY.read_text())
    before = cfg.read_bytes()
    assert convert_weights.main(["--weights", str(tiny_pt), "-o", str(cfg), *extra]) == 2
    assert one_error_line(capsys) == (
        "error: cannot convert 'tiny.pt' (torch) to 'my.cfg': one file must end in .weights and "
        "the other in .pt or .pth\n"
    )
    assert cfg.read_bytes() == before


def test_convert_weights_never_replaces_a_runs_checkpoint(tiny_pt, tmp_path, capsys):
    """Was: -o runs/x/last.pt --exist-ok replaced a finished run's resumable last.pt with
    converted weights (epoch -1). A run's file (results.csv beside it) is refused with one line
    naming another output, with or without --exist-ok; that other output is written."""
    darknet = tmp_path / "tiny.weights"
    assert convert_weights.main([str(TINY), str(tiny_pt), str(darknet)]) == 0
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text("epoch,mAP50\n0,0.5\n")
    last = run / "last.pt"
    last.write_bytes(tiny_pt.read_bytes())
    capsys.readouterr()
    for extra in ([], ["--exist-ok"]):
        argv = ["--weights", str(darknet), "--cfg", str(TINY), "-o", str(last), *extra]
        assert convert_weights.main(argv) == 2
        assert one_error_line(capsys) == (
            f"error: --output {last} is a file of the training run in {run}, which is never "
            f"replaced (not even with --exist-ok); choose another --output, e.g. "
            f"{run / 'last-converted.pt'}\n"
        )
        assert last.read_bytes() == tiny_pt.read_bytes()
    other = ["--weights", str(darknet), "--cfg", str(TINY), "-o", str(run / "last-converted.pt")]
    assert convert_weights.main(other) == 0
    assert convert_weights.main([*other, "--exist-ok"]) == 0
    # A folder of weights alone is no run: a conversion there is redone with --exist-ok (was:
    # weights/x/best.weights beside best.pt refused as "a file of the training run").
    kept = tmp_path / "weights" / "x"
    kept.mkdir(parents=True)
    shutil.copy(tiny_pt, kept / "best.pt")
    again = [str(kept / "best.pt"), "--cfg", str(TINY)]
    assert convert_weights.main(again) == 0 and (kept / "best.weights").is_file()
    assert convert_weights.main(again) == 2  # there: not without --exist-ok
    assert convert_weights.main([*again, "--exist-ok"]) == 0


# --------------------------------------------------------------------------------------------
# tools/export.py --include onnx (was tools/export_onnx.py)

HAVE_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(
    not HAVE_ONNX, reason="onnx/onnxruntime not installed (pip install -r requirements-onnx.txt)"
)
VERIFY_TOLERANCE = 1e-4  # relative and absolute, float32
VERIFY_BATCH = 2  # not the export batch (1), to exercise the dynamic batch axis


def verify_onnx(
    model: Darknet, path: Path, img_size: int | tuple[int, int] = 416, seed: int = 0
) -> float:
    """Run ``path`` with onnxruntime on a random batch of 2 and compare with ``model`` (eval
    mode) within 1e-4 relative and absolute; the largest absolute difference."""
    h, w = hw(img_size)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(VERIFY_BATCH, 3, h, w, generator=gen)
    model.eval()
    with torch.no_grad():
        expected = model(x)[0].numpy()
    got = FORMATS["onnx"].run(Path(path), x.numpy())
    np.testing.assert_allclose(got, expected, rtol=VERIFY_TOLERANCE, atol=VERIFY_TOLERANCE)
    return float(np.abs(got - expected).max())


def export_onnx_main(*argv: str) -> int:
    return export.main([*argv, "--include", "onnx"])


@needs_onnx
def test_export_onnx_matches_pytorch_with_dynamic_batch(tmp_path):
    import onnx

    out = tmp_path / "yolov3-spp-nano.onnx"
    argv = ["--cfg", str(NANO), "--img-size", "128", "160", "-o", str(tmp_path), "--no-verify"]
    assert export_onnx_main(*argv) == 0
    graph = onnx.load(str(out)).graph
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim[1:]] == [3, 128, 160]
    torch.manual_seed(0)
    model = Darknet(NANO)
    export_onnx(model, out, (128, 160))
    assert not model.training
    # verify_onnx runs a batch of 2 (exported with 1) and asserts 1e-4 agreement.
    assert verify_onnx(model, out, (128, 160)) < 1e-3


@needs_onnx
def test_export_onnx_cli_verify_with_weights(tiny_pt, tmp_path):
    argv = ["--cfg", str(TINY), "--weights", str(tiny_pt), "--img-size", "64", "-o", str(tmp_path)]
    assert export_onnx_main(*argv, "--verify") == 0
    assert (tmp_path / "tiny.onnx").is_file()


def _pad_values(graph) -> list[float]:
    """The constant value of every Pad node of an ONNX graph."""
    from onnx import numpy_helper

    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return [float(consts[n.input[2]]) for n in graph.node if n.op_type == "Pad"]


@needs_onnx
@pytest.mark.parametrize("name", ["yolov3-tiny.cfg", "yolov7-tiny.cfg"])
def test_export_onnx_darknet_maxpool_and_new_coords(tmp_path, name):
    import onnx

    # yolov3-tiny: the size=2 stride=1 max-pool pads with -inf (not zeros) after the image;
    # yolov7-tiny: new_coords heads, wh = (2 * sigmoid) ** 2 * anchor.
    torch.manual_seed(0)
    model = Darknet(REPO / "cfg" / "darknet" / name)
    out = tmp_path / "m.onnx"
    export_onnx(model, out, 64)
    assert verify_onnx(model, out, 64) < 1e-3
    pads = _pad_values(onnx.load(str(out)).graph)
    assert pads == ([float("-inf")] if name == "yolov3-tiny.cfg" else [])


def test_export_onnx_errors(tmp_path, capsys):
    out = ["-o", str(tmp_path), "--no-verify"]
    assert export_onnx_main("--cfg", str(TINY), "--opset", "10", *out) == 2
    assert "opset 11" in one_error_line(capsys)
    # Above what torch's exporter writes: one line, not its RuntimeError mid-export.
    too_new = "99"
    assert export_onnx_main("--cfg", str(TINY), "--opset", too_new, *out) == 2
    assert f"--opset {too_new}: torch" in one_error_line(capsys)
    assert not (tmp_path / "yolov3-tiny.onnx").exists()
    assert export_onnx_main("--cfg", str(TINY), "--img-size", "100", *out) == 2
    assert "--img-size 100 is not a positive multiple of 32" in one_error_line(capsys)
    assert export_onnx_main("--cfg", str(TINY), "--img-size", "64", "65536", *out) == 2
    assert "--img-size 65536 is larger than the limit 8192" in one_error_line(capsys)
    assert export_onnx_main("--cfg", str(TINY), "--img-size", "64", "64", "64", *out) == 2
    assert "H or H W" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# one output policy


def test_tools_refuse_an_existing_output_unless_exist_ok(tiny_pt, tmp_path, capsys):
    """Was: make_cfg -o X and convert_weights -o X wrote over whatever X was (a run's
    results.csv, an earlier output). Now one line naming it, the file kept, unless --exist-ok;
    a default output (beside the source) follows the same rule."""
    calls = {  # each with a name it may write (convert_weights: the other format's suffix)
        "make_cfg": (
            tmp_path / "results.csv",
            lambda *a: make_cfg.main([str(TINY), "--classes", "3", *a]),
        ),
        "convert_weights": (
            tmp_path / "mine.weights",
            lambda *a: convert_weights.main(["--weights", str(tiny_pt), "--cfg", str(TINY), *a]),
        ),
    }
    for tool, (taken, call) in calls.items():
        taken.write_text("epoch,mAP50\n0,0.5\n")
        assert call("-o", str(taken)) == 2, tool
        line = one_error_line(capsys)
        assert f"{taken} already exists; pass --exist-ok to replace, or choose another" in line
        assert taken.read_text() == "epoch,mAP50\n0,0.5\n", tool
        assert call("-o", str(taken), "--exist-ok") == 0, tool
        capsys.readouterr()
    default = tiny_pt.with_suffix(".weights")
    default.write_bytes(b"mine")
    assert convert_weights.main(["--weights", str(tiny_pt)]) == 2
    assert f"{default} already exists" in one_error_line(capsys)
    assert default.read_bytes() == b"mine"
    default.unlink()


def test_export_into_a_file_is_one_line(tiny_pt, tmp_path, capsys):
    """Was (tools/export_onnx.py -o R/results.csv): the CSV replaced by ONNX bytes, exit 0."""
    results = tmp_path / "results.csv"
    results.write_text("epoch\n")
    argv = ["--weights", str(tiny_pt), "--cfg", str(TINY), "--img-size", "64", "--no-verify"]
    assert export.main([*argv, "--include", "torchscript", "-o", str(results)]) == 2
    assert f"{results} is a file where a folder should be" in one_error_line(capsys)
    assert results.read_text() == "epoch\n"


def test_export_of_darknet_weights_runs_at_the_cfg_size_as_predict_does(tmp_path):
    """Was: a ``.weights`` file exported at 416 whatever its cfg's ``[net]`` said, while
    predict.py and validation.py run it at that size (as Darknet does): the export's fixed
    input differed from the model the user had checked."""
    cfg = tmp_path / "tiny-320.cfg"
    text = TINY.read_text()
    for key in ("width", "height"):
        text = text.replace(f"\n{key}=416\n", f"\n{key}=320\n")
    cfg.write_text(text)
    weights = tmp_path / "tiny.weights"
    save_weights(Darknet(cfg), weights)
    args = export.get_args_parser().parse_args(["--weights", str(weights), "--cfg", str(cfg)])
    assert export._load(args)[4] == (320, 320)
    assert default_img_size(read_weights(weights), cfg) == 320  # predict's and validation's
    pt = tmp_path / "tiny.pt"
    save_weights_pt(Darknet(cfg), pt)  # no run: the cfg's nominal size is not a trained one
    args = export.get_args_parser().parse_args(["--weights", str(pt), "--cfg", str(cfg)])
    assert export._load(args)[4] == (512, 512)
