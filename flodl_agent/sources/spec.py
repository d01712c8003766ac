"""Source specs: where a run's tree (``publish``, ``join.source.from``) or a
data root (``join.data_source``) comes from.

The scheme names the tool, not a wire protocol: ``file://`` is a directory on
this box, ``rsync://`` and ``sshfs://`` go over ssh, ``git+…`` is a pinned
checkout. Pure parsing; fetching lives with publish and the agent.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from ..errors import Failure

Scheme = Literal["file", "rsync", "sshfs", "git+https", "git+ssh", "git+file"]

SOURCE_FORMS = (
    "file:///abs/path",
    "rsync://[user@]host[:port]:/abs/path",
    "git+https://host/owner/repo#<ref>",
    "git+ssh://[user@]host/owner/repo#<ref>",
    "git+file:///abs/repo#<ref>",
)
DATA_SOURCE_FORMS = ("sshfs://[user@]host[:port]:/abs/path",)


class SpecError(Failure, ValueError):
    """A source spec that does not parse."""


@dataclass(frozen=True)
class SourceSpec:
    scheme: Scheme
    path: str
    host: str | None = None
    user: str | None = None
    port: int | None = None
    ref: str | None = None
    url: str | None = None  # for git: what `git fetch` is given

    @property
    def is_git(self) -> bool:
        return self.scheme.startswith("git+")

    @property
    def ssh_destination(self) -> str | None:
        """``[user@]host`` for the ssh-carried schemes."""
        if self.host is None or self.scheme not in ("rsync", "sshfs"):
            return None
        return f"{self.user}@{self.host}" if self.user else self.host

    def _host_port(self) -> str:
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"{user}{host}" + (f":{self.port}" if self.port is not None else "")

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        if self.scheme in ("rsync", "sshfs"):
            return f"{self.scheme}://{self._host_port()}:{self.path}"
        return f"git+{self.url}#{self.ref}"


def _absolute(path: str, spec: str) -> str:
    if not path.startswith("/"):
        raise SpecError(
            f"`{spec}` needs an absolute path after the host",
            "write the path from the root, e.g. rsync://host:/home/op/train",
        )
    if ".." in path.split("/"):
        raise SpecError(f"`{spec}` has `..` in its path", "name the directory directly")
    return posixpath.normpath(path)


def _ssh_form(scheme: Scheme, rest: str, spec: str) -> SourceSpec:
    # [user@]host[:port]:/abs — the `:/` marks where the path starts.
    head, sep, tail = rest.partition(":/")
    if not sep:
        raise SpecError(
            f"`{spec}` has no `:/abs/path` after the host",
            f"write {scheme}://[user@]host[:port]:/abs/path",
        )
    path = _absolute("/" + tail, spec)
    user: str | None = None
    if "@" in head:
        user, _, head = head.rpartition("@")
        if not user:
            raise SpecError(f"`{spec}` has an empty user before `@`", "drop the `@` or name the user")
    port: int | None = None
    if head.startswith("["):  # [ipv6]
        host, _, after = head[1:].partition("]")
        port_text = after[1:] if after.startswith(":") else (after or None)
    else:
        host, _, port_text_raw = head.partition(":")
        port_text = port_text_raw or None
    if not host:
        raise SpecError(f"`{spec}` names no host", f"write {scheme}://[user@]host[:port]:/abs/path")
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise SpecError(f"`{spec}` has a bad port `{port_text}`", "use a port from 1 to 65535")
        port = int(port_text)
    return SourceSpec(scheme, path, host=host, user=user, port=port)


def _git_form(scheme: Scheme, rest: str, spec: str) -> SourceSpec:
    url, sep, ref = rest.partition("#")
    if not sep or not ref.strip():
        raise SpecError(
            f"`{spec}` pins no ref",
            "append #<tag|commit|branch>: a default branch floats, and a floating ref is not a pin",
        )
    transport = scheme.removeprefix("git+")
    parts = urlsplit(f"{transport}://{url}")
    if transport == "file":
        if parts.netloc:
            raise SpecError(f"`{spec}` names a host in a file URL", "write git+file:///abs/repo#ref")
        path = _absolute(parts.path, spec)
        return SourceSpec(scheme, path, ref=ref, url=f"file://{path}")
    if not parts.hostname:
        raise SpecError(f"`{spec}` names no host", f"write {scheme}://host/owner/repo#ref")
    try:
        port = parts.port
    except ValueError:
        raise SpecError(f"`{spec}` has a bad port", "use a port from 1 to 65535") from None
    return SourceSpec(
        scheme,
        parts.path or "/",
        host=parts.hostname,
        user=parts.username,
        port=port,
        ref=ref,
        url=f"{transport}://{url}",
    )


def parse_source(spec: str) -> SourceSpec:
    """A run's source: ``file://``, ``rsync://`` or a ref-pinned ``git+…`` spec."""
    scheme, sep, rest = spec.partition("://")
    if not sep:
        raise SpecError(
            f"`{spec}` is not a source spec",
            "use one of: " + ", ".join(SOURCE_FORMS),
        )
    if scheme == "file":
        if not rest.startswith("/"):
            raise SpecError(
                f"`{spec}` must be file:///abs/path (three slashes, no host)",
                "file:// names a directory on this box",
            )
        return SourceSpec("file", _absolute(rest, spec))
    if scheme == "rsync":
        return _ssh_form("rsync", rest, spec)
    if scheme in ("git+https", "git+ssh", "git+file"):
        return _git_form(scheme, rest, spec)  # type: ignore[arg-type]
    hint = "use one of: " + ", ".join(SOURCE_FORMS)
    if scheme in ("https", "http", "ssh", "git"):
        hint = f"a git source is written git+{scheme if scheme != 'git' else 'https'}://…#<ref>"
    raise SpecError(f"`{spec}`: unknown scheme `{scheme}://`", hint)


def parse_data_source(spec: str) -> SourceSpec:
    """A data root to mount read-only: ``sshfs://[user@]host[:port]:/abs``."""
    scheme, sep, rest = spec.partition("://")
    if scheme != "sshfs" or not sep:
        raise SpecError(
            f"`{spec}` is not a data source",
            "write sshfs://[user@]host[:port]:/abs/path, or drop data_source and "
            "name an already mounted root in data_path",
        )
    return _ssh_form("sshfs", rest, spec)
