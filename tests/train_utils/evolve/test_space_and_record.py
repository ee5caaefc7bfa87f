"""train_utils/evolve/space.py and record.py: the search space file, YOLOv5's mutation and parent
selection, the fitness, and evolve.csv / hyp_evolve.yaml read back as written."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from build_utils.errors import ConfigError, OutputError
from train_utils.config import DEFAULT_HYP, HYP_SPECS, REPO_ROOT, load_hyp
from train_utils.evolve import record, space
from train_utils.evolve.record import Row
from train_utils.evolve.space import Gene, SearchSpace, load_space

SHIPPED = REPO_ROOT / space.DEFAULT_SPACE
BASE = load_hyp(REPO_ROOT / DEFAULT_HYP)
KINDS = {k: HYP_SPECS[k].kind for k in BASE}


def test_the_shipped_space_loads_and_every_bound_holds_cfg_hyp() -> None:
    s = load_space(SHIPPED)
    assert (s.mutation_probability, s.sigma) == (0.8, 0.2)
    # YOLOv5's gains: iou_t, fl_gamma and fliplr are never mutated, momentum at 0.3.
    assert {k for k, g in s.genes.items() if g.gain == 0} == {"iou_t", "fl_gamma", "fliplr"}
    assert s.genes["momentum"].gain == 0.3
    for key, gene in s.genes.items():
        assert gene.lower <= BASE[key] <= gene.upper, key
    assert SearchSpace.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "text, message, line",
    [
        ("keys:\n  lr0: [1, 0.0, 0.1]\n  mosaic: [1, 0, 1]\n", "'mosaic' is not a searchable", 3),
        # -1 switches it off: a mutation would turn "off" into a value.
        ("keys:\n  warmup_momentum: [1, -1, 1]\n", "'warmup_momentum' is not a searchable", 2),
        ("keys:\n  lr0: [1, 0.1, 0.01]\n", "lower <= upper", 2),
        ("keys:\n  lr0: [1, 0.0, 20.0]\n", "within the key's range [0.0, 10.0]", 2),
        ("keys:\n  lr0: [-1, 0.0, 0.1]\n", "the gain must be >= 0", 2),
        ("keys:\n  lr0: [1, 0.1]\n", "must be [gain, lower, upper]", 2),
        ("keys:\n  lr0: [0, 0.0, 0.1]\n", "every gain is 0", 1),
        ("sigma: 0\nkeys:\n  lr0: [1, 0.0, 0.1]\n", "sigma must be > 0", 1),
        ("mutation_probability: 1.5\nkeys:\n  lr0: [1, 0, 1]\n", "in (0, 1]", 1),
        ("sigmaa: 0.2\nkeys:\n  lr0: [1, 0, 1]\n", "unknown setting 'sigmaa'", 1),
        ("- 1\n", "expected 'keys:'", None),
    ],
)
def test_a_bad_space_is_one_line_naming_file_and_line(
    tmp_path: Path, text: str, message: str, line: int | None
) -> None:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_space(path)
    assert message in str(e.value)
    if line is not None:
        assert f"{path}:{line}" in str(e.value)


def yolov5_mutation(parent: dict, genes: dict, p: float, s: float, npr) -> dict:
    """YOLOv5's train.py mutation, written as it is there (one numpy stream, legacy API)."""
    g = np.array([genes[k][0] for k in genes])
    ng = len(genes)
    v = np.ones(ng)
    while all(v == 1):
        v = (g * (npr.random(ng) < p) * npr.randn(ng) * npr.random() * s + 1).clip(0.3, 3.0)
    child = dict(parent)
    for i, k in enumerate(genes):
        child[k] = parent[k] * v[i]
    for k, (_gain, lo, hi) in genes.items():
        child[k] = round(min(max(child[k], lo), hi), 5)
    return child


class _LegacyStream:
    """numpy's Generator under the legacy names YOLOv5 calls (random, randn)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def random(self, n=None):
        return self.rng.random(n)

    def randn(self, n):
        return self.rng.standard_normal(n)


def test_mutation_is_yolov5s_and_stays_in_bounds() -> None:
    s = load_space(SHIPPED)
    genes = {k: (g.gain, g.lower, g.upper) for k, g in s.genes.items()}
    for seed in range(20):
        ours = space.mutate(BASE, s, np.random.default_rng(seed))
        theirs = yolov5_mutation(
            dict(BASE), genes, 0.8, 0.2, _LegacyStream(np.random.default_rng(seed))
        )
        assert ours == theirs
        changed = [k for k in genes if ours[k] != BASE[k]]
        assert changed and set(changed) <= {k for k, g in s.genes.items() if g.gain > 0}
        for k, g in s.genes.items():
            assert g.lower <= ours[k] <= g.upper
        # Keys outside the space are the parent's; a key at 0 stays at 0 (mutation multiplies).
        assert ours["mosaic"] is BASE["mosaic"] and ours["degrees"] == 0.0


def test_parent_is_drawn_from_the_five_best_by_fitness() -> None:
    scored = [({"id": i}, f) for i, f in enumerate([0.1, 0.5, 0.2, 0.9, 0.3, 0.4, 0.05])]
    rng = np.random.default_rng(0)
    drawn = [space.select_parent(scored, rng)["id"] for _ in range(4000)]
    counts = {i: drawn.count(i) for i in set(drawn)}
    assert set(counts) <= {3, 1, 5, 4, 2}  # the five best; never 0 or 6
    # Weights fitness - worst-of-five + 1e-6: 0.7, 0.3, 0.2, 0.1, ~0 for ids 3, 1, 5, 4, 2.
    assert counts[3] / 4000 == pytest.approx(0.7 / 1.3, abs=0.03)
    assert counts[1] / 4000 == pytest.approx(0.3 / 1.3, abs=0.03)
    assert counts.get(2, 0) < 5


def test_a_candidate_depends_only_on_seed_index_and_the_rows_before_it() -> None:
    s = load_space(SHIPPED)
    scored = [(BASE, 0.2), (space.mutate(BASE, s, np.random.default_rng(9)), 0.3)]
    assert space.next_candidate(BASE, scored, s, seed=0, index=0) == BASE
    first = space.next_candidate(BASE, scored, s, seed=0, index=2)
    np.random.seed(123)
    random.seed(123)  # global streams play no part
    assert space.next_candidate(BASE, scored, s, seed=0, index=2) == first
    assert space.next_candidate(BASE, scored, s, seed=1, index=2) != first
    # Failed candidates (NaN) are never parents; with none scored the base is mutated.
    only_failed = [(BASE, math.nan)]
    child = space.next_candidate(BASE, only_failed, s, seed=0, index=1)
    assert child != BASE and set(child) == set(BASE)


def test_fitness_is_yolov5s() -> None:
    assert space.fitness({"mAP50": 0.5, "mAP50-95": 0.3}) == pytest.approx(0.1 * 0.5 + 0.9 * 0.3)


def test_evolve_csv_and_the_best_hyp_read_back_as_written(tmp_path: Path) -> None:
    s = SearchSpace({"lr0": Gene(1, 1e-5, 0.1)})
    child = space.mutate(BASE, s, np.random.default_rng(3))
    rows = [
        Row(1, record.DONE, child, 0.123456789, {"mAP50": 0.3, "mAP50-95": 0.1038}, 3, 9.5, "c1"),
        Row(0, record.DONE, dict(BASE), 0.1, {"mAP50": 0.2, "mAP50-95": 0.0889}, 3, 8.0, "c0"),
        Row(2, record.FAILED, dict(BASE), run="c2", reason="the loss became NaN"),
    ]
    csv_path = tmp_path / record.CSV_NAME
    record.write_rows(csv_path, rows, list(BASE))
    back = record.read_rows(csv_path, KINDS)
    assert [r.candidate for r in back] == [0, 1, 2]
    assert back[1] == rows[0] and back[2].reason == "the loss became NaN"
    assert math.isnan(back[2].fitness)
    best = record.best_row(back)
    assert best.candidate == 1
    hyp_path = tmp_path / record.BEST_HYP_NAME
    record.write_best_hyp(hyp_path, best, tmp_path)
    assert load_hyp(hyp_path) == child  # train.py --hyp takes it as it is, value for value


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda t: t.replace(",true\n", ",maybe\n"), "= 'maybe'"),
        (lambda t: t.replace(",0.1,", ",nan,", 1), "fitness = 'nan'"),  # a done row's fitness
        (lambda t: t.rsplit(",", 3)[0] + "\n", "not as many fields as the header"),  # torn
    ],
)
def test_an_edited_evolve_csv_is_one_line_naming_its_line(tmp_path: Path, edit, why) -> None:
    csv_path = tmp_path / record.CSV_NAME
    record.write_rows(
        csv_path,
        [Row(0, record.DONE, dict(BASE), 0.1, {"mAP50": 0.1, "mAP50-95": 0.1})],
        list(BASE),
    )
    csv_path.write_text(edit(csv_path.read_text()))
    with pytest.raises(ConfigError, match=r"evolve.csv:2: a row this search cannot read back") as e:
        record.read_rows(csv_path, KINDS)
    assert why in str(e.value)


def test_a_full_disk_keeps_the_rows_already_written(tmp_path: Path, monkeypatch) -> None:
    csv_path = tmp_path / record.CSV_NAME
    first = [Row(0, record.DONE, dict(BASE), 0.1, {"mAP50": 0.1, "mAP50-95": 0.1})]
    record.write_rows(csv_path, first, list(BASE))
    before = csv_path.read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(record.csv, "DictWriter", full)
    with pytest.raises(OutputError, match="No space left"):
        record.write_rows(csv_path, [*first, Row(1, record.FAILED, dict(BASE))], list(BASE))
    assert csv_path.read_bytes() == before
