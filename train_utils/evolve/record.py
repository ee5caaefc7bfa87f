"""A search's files: ``evolve.csv`` (one row per candidate), ``hyp_evolve.yaml`` (the best
candidate's hyp, a file ``train.py --hyp`` takes as it is) and ``evolve.png``.

Every write is atomic: a search killed, or stopped by a full disk, keeps every row it wrote.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from build_utils.atomic import atomic_write, reported_write, write_text
from build_utils.errors import ConfigError
from build_utils.safe_yaml import dump_yaml
from train_utils.evolve.space import FITNESS_WEIGHTS, SearchSpace
from train_utils.run_folder import RUN_FOLDER_FLAGS, SEARCH_WRITES

# Named where every run's file names are (a folder holding them is a search's, not free).
CSV_NAME, BEST_HYP_NAME, PLOT_NAME, LOG_NAME = SEARCH_WRITES
DONE, FAILED, STOPPED_EARLY = "done", "failed", "stopped early"
METRICS = tuple(FITNESS_WEIGHTS)
HEAD = ("candidate", "status", "fitness", *METRICS, "epochs", "seconds", "run", "reason")


@dataclass
class Row:
    """One candidate's result: ``fitness`` NaN when it failed."""

    candidate: int
    status: str
    hyp: dict[str, Any]
    fitness: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)
    epochs: int = 0
    seconds: float = 0.0
    run: str = ""
    reason: str = ""

    def to_csv(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "candidate": self.candidate,
            "status": self.status,
            "fitness": "" if math.isnan(self.fitness) else repr(self.fitness),
            **{k: repr(self.metrics[k]) if k in self.metrics else "" for k in METRICS},
            "epochs": self.epochs,
            "seconds": round(self.seconds, 1),
            "run": self.run,
            "reason": self.reason,
        }
        for k, v in self.hyp.items():
            out[k] = ("true" if v else "false") if isinstance(v, bool) else repr(v)
        return out


def write_rows(path: Path, rows: Sequence[Row], hyp_keys: Sequence[str]) -> None:
    """Replace ``evolve.csv`` with ``rows`` (by candidate number).

    Raises:
        OutputError: it cannot be written; the previous file stays as it was.
    """
    with reported_write(path, RUN_FOLDER_FLAGS), atomic_write(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*HEAD, *hyp_keys])
        w.writeheader()
        w.writerows(r.to_csv() for r in sorted(rows, key=lambda r: r.candidate))


def read_rows(path: Path, hyp_kinds: Mapping[str, type]) -> list[Row]:
    """The rows of a search's ``evolve.csv`` (none when it does not exist yet).

    Raises:
        ConfigError: a row that is not this project's (edited by hand, torn), naming its line.
    """
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in (*HEAD, *hyp_kinds) if k not in (reader.fieldnames or ())]
        if missing:
            raise ConfigError(f"not a search's evolve.csv: no column {missing[0]!r}", path, 1)
        rows = []
        for n, raw in enumerate(reader, start=2):
            try:
                rows.append(_row(raw, hyp_kinds))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"a row this search cannot read back ({e})", path, n) from None
    return rows


def _finite(raw: Mapping[str, str], key: str) -> float:
    value = float(raw[key])
    if not math.isfinite(value):
        raise ValueError(f"{key} = {raw[key]!r}")
    return value


def _row(raw: Mapping[str, str], hyp_kinds: Mapping[str, type]) -> Row:
    if None in raw or None in raw.values():  # DictReader's filler for a torn or extended row
        raise ValueError("not as many fields as the header")
    hyp: dict[str, Any] = {}
    for key, kind in hyp_kinds.items():
        text = raw[key]
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(f"{key} = {text!r}")
            hyp[key] = text == "true"
        else:
            hyp[key] = _finite(raw, key)
    return Row(
        candidate=int(raw["candidate"]),
        status=raw["status"],
        hyp=hyp,
        fitness=_finite(raw, "fitness") if raw["fitness"] else math.nan,
        metrics={k: _finite(raw, k) for k in METRICS if raw[k]},
        epochs=int(raw["epochs"]),
        seconds=_finite(raw, "seconds"),
        run=raw["run"],
        reason=raw["reason"],
    )


def best_row(rows: Sequence[Row]) -> Row | None:
    """The candidate of the highest fitness (the earliest among equals) among those trained to
    their end (one ASHA stopped early was scored on fewer epochs); None before any."""
    scored = [r for r in rows if r.status == DONE and not math.isnan(r.fitness)]
    return max(scored, key=lambda r: (r.fitness, -r.candidate)) if scored else None


def write_best_hyp(path: Path, best: Row, search: Path) -> None:
    """``hyp_evolve.yaml``: the best candidate's hyp, every key, values as trained."""
    header = (
        f"# The best of the candidates of {search} so far: candidate {best.candidate} "
        f"({best.run}), fitness {best.fitness:.5f} = 0.1 mAP@0.5 + 0.9 mAP@0.5:0.95 "
        f"({best.metrics.get('mAP50', math.nan):.5f}, "
        f"{best.metrics.get('mAP50-95', math.nan):.5f}).\n"
        f"# Train with it: python train.py --hyp {path} (same flags and --seed: same fitness)\n"
    )
    write_text(path, header + dump_yaml(dict(best.hyp)), RUN_FOLDER_FLAGS)


def plot_search(path: Path, rows: Sequence[Row], space: SearchSpace) -> None:
    """``evolve.png``: fitness against each mutated key's value (the best marked), and fitness
    over the candidates."""
    from train_utils.evaluation.plots import _pyplot, save_figure

    scored = [r for r in rows if not math.isnan(r.fitness)]
    if not scored:
        return
    plt = _pyplot()
    keys = [k for k, g in space.genes.items() if g.gain > 0]
    cols = 5
    n = len(keys) + 1
    grid_rows = -(-n // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(3 * cols, 2.6 * grid_rows), squeeze=False)
    best = best_row(scored)
    fit = [r.fitness for r in scored]
    for ax, key in zip(axes.flat, keys, strict=False):
        ax.scatter([r.hyp[key] for r in scored], fit, c=fit, cmap="viridis", s=12)
        if best is not None:
            ax.plot(best.hyp[key], best.fitness, "k+", markersize=14)
        ax.set_title(key if best is None else f"{key} = {best.hyp[key]:.4g}", fontsize=9)
        ax.locator_params(axis="x", nbins=4)  # small values' tick labels would overlap
    last = axes.flat[len(keys)]
    last.plot([r.candidate for r in scored], fit, ".-")
    last.set(xlabel="candidate", ylabel="fitness")
    last.set_title("fitness over candidates", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    save_figure(fig, path)
