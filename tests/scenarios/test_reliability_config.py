"""Reliability, configuration and untrusted files: every configuration mistake (cfg, .data, hyp,
flags, weights, checkpoints) stops a real entry point with exit status 2 and ONE ``error:`` line
naming the file (and line or key) and the fix, with no traceback; nothing loads a pickle that
could run code unless ``--trust-checkpoint`` is given.

The cases run through each script's ``main()`` (what ``python script.py`` runs); one of them also
runs as a process to pin the process-level exit status and stderr. docs/RELIABILITY.md lists them.
"""

from __future__ import annotations

import ast
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import train_argv, validation_argv

import predict
import train as train_script
import train_multi_GPU
import validation
from data.make_shapes import make_dataset
from models.darknet import Darknet, model_blocks_for
from models.weights import save_weights
from tools import convert_weights, kmeans_anchors, make_cfg
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
NANO = REPO / "cfg" / "yolov3-spp-nano.cfg"
HYP = REPO / "cfg" / "hyp.yaml"
NC = 5  # the shapes dataset


class _Evil:
    """Pickles as a call to os.mkdir: loading it with full unpickling would create the folder."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def _line_of(path: Path, prefix: str) -> int:
    return next(
        i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(prefix)
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A small valid dataset plus one broken file per case (all made here)."""
    root = tmp_path_factory.mktemp("cfgcases")
    data = make_dataset(root / "shapes", 8, 2, img_size_range=(96, 128), seed=0, workers=1)
    f: dict[str, Path] = {"root": root, "data": data}

    def text(name: str, content: str) -> Path:
        p = root / name
        p.write_text(content)
        return p

    cfg = NANO.read_text()
    f["cfg_typo"] = text("typo.cfg", cfg.replace("filters=8", "filtrs=8", 1))
    f["cfg_value"] = text("value.cfg", cfg.replace("size=3", "size=three", 1))
    names = data.parent / "shapes.names"
    f["data_nokey"] = text(
        "nokey.data", f"classes={NC}\ntrain={data.parent / 'train.txt'}\nnames={names}\n"
    )
    f["data_nopath"] = text(
        "nopath.data",
        f"classes={NC}\ntrain={root / 'nope.txt'}\n"
        f"valid={data.parent / 'val.txt'}\nnames={names}\n",
    )
    f["data_classes"] = text(
        "classes.data",
        f"classes=4\ntrain={data.parent / 'train.txt'}\n"
        f"valid={data.parent / 'val.txt'}\nnames={names}\n",
    )
    hyp = HYP.read_text()
    f["hyp_unknown"] = text("unknown.yaml", hyp + "lr_0: 0.01\n")
    f["hyp_missing"] = text(
        "missing.yaml", "\n".join(line for line in hyp.splitlines() if not line.startswith("giou:"))
    )
    f["hyp_type"] = text("type.yaml", hyp.replace("lr0: 0.001", "lr0: fast"))
    f["hyp_bool"] = text("bool.yaml", hyp.replace("mosaic: true", "mosaic: 3"))

    model = Darknet(model_blocks_for(NANO, NC), img_size=(128, 128))
    sd = model.state_dict()
    torch.save({"model": sd, "epoch": -1, "optimizer": None}, root / "good.pt")
    raw = (root / "good.pt").read_bytes()
    (root / "truncated.pt").write_bytes(raw[: len(raw) // 2])
    f["truncated_pt"] = root / "truncated.pt"
    f["weights_pt"] = root / "good.pt"
    f["text_pt"] = text("text.pt", "this is not a checkpoint\n")
    torch.save([1, 2, 3], root / "list.pt")
    f["list_pt"] = root / "list.pt"
    torch.save({"foo": 1, "bar": "x"}, root / "nomodel.pt")
    f["nomodel_pt"] = root / "nomodel.pt"
    f["evil_target"] = root / "pwned_by_pickle"
    torch.save({"model": _Evil(f["evil_target"])}, root / "evil.pt")
    f["evil_pt"] = root / "evil.pt"
    save_weights(model, root / "full.weights")
    dw = (root / "full.weights").read_bytes()
    (root / "truncated.weights").write_bytes(dw[: len(dw) - 4000])
    f["truncated_weights"] = root / "truncated.weights"
    other = Darknet(NANO, img_size=(128, 128)).state_dict()  # 80 classes
    torch.save({"model": other}, root / "other80.pt")
    f["other_pt"] = root / "other80.pt"
    torch.save(
        {"model": other, "optimizer": {"state": {}, "param_groups": []}, "epoch": 3},
        root / "other_ckpt.pt",
    )
    f["other_ckpt"] = root / "other_ckpt.pt"
    return f


@dataclass
class Case:
    """One mistake: the script, its extra arguments (from the fixture files), the fragments the
    error line must hold, and whether it must stop before the run folder exists."""

    script: str
    extra: Callable[[dict], list[str]]
    expect: Callable[[dict], list[str]]
    early: bool = True


CASES: dict[str, Case] = {
    # ---- model cfg
    "cfg unknown key": Case(
        "train",
        lambda f: ["--cfg", str(f["cfg_typo"])],
        lambda f: [
            f"{f['cfg_typo']}:{_line_of(f['cfg_typo'], 'filtrs')}: unknown key 'filtrs' "
            "in [convolutional]; known keys: "
        ],
        early=False,
    ),
    "cfg non-numeric value": Case(
        "train",
        lambda f: ["--cfg", str(f["cfg_value"])],
        lambda f: [f"{f['cfg_value']}:{_line_of(f['cfg_value'], 'size=three')}: ", "'size'"],
        early=False,
    ),
    "cfg not found": Case(
        "train",
        lambda f: ["--cfg", str(f["root"] / "nope.cfg")],
        lambda f: ["nope.cfg: model cfg not found; pass an existing .cfg"],
    ),
    # ---- .data
    "data missing key": Case(
        "train",
        lambda f: ["--data", str(f["data_nokey"])],
        lambda f: [f"{f['data_nokey']}: missing required key 'valid'"],
    ),
    "data path does not exist": Case(
        "train",
        lambda f: ["--data", str(f["data_nopath"])],
        lambda f: [
            f"{f['data_nopath']}:2: 'train' points to {f['root'] / 'nope.txt'}, which does not "
            "exist"
        ],
    ),
    "data classes vs names": Case(
        "train",
        lambda f: ["--data", str(f["data_classes"])],
        lambda f: [f"{f['data_classes']}:1: classes=4 but", "lists 5 names"],
    ),
    "data file not found": Case(
        "train",
        lambda f: ["--data", str(f["root"] / "nope.data")],
        lambda f: [
            "nope.data: dataset file not found; pass an existing .data or data.yaml file to --data"
        ],
    ),
    # ---- hyp.yaml
    "hyp unknown key": Case(
        "train",
        lambda f: ["--hyp", str(f["hyp_unknown"])],
        lambda f: [
            f"{f['hyp_unknown']}:{_line_of(f['hyp_unknown'], 'lr_0')}: unknown "
            "hyperparameter 'lr_0'; known keys: giou, "
        ],
    ),
    "hyp missing key": Case(
        "train",
        lambda f: ["--hyp", str(f["hyp_missing"])],
        lambda f: [f"{f['hyp_missing']}: missing hyperparameter(s) giou; add them"],
    ),
    "hyp wrong type": Case(
        "train",
        lambda f: ["--hyp", str(f["hyp_type"])],
        lambda f: [
            f"{f['hyp_type']}:{_line_of(f['hyp_type'], 'lr0:')}: 'lr0' must be a number, got 'fast'"
        ],
    ),
    "hyp bool wrong type": Case(
        "train",
        lambda f: ["--hyp", str(f["hyp_bool"])],
        lambda f: [
            f"{f['hyp_bool']}:{_line_of(f['hyp_bool'], 'mosaic:')}: 'mosaic' must be "
            "true or false, got 3"
        ],
    ),
    # ---- flags
    "img-size not a multiple of 32": Case(
        "train",
        lambda f: ["--img-size", "100"],
        lambda f: ["--img-size 100 is not a positive multiple of 32; use e.g. 96"],
    ),
    "batch size 0": Case(
        "train", lambda f: ["--batch-size", "0"], lambda f: ["--batch-size must be >= 1, got 0"]
    ),
    "epochs 0": Case("train", lambda f: ["--epochs", "0"], lambda f: ["--epochs must be >= 1"]),
    # Was: accepted, and the checkpoint it wrote could never be resumed (planned_epochs).
    "epochs beyond a checkpoint's": Case(
        "train",
        lambda f: ["--epochs", "100000001"],
        lambda f: ["--epochs must be in [1, 100000000], got 100000001"],
    ),
    # Was: OverflowError (a traceback) at the first loss divided by the accumulation.
    "nbs huge": Case(
        "train",
        lambda f: ["--nbs", "9" * 20],
        lambda f: ["--nbs must be in [1, 100000000], got 999999999999... (20 digits)"],
    ),
    "accumulate huge": Case(
        "train",
        lambda f: ["--accumulate", "9" * 20],
        lambda f: ["--accumulate must be in [1, 100000000], got 999999999999... (20 digits)"],
    ),
    # ---- --weights
    "weights not found": Case(
        "train",
        lambda f: ["--weights", str(f["root"] / "nope.pt")],
        lambda f: ["nope.pt: weights file not found; check --weights"],
    ),
    "weights truncated .pt": Case(
        "train",
        lambda f: ["--weights", str(f["truncated_pt"])],
        lambda f: [
            f"{f['truncated_pt']}: cannot read checkpoint: the file is truncated, "
            "corrupt or not a PyTorch checkpoint"
        ],
        # Was: found once the run folder was made (its train.log set aside in failed-<time>/).
    ),
    "weights text file .pt": Case(
        "train",
        lambda f: ["--weights", str(f["text_pt"])],
        lambda f: [f"{f['text_pt']}: cannot read checkpoint"],
        early=False,
    ),
    "weights .pt holding a list": Case(
        "train",
        lambda f: ["--weights", str(f["list_pt"])],
        lambda f: [f"{f['list_pt']}: not a checkpoint: the file holds a list"],
        early=False,
    ),
    "weights .pt without a model": Case(
        "train",
        lambda f: ["--weights", str(f["nomodel_pt"])],
        lambda f: [
            f"{f['nomodel_pt']}: not a checkpoint: no model weights found in a dict "
            "with keys 'foo', 'bar'"
        ],
        early=False,
    ),
    "weights truncated .weights": Case(
        "train",
        lambda f: ["--weights", str(f["truncated_weights"])],
        lambda f: [
            f"{f['truncated_weights']}: truncated or for another cfg: ",
            "needs 1,",
            "the file holds 1,",
        ],
        early=False,
    ),
    "weights with pickled code": Case(
        "train",
        lambda f: ["--weights", str(f["evil_pt"])],
        lambda f: [
            f"{f['evil_pt']}: checkpoint contains Python objects other than tensors",
            "pass --trust-checkpoint only if the file comes from a trusted source",
        ],
        early=False,
    ),
    # ---- --resume
    "resume from another cfg": Case(
        "train",
        lambda f: ["--resume", str(f["other_ckpt"])],
        lambda f: [
            f"{f['other_ckpt']}: checkpoint is for another model: ",
            "checkpoint (255, 64, 1, 1) vs model (30, 64, 1, 1)",
            "use --weights to initialise from it instead",
        ],
        early=False,
    ),
    "resume truncated": Case(
        "train",
        lambda f: ["--resume", str(f["truncated_pt"])],
        lambda f: [f"{f['truncated_pt']}: cannot read checkpoint"],
        early=False,
    ),
    "resume from plain weights": Case(
        "train",
        lambda f: ["--resume", str(f["weights_pt"])],
        lambda f: [
            f"{f['weights_pt']}: not a resumable training checkpoint: missing "
            "'optimizer'; use --weights"
        ],
        early=False,
    ),
    "resume with nothing to resume": Case(
        "train",
        lambda f: ["--resume"],
        lambda f: ["--resume: no checkpoint in ", "(no last.pt)"],
    ),
    "weights that are an image": Case(
        "train",
        lambda f: ["--weights", str(next((f["data"].parent / "train").rglob("*.jpg")))],
        lambda f: ["not a weights file but a JPEG image", "pass a .pt checkpoint"],
    ),
    "resume of a data file": Case(
        "train",
        lambda f: ["--resume", str(f["data"])],
        lambda f: [f"--resume: {f['data']}: not a weights file but a text file"],
    ),
    # ---- validation.py
    "validation truncated .pt": Case(
        "validation",
        lambda f: ["--weights", str(f["truncated_pt"])],
        lambda f: [f"{f['truncated_pt']}: cannot read checkpoint"],
    ),
    "validation weights for other classes": Case(
        "validation",
        lambda f: ["--weights", str(f["other_pt"])],
        lambda f: [
            f"{f['other_pt']}: 6 tensors do not fit the model built from the cfg",
            "pass the --cfg (and --data) the weights were trained with",
        ],
    ),
    "validation pickled code": Case(
        "validation",
        lambda f: ["--weights", str(f["evil_pt"])],
        lambda f: ["pass --trust-checkpoint only if"],
    ),
    "validation img-size": Case(
        "validation",
        lambda f: ["--img-size", "100"],
        lambda f: ["--img-size 100 is not a positive multiple of 32"],
    ),
    "validation batch size 0": Case(
        "validation",
        lambda f: ["--batch-size", "0"],
        lambda f: ["--batch-size must be >= 1, got 0"],
    ),
    # ---- predict.py
    "predict text .pt": Case(
        "predict",
        lambda f: ["--weights", str(f["text_pt"])],
        lambda f: [f"{f['text_pt']}: cannot read checkpoint"],
    ),
    "predict weights without a cfg": Case(
        "predict",
        lambda f: ["--weights", str(f["weights_pt"])],
        lambda f: [f"{f['weights_pt']}: these weights carry no model cfg"],
    ),
    "predict missing source": Case(
        "predict",
        lambda f: [
            "--weights",
            str(f["weights_pt"]),
            "--cfg",
            str(model_cfg_for(f)),
            "--source",
            str(f["root"] / "nothing.jpg"),
        ],
        lambda f: ["nothing.jpg: --source: no such file or folder"],
        early=False,
    ),
    # ---- train_multi_GPU.py launched with plain python, and the tools
    "train_multi_GPU hyp unknown key": Case(
        "train_multi_GPU",
        lambda f: ["--hyp", str(f["hyp_unknown"])],
        lambda f: [f"{f['hyp_unknown']}:", "unknown hyperparameter 'lr_0'"],
    ),
    "convert_weights truncated .weights": Case(
        "convert_weights",
        lambda f: [str(model_cfg_for(f)), str(f["truncated_weights"]), str(f["root"] / "x.pt")],
        lambda f: [f"{f['truncated_weights']}: truncated or for another cfg"],
    ),
    "make_cfg malformed cfg": Case(
        "make_cfg",
        lambda f: [str(f["cfg_typo"]), "--classes", "3", "-o", str(f["root"] / "y.cfg")],
        lambda f: [f"{f['cfg_typo']}:", "unknown key 'filtrs'"],
    ),
    "kmeans_anchors .data missing key": Case(
        "kmeans_anchors",
        lambda f: ["--data", str(f["data_nokey"])],
        lambda f: [f"{f['data_nokey']}: missing required key 'valid'"],
    ),
}


def model_cfg_for(f: dict) -> Path:
    """The 5-class nano cfg the weights files were written for (tools take a cfg path)."""
    path = f["root"] / "nano5.cfg"
    if not path.is_file():
        make_cfg.make_cfg(NANO, NC, path)
    return path


def _invoke(name: str, f: dict, out: Path, extra: list[str]) -> int:
    if name in ("train", "train_multi_GPU"):
        main = train_script.main if name == "train" else train_multi_GPU.main
        return main(train_argv(f["data"], out, *extra))
    if name == "validation":
        return validation.main(
            validation_argv(
                NANO, f["data"], f["weights_pt"], "--save-dir", str(out / "val"), *extra, batch=None
            )
        )
    if name == "predict":
        return predict.main(
            [
                "--weights",
                str(f["weights_pt"]),
                "--source",
                str(f["data"].parent / "val" / "images"),
                "--output",
                str(out),
                "--img-size",
                "128",
                "--device",
                "cpu",
                *extra,
            ]
        )
    tool = {
        "convert_weights": convert_weights,
        "make_cfg": make_cfg,
        "kmeans_anchors": kmeans_anchors,
    }[name]
    return tool.main(extra)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_configuration_mistake_is_one_line_and_exit_2(case, env, console, tmp_path):
    c = CASES[case]
    out = tmp_path / "run"
    code = _invoke(c.script, env, out, c.extra(env))
    err = console.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    for fragment in c.expect(env):
        assert fragment in errors[0], (fragment, errors[0])
    if c.early:
        # Stopped before any work: nothing but the error line, no run folder.
        assert len(lines) == 1 or c.script in ("train_multi_GPU", "validation"), lines
        assert not out.exists()
    assert not env["evil_target"].exists()


def test_cfg_classes_disagreeing_with_the_data_are_rewritten_not_fatal(env, caplog):
    with caplog.at_level(logging.WARNING):
        blocks = model_blocks_for(NANO, NC)
    assert f"has classes=80 but the dataset has {NC}; rewriting the heads" in caplog.text
    assert {int(b["classes"]) for b in blocks if b["type"] == "yolo"} == {NC}


def test_a_head_without_classes_has_darknets_20_and_is_rewritten(tmp_path, caplog):
    """Was: a [yolo] block without classes= (Darknet's default, 20) passed the parser, then
    model_blocks_for raised KeyError: 'classes' (a traceback from train.py)."""
    text = NANO.read_text().replace("classes=80\n", "")
    text = text.replace("filters=255\n", "filters=75\n")  # 3 * (20 + 5)
    cfg = tmp_path / "no-classes.cfg"
    cfg.write_text(text)
    with caplog.at_level(logging.WARNING):
        blocks = model_blocks_for(cfg, NC)
    assert f"has classes=20 but the dataset has {NC}; rewriting the heads" in caplog.text
    assert Darknet(blocks, img_size=(64, 64)).nc == NC


@pytest.mark.slow
def test_entry_point_process_exits_2_with_one_line(env, tmp_path):
    """The same contract at the process level: exit status 2, stderr exactly one line."""
    out = tmp_path / "run"
    argv = [sys.executable, str(REPO / "train.py")]
    argv += train_argv(env["data"], out, hyp=env["hyp_unknown"])
    proc = warm_python.run(
        argv, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120
    )
    line = _line_of(env["hyp_unknown"], "lr_0")
    assert proc.returncode == 2 and proc.stdout == ""
    [only] = proc.stderr.splitlines()
    assert only.startswith(
        f"error: {env['hyp_unknown']}:{line}: unknown hyperparameter 'lr_0'; "
        "known keys: giou, cls, "
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Untrusted files

PRODUCT_SKIP = {"tests", ".venv", "runs", "demo_data", "weights", ".git"}


def _product_files() -> list[Path]:
    return sorted(
        p
        for p in REPO.rglob("*.py")
        if not (set(p.relative_to(REPO).parts[:-1]) & PRODUCT_SKIP)
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    )


def _calls(tree: ast.AST, module: str, attr: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == attr
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == module
    ]


def _kw(call: ast.Call, name: str) -> str | None:
    return next((ast.unparse(k.value) for k in call.keywords if k.arg == name), None)


def test_every_torch_load_is_weights_only_except_the_trust_flag():
    files = _product_files()
    assert REPO / "train_utils" / "checkpoint.py" in files and len(files) > 20
    loads: dict[str, list[str | None]] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = str(path.relative_to(REPO))
        for call in _calls(tree, "torch", "load"):
            loads.setdefault(rel, []).append(_kw(call, "weights_only"))
        for call in _calls(tree, "np", "load"):
            assert _kw(call, "allow_pickle") == "False", rel
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not {"pickle", "cPickle", "dill", "joblib", "shelve"} & set(names), rel
            if isinstance(node, ast.Call):
                assert _kw(node, "shell") not in ("True",), rel  # no shell=True anywhere
                assert ast.unparse(node.func) not in (
                    "os.system",
                    "os.popen",
                    "os.path.expandvars",
                    "eval",
                    "exec",
                ), rel
    # Every call says weights_only=True but load_checkpoint's `not trust`: the one path behind
    # --trust-checkpoint.
    others = [(f, w) for f, ws in loads.items() for w in ws if w != "True"]
    assert others == [("train_utils/checkpoint.py", "not trust")], others
    # One checkpoint module reads every .pt (issue #12: no second loader elsewhere).
    assert set(loads) == {"train_utils/checkpoint.py"}, loads


def test_trust_checkpoint_is_explicit_and_warns(env, caplog, tmp_path):
    with pytest.raises(Exception, match="--trust-checkpoint"):
        load_checkpoint(env["evil_pt"])
    assert not env["evil_target"].exists()
    # A plain file loads the same with the flag, with a warning that it runs code.
    with caplog.at_level(logging.WARNING, logger="train_utils.checkpoint"):
        ckpt = load_checkpoint(env["weights_pt"], trust=True)
    assert ckpt["epoch"] == -1
    assert "weights_only=False (--trust-checkpoint): this runs code stored in the file" in (
        caplog.text
    )


def test_resume_of_something_else_writes_nothing_beside_it(env, console, tmp_path):
    """--resume of a data file or an image: one line naming it, nothing written in the data's
    folder (was: "records no run arguments", then train.log beside the data), and never
    PyTorch's advice to load with weights_only=False."""
    data_dir = env["data"].parent
    image = next((data_dir / "train").rglob("*.jpg"))
    before = sorted(p.relative_to(data_dir) for p in data_dir.rglob("*"))
    for thing in (env["data"], image, data_dir / "shapes.names"):
        assert train_script.main(["--resume", str(thing), "--device", "cpu"]) == 2
        err = console.readouterr().err
        assert err.startswith(f"error: --resume: {thing}: not a weights file but "), err
        assert "weights_only" not in err and err.count("\n") == 1, err
        # What --resume takes (was: "or Darknet .weights", which --resume then refuses).
        assert err.endswith("; pass a run's last.pt\n") and ".weights" not in err, err
    assert sorted(p.relative_to(data_dir) for p in data_dir.rglob("*")) == before


@pytest.mark.slow
def test_a_failed_start_frees_the_run_name(env, console, tmp_path):
    """A start that fails after claiming its folder (here: an empty image list) moves what it
    wrote into failed-<time>/; the fixed rerun with the same --name writes that folder (was:
    e52, with a note that --resume continues e5, where there was nothing to resume)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    names = env["data"].parent / "shapes.names"
    bad = tmp_path / "bad.data"
    bad.write_text(f"classes={NC}\ntrain={empty}\nvalid={empty}\nnames={names}\n")
    project = tmp_path / "runs"
    argv = ["--project", str(project), "--name", "e5"]
    assert train_script.main(train_argv(bad, None, *argv, epochs=1)) == 2
    console.readouterr()
    (failed,) = (project / "e5").glob("failed-*")
    assert (failed / "train.log").is_file() and not (project / "e5" / "train.log").exists()
    assert train_script.main(train_argv(env["data"], None, *argv, epochs=1, img=64)) == 0
    err = console.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["e5"], err
    assert (project / "e5" / "last.pt").is_file() and "--resume continues" not in err


@pytest.mark.slow
def test_ctrl_c_while_starting_frees_the_run_name(env, console, tmp_path, monkeypatch):
    """Was: Ctrl-C before the first checkpoint (here: while the data is read) left runs/e6
    holding only train.log: ``--resume`` found nothing there, and the next run of that name,
    told runs/e6 held a run, wrote runs/e62. Now as a failed start: set aside, name free."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    project = tmp_path / "runs"
    argv = ["--project", str(project), "--name", "e6"]
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "_train_data", interrupted)
        assert train_script.main(train_argv(env["data"], None, *argv, epochs=1)) == 130
    console.readouterr()
    (failed,) = (project / "e6").glob("failed-*")
    assert (failed / "train.log").is_file() and not (project / "e6" / "train.log").exists()
    assert train_script.main(train_argv(env["data"], None, *argv, epochs=1, img=64)) == 0
    assert sorted(p.name for p in project.iterdir()) == ["e6"], console.readouterr().err


def test_resume_of_a_named_run_without_a_checkpoint_says_so(env, console, tmp_path):
    """--project P --name X --resume where P/X holds no last.pt: that, in one line (was: the
    default data/my_data.data reported missing)."""
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    argv = ["--resume", "--project", str(tmp_path / "runs"), "--name", "x", "--device", "cpu"]
    assert train_script.main(argv) == 2
    err = console.readouterr().err
    assert (
        err == f"error: --resume: no checkpoint in {run} (no last.pt): that run never finished "
        "an epoch, or another --name/--project was meant\n"
    )
    assert sorted(run.iterdir()) == []
