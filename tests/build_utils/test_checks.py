"""build_utils/checks.py: the small checks every input goes through, each against hand-written
cases (booleans are not numbers, huge integers and tensors shown short)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from build_utils import checks
from build_utils.errors import ConfigError


@pytest.mark.parametrize(
    "value, is_int, is_real",
    [
        (3, True, True),
        (True, False, False),
        (2.5, False, True),
        (math.inf, False, False),
        (math.nan, False, False),
        (10**400, True, False),  # no float holds it
        ("3", False, False),
        (None, False, False),
    ],
)
def test_numbers_are_ints_and_finite_reals_never_booleans(value, is_int, is_real):
    assert checks.is_int(value) is is_int and checks.is_real(value) is is_real
    assert checks.finite_float(value) == (float(value) if is_real else None)


def test_values_are_shown_short_on_one_line():
    assert checks.shown(10**400) == "100000000000... (401 digits)"
    assert checks.shown(10**5000) == "(an integer of about 5000 digits)"  # past str()'s limit
    assert checks.shown("a\nb  c") == "'a\\nb c'"
    assert checks.shown("x" * 100) == "'" + "x" * 39 + "..."
    assert checks.shown(torch.zeros(2, 3, dtype=torch.int64)) == "(a int64 tensor of shape (2, 3))"
    assert checks.shown(np.zeros(4, dtype=np.float32)) == "(a float32 tensor of shape (4,))"


def test_range_and_choice_checks_word_their_errors_one_way():
    checks.check_at_least({"--epochs": 3, "--workers": None}, 1)
    with pytest.raises(ConfigError, match=r"^--epochs must be >= 1, got 0$"):
        checks.check_at_least({"--epochs": 0}, 1)
    with pytest.raises(ConfigError, match=r"^--epochs must be a number, got True$"):
        checks.check_at_least({"--epochs": True}, 1)
    checks.check_fractions({"--conf-thres": 0.0, "--iou-thres": 1.0})
    with pytest.raises(ConfigError, match=r"^--iou-thres must be in \[0, 1\], got 1.5$"):
        checks.check_fractions({"--iou-thres": 1.5})
    assert checks.check_choice("--kind", "b", ("a", "b")) == "b"
    with pytest.raises(ConfigError, match=r"^--kind 'c' is not one of a, b$"):
        checks.check_choice("--kind", "c", ("a", "b"))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "3"])
def test_a_positive_real_check_names_its_unit(bad):
    """One check for --dist-timeout, --budget-s, make_cfg's --width and the bench flags (each
    had its own copy)."""
    checks.check_real("--seconds", 0.5, positive=True, unit="seconds")
    with pytest.raises(ConfigError) as e:
        checks.check_real("--seconds", bad, positive=True, unit="seconds")
    assert str(e.value) == f"--seconds must be a positive number of seconds, got {bad!r}"
    checks.check_real("--objects", 0)  # zero is allowed unless positive
    with pytest.raises(ConfigError, match=r"^--objects must be a number >= 0, got -2$"):
        checks.check_real("--objects", -2)


def test_a_folder_check_says_missing_or_a_file(tmp_path):
    """Was: tools/coco2yolo.py --images FILE said "folder not found"."""
    checks.check_folder(tmp_path, "--images")
    file = tmp_path / "a.json"
    file.write_text("{}")
    with pytest.raises(ConfigError) as e:
        checks.check_folder(file, "--images")
    assert str(e.value) == f"{file}: --images: a file, not a folder"
    with pytest.raises(ConfigError) as e:
        checks.check_folder(tmp_path / "nope", "--images")
    assert str(e.value) == f"{tmp_path / 'nope'}: --images: folder not found"
