"""build_utils.safe_yaml: the one YAML reader. Each refusal is one short ConfigError naming the
file and line; accepted documents read as yaml.safe_load reads them (plus YAML 1.2 floats)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from build_utils.errors import ConfigError
from build_utils.safe_yaml import (
    MAX_DEPTH,
    MAX_VALUE_CHARS,
    dump_yaml,
    load_yaml,
    parse_yaml,
    short_repr,
)

REPO = Path(__file__).resolve().parents[2]


def _load(text: str):
    return parse_yaml(text, "x.yaml").value()


def _refused(text: str, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _load(text)
    line = str(info.value)
    assert "\n" not in line and len(line) < 300, line
    return line


def billion_laughs(levels: int, fan: int = 10) -> str:
    """The classic: ``levels`` anchors, each a list of ``fan`` aliases of the one before, so the
    last expands to ``fan ** levels`` strings. 10 levels of 10 is about 1 KB of text."""
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * fan) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_12_floats_are_floats_and_other_scalars_unchanged():
    doc = _load(
        "a: 1e6\nb: 1E-3\nc: -2.5e+3\nd: .5\ne: 1.0e6\nf: 0.001\ng: 10\nh: 1_000\n"
        "i: 1e\nj: e5\nk: 1.2.3\nl: =\nm: .inf\nn: true\no: ~\n"
    )
    assert doc == {
        "a": 1e6,
        "b": 1e-3,
        "c": -2500.0,
        "d": 0.5,
        "e": 1e6,
        "f": 0.001,
        "g": 10,
        "h": 1000,
        "i": "1e",
        "j": "e5",
        "k": "1.2.3",
        "l": "=",
        "m": float("inf"),
        "n": True,
        "o": None,
    }
    assert all(type(doc[k]) is float for k in "abcdef") and type(doc["g"]) is int


def test_repository_yaml_files_load_as_safe_load_reads_them():
    files = sorted((REPO / "cfg").glob("*.yaml"))
    assert len(files) >= 2
    for path in files:
        assert load_yaml(path, "hyperparameter file") == yaml.safe_load(path.read_text()), path


def test_billion_laughs_is_refused_in_well_under_a_second():
    text = billion_laughs(10)  # 10^10 strings expanded
    assert len(text) < 1500
    start = time.perf_counter()
    line = _refused(text, r"YOLO_MAX_YAML_NODES")
    assert time.perf_counter() - start < 0.5
    # Refused at the alias that crosses the limit: line 5 holds 10 aliases of 11,111 nodes each.
    assert line.startswith("x.yaml:5: a YAML document of at least 1")
    assert "over the limit of 100000 nodes" in line


def test_node_count_is_exact_with_aliases_expanded(monkeypatch):
    # 3 levels of 3: the document is a mapping (1) of 3 keys (3) with values of 4, 13 and 40
    # nodes (a list node plus its expanded items): 61 nodes.
    text = billion_laughs(3, fan=3)
    expected = yaml.safe_load(text)
    monkeypatch.setenv("YOLO_MAX_YAML_NODES", "61")
    assert _load(text) == expected
    monkeypatch.setenv("YOLO_MAX_YAML_NODES", "60")
    _refused(text, r"^x.yaml:3: a YAML document of at least 61 nodes, over the limit of 60 nodes")


def test_raising_the_limit_admits_a_bigger_expansion(monkeypatch):
    text = billion_laughs(5)  # 111,111 strings: over the default
    _refused(text, "YOLO_MAX_YAML_NODES")
    monkeypatch.setenv("YOLO_MAX_YAML_NODES", "200000")
    assert len(_load(text)["a4"]) == 10


def test_recursive_alias_and_deep_nesting_are_one_line():
    _refused("&a [*a]\n", r"^x.yaml:1: alias \*a refers to the collection that holds it")
    _refused("a: &m {b: *m}\n", "refers to the collection that holds it")
    _refused("[" * 20000 + "]" * 20000, f"nested more than {MAX_DEPTH} levels deep")
    block = "".join("  " * i + "-\n" for i in range(MAX_DEPTH + 5))
    _refused(block, rf"^x.yaml:{MAX_DEPTH + 1}: YAML nested more than")
    assert _load("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


@pytest.mark.parametrize(
    "text, tag",
    [
        ('a: !!python/object/apply:os.system ["touch pwned"]\n', "!!python/object/apply:os.system"),
        ("a: !!python/name:os.system\n", "!!python/name:os.system"),
        ("a: !!python/object:collections.OrderedDict {}\n", "!!python/object:collections."),
        ("a:\n  - 1\n  - !custom x\n", "!custom"),
        ("!!python/tuple [1, 2]\n", "!!python/tuple"),
    ],
)
def test_non_standard_tags_are_refused_before_construction(text, tag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refused(text, "is not a standard YAML tag")
    assert f"tag '{tag}" in line
    assert line.startswith(f"x.yaml:{text.count(chr(10)) if 'custom' in text else 1}:")
    assert list(tmp_path.iterdir()) == []


def test_standard_tags_still_work():
    assert _load("a: !!str 1\nb: !!float 1\nc: !!int '7'\nd: !!binary aGk=\n") == {
        "a": "1",
        "b": 1.0,
        "c": 7,
        "d": b"hi",
    }


@pytest.mark.parametrize(
    "text, match",
    [
        ("? [a, b]\n: 1\n", r"^x.yaml:1: a list is used as a key"),
        ("{[a, b]: 1}\n", r"^x.yaml:1: a list is used as a key"),
        ("x: 1\n? {a: 1}\n: 2\n", r"^x.yaml:2: a mapping is used as a key"),
        ("lr0: 1\nmomentum: 2\nlr0: 3\n", r"^x.yaml:3: key 'lr0' is given twice \(first at line 1"),
        ("{a: 1, a: 2}\n", r"key 'a' is given twice"),
        ("a: 1\n---\nb: 2\n", r"^x.yaml:2: not valid YAML: expected a single document"),
        ("a: *nope\n", r"^x.yaml:1: not valid YAML: found undefined alias 'nope'"),
        ("a: [1, 2\n", r"^x.yaml:2: not valid YAML: while parsing a flow sequence"),
        ("a: 2024-13-45\n", r"^x.yaml:1: cannot read the value 2024-13-45: month must be"),
    ],
)
def test_odd_keys_and_broken_documents_are_one_line(text, match):
    _refused(text, match)


def test_merge_keys_may_be_overridden():
    assert _load("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n")["d"] == {"x": 3, "y": 2}


def test_no_error_line_carries_more_than_a_short_value():
    long_tag = _refused("a: !" + "x" * 100_000 + " 1\n", "is not a standard YAML tag")
    assert len(long_tag) < 250
    huge = _refused("a: " + "9" * 5000 + "\n", r"^x.yaml:1: cannot read the value 9999")
    assert len(huge) < 300
    key = "k" * 50_000
    long_key = _refused(f"? {key}\n: 1\n? {key}\n: 2\n", r"^x.yaml:3: key 'kkk.*is given twice")
    assert len(long_key) < 250


def test_short_repr_is_short_and_never_builds_the_whole_repr():
    assert short_repr(10**399) == "100000000000...(400 digits)"
    assert short_repr(-(10**399)).startswith("-1000")
    assert short_repr(10 ** (10**5)).startswith("an integer of about 1000")  # past str()'s limit
    assert short_repr(0.5) == "0.5" and short_repr("fast") == "'fast'"
    assert len(short_repr("x" * 10**6)) <= MAX_VALUE_CHARS
    nested: list = ["lol"] * 10
    for _ in range(9):  # 10^10 strings: a full repr would not fit in memory
        nested = [nested] * 10
    assert len(short_repr(nested)) <= MAX_VALUE_CHARS


@pytest.mark.parametrize(
    "data, match",
    [
        ("lr0: 0.01  # café\n".encode("latin-1"), r"^h.yaml:1: hyp is not UTF-8 text \(byte 0xe9"),
        ("lr0: 0.01\n".encode("utf-16"), r"^h.yaml: hyp is UTF-16 text; save it as UTF-8$"),
        ("lr0: 0.01\n".encode("utf-16-be"), r"^h.yaml: hyp holds NUL bytes \(byte 0x00 at"),
        ("lr0: 0.01\n".encode("utf-16-le"), r"holds NUL bytes .* save it as UTF-8$"),
        ("lr0: 0.01\n".encode("utf-32"), r"^h.yaml: hyp is UTF-32 text; save it as UTF-8$"),
        (b"lr0: 0.01\x00\n", r"holds NUL bytes \(byte 0x00 at offset 9\)"),
    ],
)
def test_text_that_is_not_utf8_is_one_line(tmp_path, monkeypatch, data, match):
    monkeypatch.chdir(tmp_path)
    Path("h.yaml").write_bytes(data)
    with pytest.raises(ConfigError, match=match):
        load_yaml("h.yaml", "hyp")


def test_utf8_bom_is_accepted_and_offsets_count_it(tmp_path):
    p = tmp_path / "h.yaml"
    p.write_bytes(b"\xef\xbb\xbflr0: 1e-2\n")
    assert load_yaml(p, "hyp") == {"lr0": 0.01}
    p.write_bytes(b"\xef\xbb\xbfa: 1\nb: \xff\n")
    with pytest.raises(
        ConfigError, match=r"h.yaml:2: hyp is not UTF-8 text \(byte 0xff at offset 11,"
    ):
        load_yaml(p, "hyp")


def test_file_size_and_kind_are_checked_before_reading(tmp_path, monkeypatch):
    p = tmp_path / "h.yaml"
    p.write_text("a: 1\n" * 100)
    monkeypatch.setenv("YOLO_MAX_TEXT_BYTES", "100")
    with pytest.raises(ConfigError, match=r"h.yaml: hyp: 500 B, over the limit of 100 B .*_TEXT_"):
        load_yaml(p, "hyp")
    with pytest.raises(ConfigError, match=r"hyp: a folder, not a file"):
        load_yaml(tmp_path, "hyp")


def test_dump_yaml_round_trips_strings_that_look_like_yaml_12_floats():
    data = {"name": "1e6", "x": 1e6, "y": ".5", "z": "=", "w": "1.0e6", "n": 3, "s": "café"}
    text = dump_yaml(data)
    assert _load(text) == data and list(_load(text)) == list(data)
    assert yaml.safe_load(text) == data  # still plain YAML for any other reader
