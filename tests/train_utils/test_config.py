"""CLI, hyperparameter and .data validation: every user error is one ConfigError naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from build_utils.errors import ConfigError
from train_utils.config import (
    DEFAULT_CFG,
    DEFAULT_HYP,
    HYP_SPECS,
    REPO_ROOT,
    build_config,
    check_img_size,
    get_args_parser,
    load_data_config,
    load_hyp,
    multi_scale_bounds,
    repo_default,
)
from train_utils.optim import accumulate_steps, scaled_lr0


def _hyp_text(**override) -> str:
    values = {
        k: (s.default if s.default is not None else (0.5 if s.kind is float else True))
        for k, s in HYP_SPECS.items()
    }
    values.update(override)
    return "".join(
        f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n"
        for k, v in values.items()
        if v is not None
    )


def test_repository_hyp_files_are_valid(repo_root):
    for name in ("hyp.yaml", "hyp_demo.yaml"):
        hyp = load_hyp(repo_root / "cfg" / name)
        assert set(hyp) == set(HYP_SPECS)
    lineage = load_hyp(repo_root / "cfg" / "hyp.yaml")
    # The lineage's values for real datasets.
    assert (lineage["giou"], lineage["cls"], lineage["obj"], lineage["lr0"]) == (
        3.54,
        37.4,
        64.3,
        0.001,
    )


def test_hyp_unknown_key_names_line(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_text(_hyp_text() + "lr_0: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=rf"h.yaml:{len(HYP_SPECS) + 1}: unknown hyperparameter "
        r"'lr_0'",
    ):
        load_hyp(p)


def test_hyp_missing_wrong_type_and_range(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_text(_hyp_text(lr0=None))
    with pytest.raises(ConfigError, match="missing hyperparameter.*lr0"):
        load_hyp(p)
    p.write_text(_hyp_text(lr0="fast"))
    with pytest.raises(ConfigError, match=r"h.yaml:\d+: 'lr0' must be a number, got 'fast'"):
        load_hyp(p)
    p.write_text(_hyp_text(momentum=1.5))
    with pytest.raises(ConfigError, match=r"'momentum' = 1.5 is outside \[0.0, 1.0\]"):
        load_hyp(p)
    p.write_text(_hyp_text(mosaic=1))
    with pytest.raises(ConfigError, match="'mosaic' must be true or false"):
        load_hyp(p)
    p.write_text("giou: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_hyp(p)
    with pytest.raises(ConfigError, match="not found"):
        load_hyp(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "value, match",
    [
        ("1e6", r"'lr0' = 1000000.0 is outside \[0.0, 10.0\]$"),
        ("-2.5e+3", r"'lr0' = -2500.0 is outside \[0.0, 10.0\]$"),
        ("1" * 400, r"'lr0' = 111111111111...\(400 digits\) is outside \[0.0, 10.0\]$"),
        (".inf", r"'lr0' must be a finite number, got inf$"),
        (".nan", r"'lr0' must be a finite number, got nan$"),
        ("[0.1, 0.2]", r"'lr0' must be a number, got a list$"),
        ("{a: 1}", r"'lr0' must be a number, got a mapping$"),
        ("x" * 5000, r"'lr0' must be a number, got 'x+\.\.\.x+'$"),
    ],
)
def test_hyp_values_are_read_as_yaml_12_numbers_and_refused_in_one_short_line(
    tmp_path, value, match
):
    p = tmp_path / "h.yaml"
    p.write_text(_hyp_text(lr0=value))
    line = list(HYP_SPECS).index("lr0") + 1
    with pytest.raises(ConfigError, match=rf"h.yaml:{line}: {match}") as info:
        load_hyp(p)
    assert len(str(info.value)) < len(str(p)) + 150


def test_hyp_yaml_12_floats_are_accepted(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_text(_hyp_text(lr0="1e-2", weight_decay="5E-4", giou="3"))
    hyp = load_hyp(p)
    assert (hyp["lr0"], hyp["weight_decay"], hyp["giou"]) == (0.01, 5e-4, 3.0)
    assert type(hyp["giou"]) is float


def test_hyp_optional_keys_get_defaults(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_text(_hyp_text(warmup_epochs=None, mosaic=None))
    hyp = load_hyp(p)
    assert hyp["warmup_epochs"] == 1.0 and hyp["mosaic"] is True


def test_data_config_checks(shapes_data, tmp_path):
    d = load_data_config(shapes_data)
    assert d.nc == 5 and d.names[0] == "circle" and d.train.is_file()
    assert load_data_config(shapes_data, single_cls=True).nc == 1
    bad = tmp_path / "bad.data"
    bad.write_text(
        shapes_data.read_text()
        .replace("classes=5", "classes=4")
        .replace("names=shapes.names", f"names={shapes_data.parent / 'shapes.names'}")
        .replace("train=train.txt", f"train={shapes_data.parent / 'train.txt'}")
        .replace("valid=val.txt", f"valid={shapes_data.parent / 'val.txt'}")
    )
    with pytest.raises(ConfigError, match="classes=4 but .* lists 5 names"):
        load_data_config(bad)
    bad.write_text(
        "classes=5\ntrain=nowhere.txt\nvalid=nowhere.txt\n"
        f"names={shapes_data.parent / 'shapes.names'}\n"
    )
    with pytest.raises(ConfigError, match="'train' points to nowhere.txt"):
        load_data_config(bad)


def test_cli_values(shapes_data, repo_root):
    base = [
        "--data",
        str(shapes_data),
        "--cfg",
        str(repo_root / "cfg" / "yolov3-spp-nano.cfg"),
        "--hyp",
        str(repo_root / "cfg" / "hyp.yaml"),
    ]
    parser = get_args_parser()
    with pytest.raises(
        ConfigError, match="--img-size 300 is not a positive multiple of 32; use e.g. 288"
    ):
        build_config(parser.parse_args([*base, "--img-size", "300"]))
    with pytest.raises(ConfigError, match="--batch-size must be >= 1, got 0"):
        build_config(parser.parse_args([*base, "--batch-size", "0"]))
    cfg = build_config(parser.parse_args([*base, "--no-multi-scale", "--no-ema", "--name", "x"]))
    assert not cfg.multi_scale and not cfg.ema and str(cfg.output_dir).endswith("runs/x")
    # Real booleans: the lineage's `--amp False` trap cannot happen.
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--amp", "False"])
    assert parser.parse_args([*base, "--freeze-layers"]).freeze_layers == "all-but-heads"


def test_the_run_record_names_the_data_file_from_any_folder(
    shapes_data, repo_root, tmp_path, monkeypatch
):
    """Was: --data as typed (mydata/x.data), so --resume and validation.py --weights alone run
    from another folder said "dataset file not found"."""
    monkeypatch.chdir(shapes_data.parent.parent)
    relative = Path(shapes_data.parent.name) / shapes_data.name
    argv = ["--data", str(relative), "--cfg", str(repo_root / "cfg" / "yolov3-spp-nano.cfg")]
    argv += ["--output-dir", str(tmp_path / "run")]
    recorded = build_config(get_args_parser().parse_args(argv)).to_dict()["data"]["path"]
    assert recorded == str(shapes_data) and Path(recorded).is_absolute()


def test_derived_values():
    assert check_img_size(416) == 416
    assert accumulate_steps(64, 16, 1, None) == 4
    assert accumulate_steps(64, 16, 2, None) == 2
    assert accumulate_steps(64, 64, 4, None) == 1
    assert accumulate_steps(64, 16, 1, 3) == 3
    assert scaled_lr0(0.01, 32, 64) == 0.01 and scaled_lr0(0.01, 256, 64) == 0.04
    lo, hi = multi_scale_bounds(512)
    assert (lo, hi) == (352, 768) and lo % 32 == 0 and hi % 32 == 0


def test_workers_default_is_left_to_the_node(shapes_data, repo_root):
    """No --workers: None in the config (resolve_workers picks it per node); an explicit value
    is kept; a negative one is refused."""
    base = ["--data", str(shapes_data), "--cfg", str(repo_root / "cfg" / "yolov3-spp-nano.cfg")]
    assert build_config(get_args_parser().parse_args(base)).workers is None
    assert build_config(get_args_parser().parse_args([*base, "--workers", "3"])).workers == 3
    with pytest.raises(ConfigError, match="--workers must be >= 0, got -1"):
        build_config(get_args_parser().parse_args([*base, "--workers", "-1"]))


def test_a_cfg_that_is_no_regular_file_is_named_as_such(shapes_data, tmp_path):
    """Was: --cfg /dev/zero (or a folder) said "model cfg not found"; every other input names
    the kind of file. A missing cfg keeps its hint."""
    parser = get_args_parser()

    def error(cfg: str) -> str:
        with pytest.raises(ConfigError) as e:
            build_config(parser.parse_args(["--data", str(shapes_data), "--cfg", cfg]))
        return str(e.value)

    assert error("/dev/zero") == "/dev/zero: model cfg: a character device, not a regular file"
    assert error(str(tmp_path)) == f"{tmp_path}: model cfg: a folder, not a file"
    missing = tmp_path / "nope.cfg"
    assert error(str(missing)) == f"{missing}: model cfg not found; pass an existing .cfg to --cfg"


def test_default_cfg_and_hyp_are_found_from_any_working_folder(tmp_path, monkeypatch):
    """``python ~/yolo/train.py`` run from a data folder: the default --hyp/--cfg are the shipped
    files (YOLOv5 resolves its defaults against its root); a path the user typed is kept, and a
    working folder's own cfg/hyp.yaml wins over the shipped one."""
    monkeypatch.chdir(tmp_path)
    shipped = (REPO_ROOT / DEFAULT_HYP).resolve()
    assert Path(repo_default(DEFAULT_HYP, DEFAULT_HYP)).resolve() == shipped
    assert Path(repo_default(DEFAULT_CFG, DEFAULT_CFG)).resolve() == REPO_ROOT / DEFAULT_CFG
    assert repo_default("my/hyp.yaml", DEFAULT_HYP) == "my/hyp.yaml"  # typed: never redirected
    (tmp_path / "cfg").mkdir()
    (tmp_path / DEFAULT_HYP).write_text("lr0: 0.01\n")
    assert repo_default(DEFAULT_HYP, DEFAULT_HYP) == DEFAULT_HYP
