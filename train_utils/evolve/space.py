"""What ``--evolve`` searches and how a candidate is made: YOLOv5's genetic search.

The space (``cfg/evolve.yaml``, ``--evolve-space``) gives each searched hyp key a mutation gain
and bounds; :func:`next_candidate` makes candidate ``index`` from the candidates scored before
it, with a random stream of its own (``seed``, ``index``), so that a search continued after an
interruption makes the same candidates as one that never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from build_utils.checks import is_real
from build_utils.errors import ConfigError
from build_utils.safe_yaml import compose_yaml, short_repr

# YOLOv5's fitness: 0.1 mAP@0.5 + 0.9 mAP@0.5:0.95 (its P and R weights are 0).
FITNESS_WEIGHTS = {"mAP50": 0.1, "mAP50-95": 0.9}
PARENTS = 5  # the parent is drawn among this many best candidates so far
FACTOR_RANGE = (0.3, 3.0)  # a key's factor is clipped to this (YOLOv5)
DECIMALS = 5  # mutated values are rounded to this many decimals (YOLOv5)
DEFAULT_SPACE = "cfg/evolve.yaml"


@dataclass(frozen=True)
class Gene:
    """One searched key: its mutation gain (0: never mutated) and bounds."""

    gain: float
    lower: float
    upper: float


@dataclass(frozen=True)
class SearchSpace:
    genes: dict[str, Gene]
    mutation_probability: float = 0.8
    sigma: float = 0.2

    def to_dict(self) -> dict[str, Any]:
        return {
            "mutation_probability": self.mutation_probability,
            "sigma": self.sigma,
            "keys": {k: [g.gain, g.lower, g.upper] for k, g in self.genes.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SearchSpace:
        """The space :meth:`to_dict` wrote (a search's record): checked as a file is."""
        return _space_of(d, "the search's record", lambda _key: None)


def fitness(metrics: Mapping[str, float]) -> float:
    """YOLOv5's fitness of a candidate's metrics (``mAP50``, ``mAP50-95``)."""
    return sum(w * float(metrics[k]) for k, w in FITNESS_WEIGHTS.items())


def load_space(path: str | Path) -> SearchSpace:
    """Read and check a search-space file (``cfg/evolve.yaml``'s layout). Every problem is one
    :class:`ConfigError` naming the file and line, before any candidate trains."""
    doc = compose_yaml(path, "search space")
    root = doc.root
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError("expected 'keys:' (key: [gain, lower, upper]) and the settings", path)
    lines = {k.value: k.start_mark.line + 1 for k, _ in root.value}
    keys_node = next((v for k, v in root.value if k.value == "keys"), None)
    if isinstance(keys_node, yaml.MappingNode):
        lines.update({f"keys.{k.value}": k.start_mark.line + 1 for k, _ in keys_node.value})
    return _space_of(doc.value(), path, lines.get)


def _space_of(d: Any, source: Any, line: Any) -> SearchSpace:
    # Imported here: train_utils.config imports this module (DEFAULT_SPACE).
    from train_utils.config import HYP_SPECS

    if not isinstance(d, Mapping):
        raise ConfigError("expected 'keys:' (key: [gain, lower, upper]) and the settings", source)
    unknown = [k for k in d if k not in ("keys", "mutation_probability", "sigma")]
    if unknown:
        raise ConfigError(
            f"unknown setting {short_repr(unknown[0])}; the settings are keys, "
            "mutation_probability, sigma",
            source,
            line(str(unknown[0])),
        )
    p = d.get("mutation_probability", 0.8)
    if not is_real(p) or not 0 < p <= 1:
        raise ConfigError(
            f"mutation_probability must be in (0, 1], got {short_repr(p)}",
            source,
            line("mutation_probability"),
        )
    sigma = d.get("sigma", 0.2)
    if not is_real(sigma) or sigma <= 0:
        raise ConfigError(f"sigma must be > 0, got {short_repr(sigma)}", source, line("sigma"))
    keys = d.get("keys")
    if not isinstance(keys, Mapping) or not keys:
        raise ConfigError("'keys:' must map hyp keys to [gain, lower, upper]", source, line("keys"))
    genes = {str(k): _gene(k, v, HYP_SPECS, source, line(f"keys.{k}")) for k, v in keys.items()}
    if not any(g.gain > 0 for g in genes.values()):
        raise ConfigError("every gain is 0: nothing would be searched", source, line("keys"))
    return SearchSpace(genes, float(p), float(sigma))


# A number that is also a switch (-1: off): a mutation would turn "off" into some value.
NOT_SEARCHED = frozenset({"warmup_momentum"})


def _gene(key: Any, value: Any, hyp_specs: Mapping[str, Any], source: Any, line: Any) -> Gene:
    spec = hyp_specs.get(key)
    if spec is None or spec.kind is bool or key in NOT_SEARCHED:
        searchable = ", ".join(
            k for k, s in hyp_specs.items() if s.kind is not bool and k not in NOT_SEARCHED
        )
        raise ConfigError(
            f"{short_repr(key)} is not a searchable hyp key; the keys are {searchable}",
            source,
            line,
        )
    if not (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 3
        and all(is_real(x) for x in value)
    ):
        raise ConfigError(
            f"'{key}' must be [gain, lower, upper] (three numbers), got {short_repr(value)}",
            source,
            line,
        )
    gain, lower, upper = (float(x) for x in value)
    if gain < 0:
        raise ConfigError(f"'{key}': the gain must be >= 0, got {gain}", source, line)
    if not spec.lo <= lower <= upper <= spec.hi:
        raise ConfigError(
            f"'{key}': the bounds [{lower}, {upper}] must satisfy lower <= upper within the "
            f"key's range [{spec.lo}, {spec.hi}]",
            source,
            line,
        )
    return Gene(gain, lower, upper)


def candidate_rng(seed: int, index: int) -> np.random.Generator:
    """Candidate ``index``'s own random stream: the same whatever ran before it in this
    process (a resumed search draws what an uninterrupted one drew)."""
    return np.random.default_rng([seed % 2**32, index])


def select_parent(
    scored: Sequence[tuple[Mapping[str, Any], float]], rng: np.random.Generator
) -> Mapping[str, Any]:
    """YOLOv5's 'single' parent: one of the :data:`PARENTS` best ``(hyp, fitness)`` (earliest
    first among equals), drawn with weight ``fitness - worst + 1e-6``."""
    order = sorted(range(len(scored)), key=lambda i: -scored[i][1])[:PARENTS]
    f = np.array([scored[i][1] for i in order])
    w = f - f.min() + 1e-6
    return scored[order[int(rng.choice(len(order), p=w / w.sum()))]][0]


def mutate(
    parent: Mapping[str, Any], space: SearchSpace, rng: np.random.Generator
) -> dict[str, Any]:
    """YOLOv5's mutation of ``parent``'s searched keys (the others are kept): at least one key
    changes whenever a gain is non-zero."""
    keys = list(space.genes)
    gains = np.array([space.genes[k].gain for k in keys])
    factors = np.ones(len(keys))
    while np.all(factors == 1):  # until something changes (YOLOv5: no duplicate candidates)
        drawn = rng.random(len(keys)) < space.mutation_probability
        spread = rng.standard_normal(len(keys)) * rng.random() * space.sigma
        factors = (gains * drawn * spread + 1).clip(*FACTOR_RANGE)
    child = dict(parent)
    for key, factor in zip(keys, factors, strict=True):
        gene = space.genes[key]
        value = min(max(float(parent[key]) * float(factor), gene.lower), gene.upper)
        child[key] = round(value, DECIMALS)
    return child


def next_candidate(
    base: Mapping[str, Any],
    scored: Sequence[tuple[Mapping[str, Any], float]],
    space: SearchSpace,
    seed: int,
    index: int,
) -> dict[str, Any]:
    """Candidate ``index``'s hyp: ``base`` itself for the first, else a mutation of a parent
    drawn from ``scored`` (the earlier candidates' hyp and fitness, in order; failed ones have
    none), or of ``base`` while nothing is scored."""
    if index == 0:
        return dict(base)
    scored = [(h, f) for h, f in scored if math.isfinite(f)]
    rng = candidate_rng(seed, index)
    parent = select_parent(scored, rng) if scored else base
    return mutate({**base, **parent}, space, rng)
