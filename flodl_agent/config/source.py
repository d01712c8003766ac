"""YAML documents with line numbers, and the overlay rule.

PyYAML's ``safe_load`` forgets where values came from and silently keeps the
last of two duplicate keys. Configuration errors must name the line, and a
duplicate key is almost always a mistake, so documents are composed to nodes
and converted here, recording the line of every key and item.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..names import shown
from .problems import ConfigError, Loc, Problem

# Aliases can expand a short file into a huge document ("billion laughs");
# no honest configuration comes near this many values.
MAX_NODES = 100_000
MAX_BYTES = 4 * 1024 * 1024
# Nesting, in the file and once aliases are expanded: the schema's deepest path is a handful
# of levels, and a few KiB of `[[[[…` must not exhaust the parsers' recursion.
MAX_DEPTH = 32
DEPTH_FIX = f"configuration nests a few levels deep; flatten it (at most {MAX_DEPTH} levels)"


@dataclass(frozen=True)
class Mark:
    file: str
    line: int


@dataclass
class Document:
    """Plain data (dicts, lists, scalars) plus the mark of every location in it."""

    data: Any
    marks: dict[Loc, Mark] = field(default_factory=dict)

    def mark_for(self, loc: Loc) -> Mark | None:
        """The mark of ``loc`` or of its closest ancestor that has one."""
        for end in range(len(loc), -1, -1):
            mark = self.marks.get(loc[:end])
            if mark is not None:
                return mark
        return None

    def locate(self, problem: Problem) -> Problem:
        mark = self.mark_for(problem.loc)
        if mark is None:
            return problem
        return problem.located(mark.file, mark.line)


class _Loader(yaml.SafeLoader):
    """PyYAML's composer recurses once per level of nesting: refuse deep documents before
    they reach the interpreter's recursion limit."""

    def __init__(self, text: str, name: str) -> None:
        super().__init__(text)
        self.name = name
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]
                message = f"nests deeper than {MAX_DEPTH} levels"
                raise ConfigError([Problem((), message, DEPTH_FIX, file=self.name, line=line)])
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Converter:
    """Nodes to plain data with a mark per location. Problems with keys (duplicates, keys
    that are not strings) are collected, so one pass reports every one of them."""

    def __init__(self, loader: yaml.SafeLoader, name: str, text: str) -> None:
        self.loader = loader
        self.name = name
        self.text = text
        self.marks: dict[Loc, Mark] = {}
        self.count = 0
        self.active: set[int] = set()
        self.problems: list[Problem] = []

    def _problem(self, node: yaml.Node, message: str, hint: str, loc: Loc) -> Problem:
        return Problem(loc, message, hint, file=self.name, line=node.start_mark.line + 1)

    def _fail(self, node: yaml.Node, message: str, hint: str, loc: Loc) -> ConfigError:
        return ConfigError([*self.problems, self._problem(node, message, hint, loc)])

    def _source(self, node: yaml.Node) -> str:
        """A node as written in the file (on one line, shortened)."""
        start, end = node.start_mark.index, node.end_mark.index
        return shown(" ".join(self.text[start:end].split()) or "(empty)")

    def convert(self, node: yaml.Node, loc: Loc) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self._fail(
                node,
                f"document expands to more than {MAX_NODES} values",
                "remove the alias chain; configuration files are small",
                loc,
            )
        if len(loc) > MAX_DEPTH:  # aliases nested in aliases: deep only once expanded
            raise self._fail(node, f"nests deeper than {MAX_DEPTH} levels", DEPTH_FIX, loc)
        self.marks.setdefault(loc, Mark(self.name, node.start_mark.line + 1))
        if isinstance(node, yaml.ScalarNode):
            return self.loader.construct_object(node, deep=True)
        if id(node) in self.active:
            raise self._fail(node, "recursive alias", "an alias may not contain itself", loc)
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                return [self.convert(item, (*loc, i)) for i, item in enumerate(node.value)]
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, loc)
        finally:
            self.active.discard(id(node))
        raise self._fail(node, "unsupported YAML node", "use plain mappings and lists", loc)

    def _mapping(self, node: yaml.MappingNode, loc: Loc) -> dict[str, Any]:
        self.loader.flatten_mapping(node)  # resolves `<<: *anchor` merge keys
        out: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = (
                self.loader.construct_object(key_node, deep=True)
                if isinstance(key_node, yaml.ScalarNode)
                else None
            )
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                self.problems.append(
                    self._problem(
                        key_node,
                        f"key `{self._source(key_node)}` is not a string",
                        "keys are field names; quote the key if it is meant as text",
                        loc,
                    )
                )
                continue
            if key in out:
                self.problems.append(
                    self._problem(
                        key_node,
                        f"duplicate key `{shown(key)}` (first at line {first_line[key]})",
                        "keep one of the two; YAML would silently use the last",
                        (*loc, key),
                    )
                )
                continue
            first_line[key] = line
            self.marks[(*loc, key)] = Mark(self.name, line)
            out[key] = self.convert(value_node, (*loc, key))
        return out


def _too_large(name: str) -> ConfigError:
    return ConfigError(
        [Problem((), f"file is larger than {MAX_BYTES // 1024} KiB", "is this the right file?", file=name)]
    )


def parse_yaml(text: str, name: str) -> Document:
    """Parse one YAML document; every failure is a :class:`ConfigError`."""
    if len(text) > MAX_BYTES:  # counted in characters: close enough, and cheap
        raise _too_large(name)
    loader: _Loader | None = None
    try:
        loader = _Loader(text, name)
        node = loader.get_single_node()
        if node is None:
            return Document(None, {(): Mark(name, 1)})
        converter = _Converter(loader, name, text)
        data = converter.convert(node, ())
        if converter.problems:
            raise ConfigError(converter.problems)
        return Document(data, converter.marks)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or exc.context or "syntax error"
        raise ConfigError(
            [Problem((), f"not valid YAML: {what}", "check indentation and quoting", file=name, line=line)]
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem((), f"not valid YAML: {exc}", None, file=name)]) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml(path: Path) -> Document:
    name = str(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_BYTES + 1)  # never slurp a huge file to refuse it
    except FileNotFoundError:
        raise ConfigError([Problem((), "no such file", "check the path", file=name)]) from None
    except IsADirectoryError:
        raise ConfigError(
            [Problem((), "is a directory, not a file", "name the YAML file", file=name)]
        ) from None
    except OSError as exc:
        raise ConfigError([Problem((), f"cannot read: {exc.strerror}", None, file=name)]) from None
    if len(raw) > MAX_BYTES:
        raise _too_large(name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [Problem((), f"not UTF-8 text (byte {exc.start})", "save the file as UTF-8", file=name)]
        ) from None
    return parse_yaml(text, name)


def deep_merge(base: Any, overlay: Any) -> Any:
    """The overlay rule: mappings merge key by key, anything else is replaced."""
    if isinstance(base, Mapping) and isinstance(overlay, Mapping):
        merged = dict(base)
        for key, value in overlay.items():
            merged[key] = deep_merge(base[key], value) if key in base else value
        return merged
    return overlay


def overlay(base: Document, top: Document) -> Document:
    """``top`` (a cluster file) deep-merged onto ``base`` (``fdl.yml``).

    Marks follow the values: a location replaced by the overlay, and all of
    its descendants, point into the overlay's file.
    """
    data = deep_merge(base.data if base.data is not None else {}, top.data)
    marks = dict(base.marks)
    replaced = [
        loc
        for loc in top.marks
        if loc
        and not (isinstance(_get(base.data, loc), Mapping) and isinstance(_get(top.data, loc), Mapping))
    ]
    for loc in replaced:
        for old in [m for m in marks if m[: len(loc)] == loc]:
            del marks[old]
    marks.update({loc: mark for loc, mark in top.marks.items() if loc})
    return Document(data, marks)


def _get(data: Any, loc: Loc) -> Any:
    for part in loc:
        if isinstance(data, Mapping) and isinstance(part, str):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data
