"""The ``cuda`` marker (registered in pyproject.toml): a test that needs a CUDA device.

Without one the test is skipped, as the CPU suite (CI) runs; with ``YOLO_REQUIRE_CUDA=1`` it fails
instead, so that ``make gpu-check`` (``bench/gpu_check.py``, which runs ``pytest -m cuda`` with it)
cannot pass on a machine whose CUDA is broken or hidden. The same rule as ``YOLO_REQUIRE_OPENCV4``
for the Darknet fidelity test. tests/conftest.py loads this hook; a pytest run outside the
suite loads it with ``-p cuda_marker`` (tests/ on the path).
"""

from __future__ import annotations

import os

import pytest

MARKER = "cuda"
REQUIRE_ENV = "YOLO_REQUIRE_CUDA"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(MARKER) is None:
        return
    import torch  # here, not at import: a pytest run without CUDA tests need not load it

    if torch.cuda.is_available():
        return
    reason = "needs a CUDA device (torch.cuda.is_available() is False)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)
