"""Source specs: the five run-source forms and the sshfs data source."""

from __future__ import annotations

import pytest

from flodl_agent.sources.spec import SourceSpec, SpecError, parse_data_source, parse_source


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("file:///home/op/my-train", SourceSpec("file", "/home/op/my-train")),
        (
            "rsync://op@ctrl:/home/op/.flodl/run/tree",
            SourceSpec("rsync", "/home/op/.flodl/run/tree", host="ctrl", user="op"),
        ),
        ("rsync://ctrl:/tree", SourceSpec("rsync", "/tree", host="ctrl")),
        ("rsync://op@ctrl:2222:/srv/t", SourceSpec("rsync", "/srv/t", host="ctrl", user="op", port=2222)),
        ("rsync://[fd00::1]:22:/t", SourceSpec("rsync", "/t", host="fd00::1", port=22)),
        (
            "git+https://github.com/o/r#v1.2",
            SourceSpec("git+https", "/o/r", host="github.com", ref="v1.2", url="https://github.com/o/r"),
        ),
        (
            "git+ssh://git@host:2200/o/r.git#abc123",
            SourceSpec(
                "git+ssh",
                "/o/r.git",
                host="host",
                user="git",
                port=2200,
                ref="abc123",
                url="ssh://git@host:2200/o/r.git",
            ),
        ),
        (
            "git+file:///srv/repo#main",
            SourceSpec("git+file", "/srv/repo", ref="main", url="file:///srv/repo"),
        ),
    ],
)
def test_source_forms(spec: str, expected: SourceSpec) -> None:
    parsed = parse_source(spec)
    assert parsed == expected
    assert parse_source(str(parsed)) == parsed  # the canonical spelling parses back


@pytest.mark.parametrize(
    ("spec", "message", "hint"),
    [
        ("git+https://github.com/o/r", "pins no ref", "floating ref is not a pin"),
        ("git+https://github.com/o/r#", "pins no ref", "#<tag|commit|branch>"),
        ("https://github.com/o/r#v1", "unknown scheme", "git+https://"),
        ("/home/op/train", "is not a source spec", "file:///abs/path"),
        ("file://host/abs", "three slashes", "directory on this box"),
        ("rsync://ctrl/tree", "no `:/abs/path`", "rsync://[user@]host[:port]:/abs/path"),
        ("rsync://ctrl:99999:/t", "bad port", "1 to 65535"),
        ("rsync://@ctrl:/t", "empty user", "name the user"),
        ("rsync://:/t", "names no host", "rsync://"),
        ("file:///a/../b", "has `..`", "directly"),
        ("git+file://host/repo#x", "names a host", "git+file:///abs/repo#ref"),
    ],
)
def test_bad_source_specs(spec: str, message: str, hint: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_source(spec)
    assert message in caught.value.message and hint in caught.value.fix


def test_data_source_is_sshfs_only() -> None:
    spec = parse_data_source("sshfs://flodl-join@ctrl:/flodl/data")
    assert spec.ssh_destination == "flodl-join@ctrl" and spec.path == "/flodl/data"
    with pytest.raises(SpecError) as caught:
        parse_data_source("nfs://ctrl:/flodl/data")
    assert "data_path" in caught.value.fix
