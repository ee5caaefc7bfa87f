"""Shared fixtures: tiny generated datasets, the repository root, the optional ../shared folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from data.make_shapes import make_dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture(autouse=True, scope="session")
def _few_threads() -> None:
    # Tests are small; more threads than cores only adds scheduling noise on CI's 2 cores.
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True, scope="session")
def _memory_format_cache(tmp_path_factory: pytest.TempPathFactory):
    """Training's memory-format decisions go to a cache of the session (also for the training
    processes tests start), never to the user's ~/.cache."""
    from train_utils.memory_format import CACHE_ENV

    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("yolo_cache")))
    yield
    mp.undo()


@pytest.fixture
def single_thread():
    """One intra-op thread for the test: small forwards gain little from a second one, and on a
    busy 2-core machine a thread waiting for a core makes them 10-30x slower (measured: a
    yolov4.cfg forward at 128 px took 0.36 s on one thread, 9.8 s on two under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout (present for the developers and in CI, not for users)."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"{SHARED_DIR} is absent (it only exists beside the development checkout)")
    return SHARED_DIR


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny shapes dataset (24 train, 10 val images, 160-256 px), shared by the session.

    Tests must not modify it; use ``make_shapes_data`` for a private copy.
    """
    root = tmp_path_factory.mktemp("shapes")
    return make_dataset(
        root,
        n_train=24,
        n_val=10,
        img_size_range=(160, 256),
        seed=0,
        obj_size_range=(16.0, 0.5),
        workers=1,
    )


@pytest.fixture
def make_shapes_data(tmp_path: Path):
    """Factory for a private shapes dataset: ``make_shapes_data(n_train=8, n_val=4, **kw)``."""

    def _make(n_train: int = 8, n_val: int = 4, **kwargs) -> Path:
        kwargs.setdefault("img_size_range", (160, 256))
        kwargs.setdefault("workers", 1)
        return make_dataset(tmp_path / "shapes", n_train, n_val, **kwargs)

    return _make


@pytest.fixture
def console(capsys):
    """The scripts' console handler bound to this test's captured stderr, removed after."""

    def drop() -> None:
        root = logging.getLogger()
        for h in [h for h in root.handlers if getattr(h, "_yolo_console", False)]:
            root.removeHandler(h)

    drop()
    yield capsys
    drop()
