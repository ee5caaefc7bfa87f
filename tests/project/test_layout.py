"""Package boundaries point one way: build_utils <- models <- train_utils <- scripts and tools."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("build_utils", "models", "train_utils")
# Which project packages each package may import.
ALLOWED = {
    "build_utils": set(),
    "models": {"build_utils"},
    "train_utils": {"build_utils", "models"},
}
SCRIPTS = {"train", "train_multi_GPU", "validation", "predict", "tools", "bench", "data"}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_dependency_direction(package):
    for path in sorted((REPO / package).rglob("*.py")):
        imported = _imported_top_levels(path)
        project = imported & (set(PACKAGES) | SCRIPTS)
        forbidden = project - ALLOWED[package] - {package}
        assert not forbidden, f"{path.relative_to(REPO)} imports {sorted(forbidden)}"


# Rooms inside train_utils: what each sub-package or module must never import. Evaluation measures
# any model (validation.py, speed, the report) and so knows nothing of training; the engine runs
# epochs and knows nothing of the run around it (files, checkpoints, reporting).
FORBIDDEN_INSIDE = {
    "train_utils/evaluation": {
        "train_utils.engine",
        "train_utils.trainer",
        "train_utils.reporting",
        "train_utils.checkpoint",
        "train_utils.data_loaders",
        "train_utils.config",
        "train_utils.optim",
        "train_utils.plan",
    },
    "train_utils/engine.py": {
        "train_utils.trainer",
        "train_utils.reporting",
        "train_utils.checkpoint",
        "train_utils.data_loaders",
    },
    "train_utils/distributed/comm.py": {"train_utils.engine", "train_utils.trainer"},
    "train_utils/precision.py": {"train_utils.engine", "train_utils.trainer"},
    "train_utils/distributed/devices.py": {"train_utils.engine", "train_utils.trainer"},
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("room", sorted(FORBIDDEN_INSIDE))
def test_rooms_inside_train_utils(room):
    target = REPO / room
    paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert paths, room
    for path in paths:
        imported = _imported_modules(path)
        bad = {
            m for m in imported for f in FORBIDDEN_INSIDE[room] if m == f or m.startswith(f + ".")
        }
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_no_star_imports_and_no_pickle():
    for path in sorted(REPO.glob("**/*.py")):
        # .venv and .venv-cv4 (the OpenCV 4 reference environment) hold third-party code.
        if any(part.startswith(".venv") for part in path.parts) or "tests" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert all(a.name != "*" for a in node.names), f"star import in {path}"
                assert node.module != "pickle", f"pickle in {path}"
            if isinstance(node, ast.Import):
                assert all(a.name != "pickle" for a in node.names), f"pickle in {path}"


def test_tests_mirror_the_packages():
    """Each package folder has its tests in the same place under tests/, and every module of a
    package is imported by a test there (a module nobody tests is a finding, not a layout)."""
    for package in PACKAGES:
        for folder in sorted(p for p in (REPO / package).rglob("*") if p.is_dir()):
            if folder.name == "__pycache__" or not list(folder.glob("*.py")):
                continue
            rel = folder.relative_to(REPO)
            if rel.parts[-1] == "trackers":  # tested as one concern, tests/train_utils/
                continue
            assert (REPO / "tests" / rel).is_dir(), f"tests/{rel}/ is missing"
    test_text = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    untested = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
            parent, _, name = dotted.rpartition(".")
            rel = path.relative_to(REPO).as_posix()
            named = (dotted, f"from {parent} import {name}", rel, path.name)
            if not any(n in test_text for n in named):
                untested.append(dotted)
    assert not untested, f"no test imports {untested}"
