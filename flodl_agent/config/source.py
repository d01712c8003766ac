"""YAML documents with line numbers, and the overlay rule.

PyYAML's ``safe_load`` forgets where values came from and silently keeps the
last of two duplicate keys. Configuration errors must name the line, and a
duplicate key is almost always a mistake, so documents are composed to nodes
and converted here, recording the line of every key and item.
"""

from __future__ import annotations

import os
import stat
import sys
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


class NotRegular(Exception):
    """A file read whole that is no regular file: a FIFO waits for a writer, /dev/zero never
    ends, a kernel file (/proc/kmsg) waits for data. ``kind`` says which it is."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"not a regular file ({kind})")
        self.kind = kind


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a file that is not regular is, by its mode; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "no plain file")


KERNEL_ROOTS = ("proc", "sys")  # where the kernel makes files up as they are read


def path_kind(path: Path) -> str | None:
    """What ``path`` is when it is no regular file (it follows links); None for a regular file.
    A file under /proc or /sys is a kernel file: it may wait for data (/proc/kmsg) or never end.
    OSError when nothing is there."""
    kind = file_kind(path.stat().st_mode)
    if kind is None and path.resolve().parts[1:2] in [(root,) for root in KERNEL_ROOTS]:
        return "a kernel file"
    return kind


def read_bounded(path: Path, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of a regular file (the one more says it is too large): anything
    else is :class:`NotRegular`, found before a byte is read and without waiting. A device or
    a /proc file is never opened (an open can act: a tape rewinds); the open does not block (a
    FIFO), fstat checks what was opened, and a read that would wait refuses (debugfs and kin)."""
    kind = path_kind(path)
    if kind is not None:
        raise NotRegular(kind)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        kind = file_kind(info.st_mode)  # replaced since the stat
        if kind is not None:
            raise NotRegular(kind)
        return _read_fd(fd, limit + 1, sized=info.st_size > 0)
    finally:
        os.close(fd)


def _read_fd(fd: int, wanted: int, sized: bool) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < wanted:
        try:  # a file of size 0 is asked for one byte: /proc/kmsg hands out what it reads once
            chunk = os.read(fd, min(wanted - got, 1 << 20) if sized else 1)
        except BlockingIOError:
            raise NotRegular("a kernel file that waits for data") from None
        if not chunk:
            break
        if not sized:  # a file of size 0 with bytes in it: /proc and /sys make them up as read
            raise NotRegular("a kernel file, its size unknown")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


NOT_REGULAR_FIX = (
    "name the YAML file itself: fdl reads a config file whole, never a FIFO, device or directory"
)


STDIN, STDIN_NAME = "-", "<stdin>"  # a config FILE of `-` is standard input (./- names a file so called)


def shown_name(path: Path) -> str:
    """How a config's problems name where it came from."""
    return STDIN_NAME if str(path) == STDIN else str(path)


def _read_stdin() -> bytes:
    """Up to MAX_BYTES + 1 bytes of stdin, to its end: a pipe, a here-doc, a redirected file."""
    if sys.stdin is None:  # fd 0 closed (`<&-`)
        return b""
    return sys.stdin.buffer.read(MAX_BYTES + 1)


def read_yaml(path: Path) -> Document:
    name = shown_name(path)
    try:
        # never slurp a huge file (or an endless stdin) to refuse it
        raw = _read_stdin() if str(path) == STDIN else read_bounded(path, MAX_BYTES)
    except FileNotFoundError:
        raise ConfigError([Problem((), "no such file", "check the path", file=name)]) from None
    except NotRegular as exc:
        message = "is a directory, not a file" if exc.kind == "a directory" else str(exc)
        raise ConfigError([Problem((), message, NOT_REGULAR_FIX, file=name)]) from None
    except OSError as exc:
        raise ConfigError([Problem((), f"cannot read: {exc.strerror}", None, file=name)]) from None
    except ValueError:  # a path with a NUL in it (from a config value: argv cannot hold one)
        raise ConfigError([Problem((), "cannot read: the path holds a NUL", None, file=name)]) from None
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
