"""The one reader (and writer) of YAML documents: hyp files, a run's ``args.yaml``.

``yaml.safe_load`` runs no code, but it is not enough for a file a user hands over:
- a 3 KB document of nested aliases ("billion laughs") composes in microseconds into a graph
  whose expansion has 10^9 nodes; constructing it is cheap too (aliases share objects), but the
  first ``repr`` of a value for an error line takes minutes and gigabytes. Here the
  document is refused while it is composed, once its nodes with every alias counted as the size
  of what it refers to pass ``MAX_YAML_NODES``, before anything is constructed or printed;
- ``!!python/object/apply:os.system`` and other non-standard tags are refused with one line
  naming the line and the tag (``safe_load`` refuses them too, but with a traceback);
- a sequence or mapping as a key, a key given twice, a document nested deeper than
  :data:`MAX_DEPTH` (PyYAML's composer recurses) or an alias to the collection holding it are
  refused with one line;
- YAML 1.2 floats (``1e6``, ``1E-3``, ``-2.5e+3``) are floats; PyYAML's YAML 1.1 resolver reads
  ``1e6`` as the string ``'1e6'``. :func:`dump_yaml` writes with the same resolver, so a string
  that looks like such a float is quoted and reads back as the same string;
- error lines quote at most :data:`MAX_VALUE_CHARS` characters of a value (:func:`short_repr`).

The text is read with :func:`build_utils.limits.read_config_text`: a regular file within
``MAX_TEXT_BYTES``, UTF-8 (a byte-order mark is dropped) or one line saying to save it as UTF-8.
"""

from __future__ import annotations

import os
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from build_utils.checks import BIG_INT_BITS, LOG10_2
from build_utils.errors import ConfigError
from build_utils.limits import MAX_TEXT_BYTES, MAX_YAML_NODES, read_config_text

# Nesting deeper than this is refused: PyYAML composes and constructs recursively (about three
# Python frames a level), so a few KB of '[' would otherwise end in a RecursionError. No
# configuration nests more than a handful of levels.
MAX_DEPTH = 100
# The most characters of a value (or key, or tag) an error line quotes.
MAX_VALUE_CHARS = 100

_STD = "tag:yaml.org,2002:"
# The standard YAML tags SafeConstructor builds (no Python objects); anything else is refused.
STANDARD_TAGS = frozenset(
    _STD + t
    for t in (
        "null",
        "bool",
        "int",
        "float",
        "str",
        "binary",
        "timestamp",
        "seq",
        "map",
        "omap",
        "pairs",
        "set",
        "merge",
    )
)

# YAML 1.2 floats that YAML 1.1 (PyYAML's resolver) leaves strings: an exponent without a dot
# (1e6, 1E-3) or without a signed exponent (1.0e6). PyYAML's own float resolver still runs first.
_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?)$""",
    re.X,
)
_FLOAT_12_FIRST = list("-+0123456789.")

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = MAX_VALUE_CHARS - 20
_repr.maxlong = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


def short_text(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with ``...`` and the full length) for an error line."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 25]}... ({len(text)} characters)"


def short_repr(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A ``repr`` of ``value`` of at most about ``limit`` characters, computed without building
    the whole repr of a huge value: a 400-digit integer is ``12345...(400 digits)``, a list its
    first items. Integers past Python's 4300-digit ``str`` limit are described, not printed."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        if value.bit_length() > BIG_INT_BITS:
            return f"an integer of about {int(value.bit_length() * LOG10_2)} digits"
        digits = str(abs(value))
        sign = "-" if value < 0 else ""
        return f"{sign}{digits[:12]}...({len(digits)} digits)"
    return short_text(_repr.repr(value), limit)


class _SafeResolver(Resolver):
    """PyYAML's YAML 1.1 resolver with YAML 1.2 floats added and the 1.1 ``=`` value type
    (which SafeConstructor cannot build) removed: ``=`` is a plain string."""


_SafeResolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _STD + "value"]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}
_SafeResolver.add_implicit_resolver(_STD + "float", _FLOAT_12, _FLOAT_12_FIRST)


class _Refused(Exception):
    """A document refused while composing or constructing: the message and the 1-based line."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.message, self.line = message, line


class _BoundedLoader(Reader, Scanner, Parser, Composer, SafeConstructor, _SafeResolver):
    """A SafeLoader whose composer counts nodes (aliases expanded), depth, tags and keys."""

    def __init__(self, text: str):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        _SafeResolver.__init__(self)
        self.node_limit = MAX_YAML_NODES.value()
        self.nodes = 0  # the document's nodes so far, each alias counted as what it expands to
        self.depth = 0
        self.sizes: dict[str, int] = {}  # anchor -> expanded node count of its (finished) node

    def _count(self, n: int, line: int) -> None:
        self.nodes += n
        if self.nodes > self.node_limit:
            raise _Refused(MAX_YAML_NODES.exceeded(self.nodes, "a YAML document of at least"), line)

    def compose_document(self) -> Node:
        self.sizes = {}
        return super().compose_document()

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent):
            anchor = event.anchor
            if anchor in self.anchors and anchor not in self.sizes:
                raise _Refused(
                    f"alias *{short_text(anchor, 40)} refers to the collection that holds it "
                    "(a recursive document)",
                    line,
                )
            if anchor in self.sizes:
                self._count(self.sizes[anchor], line)
            return super().compose_node(parent, index)  # an undefined alias: PyYAML's error
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refused(f"YAML nested more than {MAX_DEPTH} levels deep", line)
        before = self.nodes
        self._count(1, line)
        node = super().compose_node(parent, index)
        self.depth -= 1
        if node.tag not in STANDARD_TAGS:
            # Checked before any constructor sees it: no code can run, whatever the tag names.
            tag = short_text(_tag_text(node.tag), 60)
            raise _Refused(
                f"tag '{tag}' is not a standard YAML tag; only plain values (numbers, strings, "
                "true/false, lists, mappings) are read",
                line,
            )
        if event.anchor is not None:
            self.sizes[event.anchor] = self.nodes - before
        return node

    def compose_mapping_node(self, anchor: str | None) -> MappingNode:
        node = super().compose_mapping_node(anchor)
        for key, _ in node.value:
            if not isinstance(key, ScalarNode):
                kind = "list" if key.id == "sequence" else "mapping"
                raise _Refused(
                    f"a {kind} is used as a key; keys must be plain names or numbers",
                    key.start_mark.line + 1,
                )
        return node

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        # A key given twice is an error (PyYAML keeps the last silently); keys merged in with
        # '<<' may be overridden, that is what merging is for.
        if isinstance(node, MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _STD + "merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # unhashable: PyYAML's own error names it
                if first is not None:
                    raise _Refused(
                        f"key {short_repr(key)} is given twice (first at line {first})", line
                    )
                seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as e:
            # int('1' * 5000) (past Python's digit limit), a timestamp 2024-13-45, ...
            shown = short_text(node.value) if isinstance(node, ScalarNode) else f"a {node.id}"
            raise _Refused(
                f"cannot read the value {shown}: {short_text(str(e))}", node.start_mark.line + 1
            ) from e


@dataclass
class YamlDocument:
    """A composed (bounded, checked) document: ``root`` for positions, :meth:`value` to build."""

    root: Node | None
    path: str
    _loader: _BoundedLoader

    def value(self, node: Node | None = None) -> Any:
        """The Python value of ``node`` (default the root): dicts, lists, str, int, float, bool,
        None (and the other standard YAML types). Raises ConfigError naming the line."""
        node = self.root if node is None else node
        if node is None:
            return None
        try:
            return self._loader.construct_object(node, deep=True)
        except (_Refused, yaml.YAMLError) as e:
            raise _yaml_error(e, self.path) from None


def _yaml_error(e: _Refused | yaml.YAMLError, path: str) -> ConfigError:
    """A refused document, or PyYAML's error as one line: its context and problem (``str(e)``
    spans several lines, with a snippet of the text), at the problem's line."""
    if isinstance(e, _Refused):
        return ConfigError(e.message, path, e.line)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    problem = ", ".join(p for p in parts if p) or type(e).__name__
    return ConfigError(
        f"not valid YAML: {short_text(problem)}", path, mark.line + 1 if mark else None
    )


def _tag_text(tag: str) -> str:
    """A tag as a user writes it: ``!!python/name:os.system``, ``!custom``."""
    return "!!" + tag[len(_STD) :] if tag.startswith(_STD) else tag


def parse_yaml(text: str, path: str | os.PathLike[str] = "<yaml text>") -> YamlDocument:
    """Compose one YAML document from ``text`` (node count, depth, tags and keys checked);
    ConfigError naming ``path`` and the line otherwise. An empty document has root None."""
    path = str(path)
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
    except (_Refused, yaml.YAMLError) as e:
        raise _yaml_error(e, path) from None
    return YamlDocument(root, path, loader)


def compose_yaml(path: str | os.PathLike[str], what: str) -> YamlDocument:
    """The composed document of YAML file ``path`` (``what`` names it in errors: "hyperparameter
    file"), read within ``MAX_TEXT_BYTES`` as UTF-8. Raises ConfigError as one line."""
    return parse_yaml(read_config_text(path, MAX_TEXT_BYTES, what), path)


def load_yaml(path: str | os.PathLike[str], what: str) -> Any:
    """The value of YAML file ``path``: :func:`compose_yaml` then built (plain Python types)."""
    return compose_yaml(path, what).value()


class _Dumper(yaml.SafeDumper):
    """SafeDumper that also quotes what the loader reads as a YAML 1.2 float (``'1e6'``), and
    still quotes ``'='`` (YAML 1.1's value type), so that any YAML reader reads the text back."""


_Dumper.add_implicit_resolver(_STD + "float", _FLOAT_12, _FLOAT_12_FIRST)


def dump_yaml(data: Any) -> str:
    """YAML text of plain ``data`` (keys in their order) that :func:`load_yaml` reads back equal."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
