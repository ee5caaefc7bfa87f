"""Small checks of the values a user hands over: command-line flags, hyp files, data files and
checkpoint records all go through these, so that each kind of value is judged, and an error
worded, one way (``<what> must be ..., got <value>``).

A value may come from argparse, YAML, JSON or a checkpoint, so ``True`` is never a number here
(Python counts it as 1), an integer of 400 digits is shown cut short, and a tensor by its dtype
and shape.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from build_utils.errors import ConfigError

SHOWN_CHARS = 40  # a value in an error line is cut to this many characters
SHOWN_DIGITS = 12  # a long integer in an error line is cut to this many digits
BIG_INT_BITS = 14_000  # about 4200 digits: str() refuses ints past 4300 (sys.int_info)
LOG10_2 = 0.30103  # decimal digits per bit


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool`` (an int too large for a float is
    not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def finite_float(value: Any) -> float | None:
    """``value`` as a finite float when it is a real number (JSON, YAML, a record), else None."""
    return float(value) if is_real(value) else None


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``value`` as an error line shows it: one short line; a tensor (or array) by its dtype and
    shape, a long integer by its first digits."""
    if hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, (int, float)):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"(a {dtype} tensor of shape {tuple(value.shape)})"
    if is_int(value):
        if value.bit_length() > BIG_INT_BITS:  # str() refuses it (sys.int_info's digit limit)
            return f"(an integer of about {int(value.bit_length() * LOG10_2)} digits)"
        text = str(value)
        return (
            text if len(text) <= SHOWN_DIGITS else f"{text[:SHOWN_DIGITS]}... ({len(text)} digits)"
        )
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit] + "..."


def check_number(what: str, value: Any, kind: type = float) -> None:
    """``value`` is a number (an integer when ``kind`` is ``int``): ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, kind)):
        raise ConfigError(f"{what} must be a number, got {value!r}")


def check_at_least(values: Mapping[str, int | None], lo: int, hi: int | None = None) -> None:
    """Each ``what: value`` (None: not set) is an integer of at least ``lo`` (and at most
    ``hi`` when given)."""
    for what, value in values.items():
        if value is None:
            continue
        check_number(what, value, int)
        if value < lo:
            raise ConfigError(f"{what} must be >= {lo}, got {shown(value)}")
        if hi is not None and value > hi:
            raise ConfigError(f"{what} must be in [{lo}, {hi}], got {shown(value)}")


def check_real(what: str, value: Any, *, positive: bool = False, unit: str = "") -> None:
    """``value`` is a finite number >= 0 (> 0 with ``positive``), of ``unit`` (e.g. "seconds",
    named in the error line): ConfigError otherwise."""
    if not is_real(value) or value < 0 or (positive and value == 0):
        wanted = "a positive number" if positive else "a number >= 0"
        of = f" of {unit}" if unit else ""
        raise ConfigError(f"{what} must be {wanted}{of}, got {shown(value)}")


def check_fractions(values: Mapping[str, float | None]) -> None:
    """Each ``what: value`` (None: not set) is a number in [0, 1]."""
    for what, value in values.items():
        if value is None:
            continue
        check_number(what, value, float)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{what} must be in [0, 1], got {value}")


def check_choice(what: str, value: Any, choices: Collection[Any]) -> Any:
    """``value`` when it is one of ``choices``: ConfigError naming them otherwise."""
    if value not in choices:
        raise ConfigError(f"{what} {value!r} is not one of {', '.join(map(str, choices))}")
    return value


def check_folder(path: str | os.PathLike[str], what: str) -> None:
    """``path`` is an existing folder (``what`` names it, e.g. the flag): ConfigError saying
    it is missing or a file otherwise. A file is the counterpart of
    :func:`build_utils.limits.check_config_file`'s "a folder, not a file"."""
    path = Path(path)
    if not path.is_dir():
        why = "a file, not a folder" if path.exists() else "folder not found"
        raise ConfigError(f"{what}: {why}", path)
