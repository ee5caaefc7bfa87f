"""What every script's ``main()`` shares: console logging, and user errors as one line.

A :class:`YoloError` (bad cfg, .data, hyp, flag, weights or dataset) becomes ``error: <message>``
on stderr with exit status 2; Ctrl-C exits with 130 after the trainer saved what it could.
Anything else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from build_utils.errors import YoloError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def setup_console_logging(level: int = logging.INFO) -> None:
    """INFO lines on stderr with the time; tqdm bars share the same stream."""
    root = logging.getLogger()
    if not any(getattr(h, "_yolo_console", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handler._yolo_console = True
        root.addHandler(handler)
    root.setLevel(level)


def run_main(body: Callable[[], int | None]) -> int:
    """Run a script body, mapping user errors to exit status 2 and Ctrl-C to 130."""
    try:
        return body() or 0
    except YoloError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
