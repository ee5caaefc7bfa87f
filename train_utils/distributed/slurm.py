"""SLURM's compressed host and task lists, expanded without ``scontrol`` (which compute nodes do
not always have). Pure functions of the variable's text, so they are tested without SLURM.

    expand_nodelist("gpu[01-04,07],login1")  -> ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07",
                                                 "login1"]
    expand_tasks_per_node("2(x3),1")         -> [2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import re

from build_utils.errors import ConfigError

_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(body: str) -> list[str]:
    """``01-04,07`` -> ``['01', '02', '03', '04', '07']``; zero padding follows the lower bound."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``r[1-2]n[1-2]``)."""
    pieces: list[list[str]] = []
    rest = pattern
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, closed, rest = tail.partition("]")
        if not closed:
            raise ValueError("unbalanced '['")
        pieces.append([head])
        pieces.append(_expand_range(body))
    if "]" in rest:
        raise ValueError("unbalanced ']'")
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Hosts of a SLURM node list (``SLURM_JOB_NODELIST``), in SLURM's order.

    Raises:
        ConfigError: the text is not a node list.
    """
    try:
        hosts = [h for part in _split_top_level(nodelist) for h in _expand_host(part)]
    except ValueError as e:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM node list: {e}") from e
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def expand_tasks_per_node(tasks: str) -> list[int]:
    """Tasks on each node of the job (``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> [2, 2, 2, 1]).

    Raises:
        ConfigError: the text is not a task list.
    """
    counts: list[int] = []
    for part in tasks.split(","):
        match = _REPEAT.match(part.strip())
        if match is None:
            raise ConfigError(
                f"SLURM_TASKS_PER_NODE={tasks!r} is not a SLURM task list (e.g. '2(x3),1')"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def tasks_on_this_node(env: dict[str, str] | None) -> int | None:
    """Processes SLURM starts on this node, from ``SLURM_NTASKS_PER_NODE`` or, for uneven jobs,
    ``SLURM_TASKS_PER_NODE`` indexed by ``SLURM_NODEID``; None when SLURM says neither."""
    env = env or {}
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    if "SLURM_TASKS_PER_NODE" in env:
        counts = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        node = env.get("SLURM_NODEID", "0")
        index = int(node) if node.isdigit() else 0
        return counts[index] if index < len(counts) else counts[-1]
    return None
