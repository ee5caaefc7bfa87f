"""``--data`` with an ultralytics data.yaml: the schema, its error lines, and a run trained from
one in the ultralytics layout (images/<split>, labels/<split>) that resumes and is scored and
named by validation.py and predict.py from the same file."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_training, train_argv

import predict
from build_utils.datasets import LoadImagesAndLabels
from build_utils.errors import ConfigError
from build_utils.parse_config import parse_data_cfg
from train_utils import trainer as trainer_module
from train_utils.checkpoint import load_checkpoint
from train_utils.cli import parse_args
from train_utils.config import build_config, get_args_parser, load_data_config
from train_utils.distributed.process_group import DistInfo


def _yolo_layout(tmp_path: Path) -> Path:
    """An empty ultralytics layout: d/images/{train,val}, d/labels/{train,val}; returns d."""
    root = tmp_path / "d"
    for sub in ("images", "labels"):
        for split in ("train", "val", "extra"):
            (root / sub / split).mkdir(parents=True)
    return root


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_data_yaml_schema(tmp_path, monkeypatch, caplog):
    root = _yolo_layout(tmp_path)
    (root / "train.txt").write_text("images/train/a.jpg\n")
    yml = _write(
        root / "data.yaml",
        "path: .\n"
        "train: [images/train, images/extra]\n"
        "val: images/val\n"
        "test:\n"
        "names: {0: cat, 1: dog, 2: 7}\n"
        "download: https://example.com/d.zip\n"
        "roboflow: {workspace: w}\n",
    )
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        d = parse_data_cfg(Path("d/data.yaml"))
    assert d["classes"] == 3 and d["class_names"] == ["cat", "dog", "7"]
    # Keys quoted by a yaml written from JSON are class ids too (as ultralytics reads them).
    quoted = _write(
        tmp_path / "q" / "data.yaml", "train: a\nval: a\nnames: {'1': dog, \"0\": cat}\n"
    )
    assert parse_data_cfg(quoted)["class_names"] == ["cat", "dog"]
    assert [Path(p) for p in d["train"]] == [Path("d/images/train"), Path("d/images/extra")]
    assert Path(d["valid"]) == Path("d/images/val") and "test" not in d
    messages = [r.getMessage() for r in caplog.records]
    assert any("'download' ignored" in m and "data.yaml:6" in m for m in messages)
    assert any("unknown key(s) 'roboflow' (line 7)" in m for m in messages)

    # The same as a list, with nc; the folder of the yaml is the root without `path`.
    yml.write_text("train: train.txt\nval: images/val\nnc: 2\nnames: [cat, dog]\n")
    cfg = load_data_config(yml)
    assert cfg.nc == 2 and cfg.names == ["cat", "dog"]
    assert cfg.train == root / "train.txt" and cfg.valid == root / "images" / "val"
    assert load_data_config(yml, single_cls=True).names == ["object"]

    # `path` relative to the yaml's folder first, else to the current folder (YOLOv5's repo
    # root convention): d/cfg/data.yaml with path: d exists only from the current folder.
    moved = _write(root / "cfg" / "data.yaml", "path: d\ntrain: images/train\nval: images/val\n")
    moved.write_text(moved.read_text() + "names: [a]\n")
    assert Path(load_data_config(moved).valid) == Path("d/images/val")
    # Roboflow's export: data.yaml beside train/ saying ../train/images (ultralytics' reading).
    robo = _write(root / "data.yaml", "train: ../images/train\nval: ../images/val\nnames: [a]\n")
    assert load_data_config(robo).train == root / "images" / "train"

    (root / "cfg" / "d" / "images" / "train").mkdir(parents=True)
    beside = _write(root / "cfg" / "d" / "images" / "val" / "x.txt", "")
    assert load_data_config(moved).valid == beside.parent  # now it exists beside the yaml


def test_a_list_of_sources_is_trained_on_whole(tmp_path, make_shapes_data):
    """Two folders named in one `train:` list make one training set of both."""
    data = make_shapes_data(n_train=4, n_val=2, img_size_range=(64, 64))
    shapes = data.parent
    yml = _write(
        shapes / "two.yaml",
        "train: [train/images, val/images]\nval: val/images\nnames: "
        + str((shapes / "shapes.names").read_text().split())
        + "\n",
    )
    cfg = load_data_config(yml)
    ds = LoadImagesAndLabels(cfg.train, 64, 2, nc=cfg.nc)
    assert len(ds.img_files) == 6


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("train: a\nnames: [x]\n", r"data\.yaml: missing required key 'val'"),
        ("train: a\nval:\nnames: [x]\n", r"data\.yaml:2: 'val' has no value"),
        ("train: a\nval: a\n", r"data\.yaml: missing 'names'"),
        ("train: a\nval: a\nnames: {0: x, 2: y}\n", r":3: names: class ids must be 0\.\.1 .*1 is"),
        ("train: a\nval: a\nnames: {a: x}\n", r":3: names: class id 'a' is not an integer"),
        ("train: a\nval: a\nnames: {0: x, '0': y}\n", r":3: names: a class id is given twice"),
        ("train: a\nval: a\nnames: {'1': x, '2': y}\n", r":3: names: class ids must be 0\.\.1"),
        ("train: a\nval: a\nnames: [x, y]\nnc: 3\n", r":4: nc=3 but names lists 2 classes"),
        ("train: a\nval: a\nnc: 0\n", r":3: nc=0 must be a positive integer"),
        ("train: a\nval: a\nnames: x\n", r":3: names must be a list of class names or a"),
        ("train: a\nval: a\nnames: [x, [y]]\n", r":3: names: class 1 must be a non-empty name"),
        ("train: {a: 1}\nval: a\nnames: [x]\n", r":1: 'train' must be a path, got \{'a': 1\}"),
        ("- train\n", r"data\.yaml:1: expected a mapping of keys"),
        ("train: a\ntrain: b\n", r"data\.yaml:2: key 'train' is given twice"),
        ("train: [a\n", r"data\.yaml:2: not valid YAML"),
    ],
)
def test_data_yaml_errors_are_one_line_with_the_place(tmp_path, body, pattern):
    path = _write(tmp_path / "data.yaml", body)
    with pytest.raises(ConfigError, match=pattern) as info:
        parse_data_cfg(path)
    assert "\n" not in str(info.value)


def test_missing_split_source_names_the_line_and_root(tmp_path):
    path = _write(tmp_path / "d.yml", "path: ds\ntrain: images/train\nval: v\nnames: [x]\n")
    with pytest.raises(
        ConfigError, match=r"d\.yml:2: 'train' points to .*ds/images/train, .*'path'"
    ):
        load_data_config(path)


def test_a_data_yaml_named_dot_data_gets_a_hint(tmp_path):
    path = _write(tmp_path / "mine.data", "train: images/train\n")
    with pytest.raises(ConfigError, match=r"mine\.data:1: .*a data\.yaml\? name it mine\.yaml"):
        parse_data_cfg(path)


def test_a_coco_json_or_a_folder_as_data_says_what_it_is(tmp_path):
    """A COCO user's first tries: the instances JSON (told to rename it .yaml before) and the
    dataset folder (called 'not found')."""
    coco = _write(tmp_path / "instances_val.json", '{"images": [], "annotations": []}\n')
    with pytest.raises(ConfigError, match=r"instances_val\.json:1: .*a COCO JSON\? .*coco2yolo"):
        load_data_config(coco)
    with pytest.raises(ConfigError, match=r": is a folder, not a dataset file; pass an"):
        load_data_config(tmp_path)


@pytest.mark.slow
def test_training_from_a_data_yaml_resumes_and_names_classes(
    tmp_path, make_shapes_data, monkeypatch
):
    """The ultralytics layout trains from its data.yaml, resumes from last.pt alone, and
    predict.py takes the class names from the yaml."""
    data = make_shapes_data(n_train=8, n_val=4, img_size_range=(64, 80))
    shapes = data.parent
    root = tmp_path / "ultra"
    for split in ("train", "val"):
        for sub in ("images", "labels"):
            shutil.copytree(shapes / split / sub, root / sub / split)
    names = (shapes / "shapes.names").read_text().split()
    yml = _write(
        root / "shapes.yaml",
        "path: .\ntrain: images/train\nval: images/val\nnames:\n"
        + "".join(f"  {i}: {n}\n" for i, n in enumerate(names)),
    )
    out = tmp_path / "run"
    argv = train_argv(yml, out, "--nbs", "4", epochs=2, img=64, plots=True)

    real = trainer_module.train_one_epoch

    def interrupt_second_epoch(*args, **kwargs):
        if args[2] == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_one_epoch", interrupt_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        run_training(argv)
    monkeypatch.setattr(trainer_module, "train_one_epoch", real)
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["epoch"] == 0 and ckpt["names"] == names
    assert ckpt["config"]["data"]["path"] == str(yml)
    # The labels came from labels/<split>: the training set had its boxes.
    assert (out / "labels.png").is_file()

    monkeypatch.chdir(tmp_path)
    # The run's folder, as a user types it, means its last.pt (was: "no checkpoint there").
    config = build_config(parse_args(get_args_parser(), ["--resume", str(out), "--workers", "0"]))
    assert config.resume == str(out / "last.pt")
    assert config.data.path == yml and config.data.names == names
    trainer_module.run(config, DistInfo.single(torch.device("cpu")))
    assert load_checkpoint(out / "last.pt")["epoch"] == 1

    pargs = predict.get_parser().parse_args(
        ["--weights", str(out / "last.pt"), "--data", str(yml), "--source", str(root)]
    )
    _, got, _ = predict.load_model(pargs)
    assert got == names
