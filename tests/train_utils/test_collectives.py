"""Collectives stay where a reader sees them (parsed with ast, nothing imported or run).

A collective must be entered by every rank; one hidden inside a helper whose name reads as a
pure function hangs every rank as soon as someone wraps that helper in ``if dist.is_main:``.
So: the collectives of ``train_utils/distributed/comm.py`` say "Collective." first, only the
modules that run per-rank work call them, and in the trainer each call carries a
``# Collective:`` comment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMM = REPO / "train_utils" / "distributed" / "comm.py"
COMM_MODULE = "train_utils.distributed.comm"
MARK = "Collective."

# torch.distributed functions that every rank of the group must enter.
TORCH_COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
}

# The modules that run work on every rank and so may enter a collective; everything else
# (plan, reporting, checkpoint, evaluation, ...) decides or records and must not.
ALLOWED_CALLERS = {
    "train_utils/trainer.py",
    "train_utils/rounds.py",
    "train_utils/load_model.py",
    "train_utils/stop_signals.py",
    "train_utils/resume.py",
    "train_utils/engine.py",
    "train_utils/data_loaders.py",
    "train_utils/autoanchor.py",
    "train_utils/evolve/search.py",  # --evolve under DDP: rank 0 decides each candidate
}
ALLOWED_FOLDER = "train_utils/distributed/"
MUST_NOT_IMPORT = ("train_utils/plan.py", "train_utils/reporting.py", "train_utils/checkpoint.py")
# Each collective call has "# Collective:" just above: the trainer's (the Darknet loop's too) and
# the modules it runs (a round's end, the model it builds, its stop points), and resume's (every
# rank reads the checkpoint).
COMMENTED = (
    "train_utils/trainer.py",
    "train_utils/rounds.py",
    "train_utils/load_model.py",
    "train_utils/stop_signals.py",
    "train_utils/resume.py",
    "train_utils/evolve/search.py",
)


def _functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _comm_collectives() -> set[str]:
    tree = ast.parse(COMM.read_text(encoding="utf-8"))
    return {f.name for f in _functions(tree) if (ast.get_docstring(f) or "").startswith(MARK)}


def _called_names(node: ast.AST) -> set[str]:
    """Names called directly (``f()``) or through a module (``dist.f()``, ``comm.f()``)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            names.add(n.func.id)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            names.add(n.func.attr)
    return names


def test_every_collective_in_comm_says_so_first() -> None:
    collectives = _comm_collectives()
    assert {"barrier", "broadcast_object", "all_reduce_flag", "all_reduce_mean"} <= collectives
    tree = ast.parse(COMM.read_text(encoding="utf-8"))
    for f in _functions(tree):
        if f.name.startswith("_"):
            continue
        # A function that enters a torch collective or one of ours is one itself; the rank and
        # world-size queries are not.
        enters = _called_names(f) & (TORCH_COLLECTIVES | (collectives - {f.name}))
        if enters:
            assert f.name in collectives, f"comm.{f.name} enters {sorted(enters)}: say {MARK!r}"
        else:
            assert f.name not in collectives, f"comm.{f.name} says {MARK!r} but enters none"


def _collective_calls(path: Path, collectives: set[str]) -> list[tuple[str, int, str]]:
    """(function, line, collective) for each call of a comm collective imported by ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == COMM_MODULE
        for a in n.names
        if a.name in collectives
    }
    sites = []
    for f in _functions(tree):
        for n in ast.walk(f):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in imported:
                sites.append((f.name, n.lineno, n.func.id))
    return sites


def _train_utils_files() -> list[Path]:
    return sorted((REPO / "train_utils").rglob("*.py"))


def test_collectives_are_called_only_where_every_rank_works() -> None:
    collectives = _comm_collectives()
    for path in _train_utils_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED_CALLERS or rel.startswith(ALLOWED_FOLDER):
            continue
        sites = _collective_calls(path, collectives)
        assert not sites, f"{rel} calls collectives {sites}; call them in the trainer"


def test_deciding_and_recording_modules_import_no_collective() -> None:
    for rel in MUST_NOT_IMPORT:
        tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                assert n.module != COMM_MODULE, f"{rel} imports {COMM_MODULE}"
                assert n.module != "torch.distributed", f"{rel} imports torch.distributed"
            elif isinstance(n, ast.Import):
                assert all(a.name != "torch.distributed" for a in n.names), rel


def _torch_collective_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each torch.distributed collective called (``dist.all_reduce(...)``,
    ``torch.distributed.barrier()``) or imported by name."""
    aliases = {"torch.distributed"}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            aliases.update(a.asname for a in n.names if a.name == "torch.distributed" and a.asname)
        elif isinstance(n, ast.ImportFrom) and n.module == "torch":
            aliases.update(a.asname or a.name for a in n.names if a.name == "distributed")
        elif isinstance(n, ast.ImportFrom) and n.module == "torch.distributed":
            found += [(n.lineno, a.name) for a in n.names if a.name in TORCH_COLLECTIVES]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return found + [
        (n.lineno, n.func.attr)
        for n in calls
        if isinstance(n.func, ast.Attribute)
        and n.func.attr in TORCH_COLLECTIVES
        and ast.unparse(n.func.value) in aliases
    ]


def test_only_distributed_enters_torch_collectives() -> None:
    # Rank and world-size queries (the samplers') are fine anywhere; collectives are not.
    for package in ("build_utils", "models", "train_utils"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(ALLOWED_FOLDER):
                continue
            calls = _torch_collective_calls(ast.parse(path.read_text(encoding="utf-8")))
            assert not calls, f"{rel} enters torch.distributed collectives {calls}"


@pytest.mark.parametrize("rel", COMMENTED)
def test_the_trainers_collectives_are_commented_at_the_call(rel: str) -> None:
    path = REPO / rel
    lines = path.read_text(encoding="utf-8").splitlines()
    sites = _collective_calls(path, _comm_collectives())
    assert sites, f"{rel} calls collectives"
    for function, line, name in sites:
        above = lines[max(0, line - 4) : line - 1]
        assert any("# Collective:" in s for s in above), (
            f"{rel}:{line} ({function}) calls {name} without a '# Collective:' comment"
        )
