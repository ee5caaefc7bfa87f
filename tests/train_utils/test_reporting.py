"""train_utils/reporting.py: train.log."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from train_utils.reporting import run_log_handler


def test_train_log_names_a_file_whose_name_is_not_utf8(tmp_path: Path):
    """Was: a line naming b"bad\\xe9name.txt" (bad\\udce9name to Python) failed to encode, and
    the first such failure turned train.log off for the rest of the run. Now it is written as
    the console shows it (backslashreplace) and the log goes on."""
    handler = run_log_handler(tmp_path / "train.log")
    handler.setFormatter(logging.Formatter("%(message)s"))
    name = os.fsdecode(b"labels/bad\xe9name.txt")
    for msg in (f"{name}: no objects", "next line"):
        handler.emit(logging.makeLogRecord({"msg": msg, "levelno": logging.WARNING}))
    handler.close()
    assert not handler.failed
    text = (tmp_path / "train.log").read_text(encoding="utf-8")
    assert text == "labels/bad\\udce9name.txt: no objects\nnext line\n"
