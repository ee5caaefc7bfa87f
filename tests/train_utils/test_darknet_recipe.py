"""train_utils/darknet_recipe.py: every training key a cfg may hold is either honoured by
``--recipe darknet`` or named when a cfg sets it (never silently dropped), unknown keys are
refused, the flags the cfg overrides are said once, and the start table shows each key's value
and source."""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import fields

import pytest
from conftest import NANO_CFG, train_argv

import train as train_script
from build_utils.darknet_data import DarknetLoaderSettings
from build_utils.errors import ConfigError
from build_utils.parse_config import KEYS, parse_model_cfg_text
from models.darknet_loss import YOLO_KEYS_HONOURED
from train_utils.darknet_recipe import (
    HONOURED,
    NOT_IMPLEMENTED,
    TRAINING_KEYS,
    apply_recipe,
    check_recipe_blocks,
    key_rows,
    log_default_recipe_note,
    log_key_table,
    start_iteration,
)
from train_utils.darknet_schedule import DarknetSettings

# Keys of the model (architecture and input), decided by the cfg under either recipe.
MODEL_KEYS = {
    "net": ("width", "height", "channels", "inputs", "bn_eps"),
    "yolo": ("mask", "anchors", "classes", "num", "scale_x_y", "new_coords", "map", "stopbackward"),
}
# The [net] keys DarknetSettings honours: its fields, each named as the key it reads.
NET_KEYS_HONOURED = tuple(f.name for f in fields(DarknetSettings))

LOADER_KEYS = {
    ("net", k)
    for k in ("flip", "letter_box", "hue", "saturation", "exposure", "resize_step", "mixup")
} | {("yolo", k) for k in ("jitter", "resize", "random")}


def _cfg(net: str = "", yolo: str = "", path: str = "x.cfg") -> list:
    text = (
        f"[net]\nwidth=64\nheight=64\nbatch=8\nsubdivisions=2\nmax_batches=10\n{net}\n"
        "[convolutional]\nfilters=21\nsize=1\nactivation=linear\n"
        f"[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\n{yolo}\n"
    )
    return parse_model_cfg_text(text, path)


def test_every_key_the_parser_accepts_has_a_status():
    """A key the cfg parser reads in [net] or [yolo] is either the model's or in the table:
    one added to the parser without a status here fails this test, not silently a run."""
    table = {(k.section, k.key) for k in TRAINING_KEYS}
    for section in ("net", "yolo"):
        for key in KEYS[section]:
            assert (section, key) in table or key in MODEL_KEYS[section], (section, key)
    assert len(table) == len(TRAINING_KEYS), "a key listed twice"


def test_what_the_pieces_implement_is_marked_honoured():
    honoured = {(k.section, k.key) for k in TRAINING_KEYS if k.status == HONOURED}
    assert {("net", k) for k in NET_KEYS_HONOURED} <= honoured
    loss = {("yolo", k) for k in YOLO_KEYS_HONOURED if k not in MODEL_KEYS["yolo"]}
    assert loss <= honoured
    assert honoured >= LOADER_KEYS
    # and what is marked honoured is read by some piece
    read = {("net", k) for k in NET_KEYS_HONOURED} | loss | LOADER_KEYS
    assert honoured == read


def test_unimplemented_keys_are_named_in_one_warning(caplog):
    blocks = _cfg("mosaic=1\nblur=1\nmixup=0\nadam=1\nangle=5", "delta_normalizer=0.5")
    rows = key_rows(blocks)
    with caplog.at_level(logging.INFO):
        log_key_table(rows, "x.cfg")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    named = warnings[0].split(": ", 1)[1].split(", ")
    # mixup=0 is Darknet's default (nothing to do); angle has no effect on detector training.
    assert named == ["mosaic=1", "blur=1", "adam=1", "delta_normalizer=0.5"]
    table = next(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "[net] subdivisions" in table and "[net] angle" in table
    status = {(r.section, r.key): (r.value, r.source, r.status) for r in rows}
    assert status["net", "batch"] == ("8", "[net]", HONOURED)
    assert status["net", "momentum"] == ("0.9", "default", HONOURED)
    assert status["net", "mosaic"] == ("1", "[net]", NOT_IMPLEMENTED)


def test_yolo_keys_that_differ_by_layer_show_each_value():
    text = (
        "[net]\nwidth=64\nheight=64\nbatch=8\nmax_batches=10\n"
        "[convolutional]\nfilters=21\nsize=1\nactivation=linear\n"
        "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nignore_thresh=.7\n"
        "[route]\nlayers=-2\n[convolutional]\nfilters=21\nsize=1\nactivation=linear\n"
        "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\n"
    )
    rows = {r.key: r for r in key_rows(parse_model_cfg_text(text, "two.cfg"))}
    assert rows["ignore_thresh"].value == "0.7 / 0.5"
    assert rows["ignore_thresh"].source == "[yolo] (1 of 2 layers)"


def test_unknown_keys_are_refused_with_their_line():
    with pytest.raises(ConfigError, match=r"x\.cfg:7: unknown key 'mosiac'"):
        _cfg("mosiac=1")


@pytest.mark.parametrize(
    ("net", "message"),
    [
        ("batch=1\nsubdivisions=1", "batch=1 trains one image an iteration"),
        ("max_batches=0", "max_batches=0 must be in 1..100000000"),
        ("max_batches=-5", "max_batches=-5 must be in 1..100000000"),
        ("policy=cosine", "policy=cosine is not one of"),
    ],
)
def test_training_keys_darknet_would_misread_are_refused(net, message):
    text = (
        "[net]\nwidth=64\nheight=64\n"
        + net
        + (
            "\n[convolutional]\nfilters=21\nsize=1\nactivation=linear\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\n"
        )
    )
    if "max_batches" not in net:
        text = text.replace("[net]\n", "[net]\nmax_batches=10\n", 1)
    if "batch=" not in net:
        text = text.replace("[net]\n", "[net]\nbatch=8\n", 1)
    with pytest.raises(ConfigError, match=message):
        check_recipe_blocks(parse_model_cfg_text(text, "x.cfg"))


def _args(recipe: str, given: set[str], **values) -> argparse.Namespace:
    base = {"recipe": recipe, "eval_iterations": None, "clear": False, "batch_size": 16}
    base.update(img_size=512, multi_scale=True, rect=False, ema=True, sync_bn=True, amp="auto")
    base.update(save_period=-1)
    return argparse.Namespace(**{**base, **values}, given=frozenset(given))


def test_the_cfg_decides_and_typed_flags_are_said_once(caplog):
    args = _args("darknet", {"batch_size", "epochs", "multi_scale"})
    with caplog.at_level(logging.WARNING):
        apply_recipe(args, _cfg())
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("these flags do not apply: --epochs, --batch-size, --multi-scale")
    assert (args.batch_size, args.img_size, args.multi_scale, args.ema) == (4, 64, False, False)
    assert (args.amp, args.sync_bn) == ("off", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        apply_recipe(_args("default", {"clear"}), _cfg())
    assert [r.getMessage() for r in caplog.records] == [
        "--clear applies only to --recipe darknet; ignored"
    ]


def test_the_default_recipe_says_the_keys_are_unused(caplog):
    with caplog.at_level(logging.INFO):
        log_default_recipe_note(_cfg("learning_rate=0.01"), "x.cfg")
    (line,) = [r.getMessage() for r in caplog.records]
    assert "x.cfg sets Darknet training keys (batch, subdivisions, max_batches" in line
    assert line.endswith("--recipe darknet trains as the cfg says")


def test_a_bad_recipe_cfg_is_one_line_before_a_run_folder(shapes_data, tmp_path, capsys):
    cfg = tmp_path / "nano.cfg"
    lines = NANO_CFG.read_text().splitlines()
    cfg.write_text("\n".join(x for x in lines if not x.startswith("max_batches")) + "\n")
    out = tmp_path / "run"
    code = train_script.main(train_argv(shapes_data, out, "--recipe", "darknet", cfg=cfg))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "max_batches=0 must be in" in err[0]
    assert not out.exists()


def test_loader_settings_come_from_the_last_yolo_layer():
    s = DarknetLoaderSettings.from_blocks(_cfg("flip=0\nhue=.1\nsaturation=0", "jitter=.1"))
    assert (s.flip, s.hue, s.saturation, s.jitter, s.classes) == (False, 0.1, 1.0, 0.1, 2)


def test_the_readme_table_is_the_recipes(repo_root):
    """README "Train as Darknet does" lists every key with the status the recipe gives it."""
    text = (repo_root / "README.md").read_text()
    section = text[text.index("## Train as Darknet does") :]
    rows = re.findall(
        r"^\| \[(net|yolo)\] \| `(\w+)` \| [^|]* \| [^|]* \| ([a-z ]+) \|$", section, re.M
    )
    assert rows == [(k.section, k.key, k.status) for k in TRAINING_KEYS]


def test_start_iteration_says_on_the_console_when_there_is_nothing_to_do(caplog) -> None:
    """A .weights file that has done max_batches (the run ends at once, with no weights) and a
    --clear with nothing to clear are warnings; were: info lines in train.log only."""
    settings = DarknetSettings(batch=4, subdivisions=2, max_batches=6)  # 4 images an update
    with caplog.at_level(logging.INFO):
        assert start_iteration(12, False, settings, "a.weights") == 3
        assert start_iteration(40, False, settings, "done.weights") == 6
        assert start_iteration(0, True, settings, "best.pt") == 0
        assert start_iteration(40, True, settings, "done.weights") == 0
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == "INFO" and "continues at iteration 4 of 6" in levels[0][1]
    assert levels[1][0] == "WARNING" and "max_batches=6 is done: nothing to train" in levels[1][1]
    assert levels[2][0] == "WARNING" and "--clear: --weights best.pt has no images" in levels[2][1]
    assert len(levels) == 3  # --clear of a file that has seen images: quiet, as Darknet's -clear
