"""YAML with line numbers, the limits of the loader, and the overlay rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_agent.config import ConfigError, load_config, load_document, parse_yaml
from flodl_agent.config.source import MAX_DEPTH, MAX_NODES, deep_merge


def error_of(text: str) -> tuple[str, int | None, str]:
    with pytest.raises(ConfigError) as caught:
        parse_yaml(text, "f.yml")
    (p,) = caught.value.problems
    return p.path, p.line, p.message


def test_every_key_and_item_has_its_line() -> None:
    doc = parse_yaml("cluster:\n  workers:\n    - host: a\n    -\n      host: b\n", "f.yml")
    assert doc.marks[("cluster",)].line == 1
    assert doc.marks[("cluster", "workers", 0, "host")].line == 3
    assert doc.marks[("cluster", "workers", 1)].line == 5
    assert doc.mark_for(("cluster", "workers", 1, "missing")) == doc.marks[("cluster", "workers", 1)]


def test_duplicate_keys_are_errors_not_silently_merged() -> None:
    assert error_of("a: 1\nb:\n  c: 1\n  c: 2\n") == ("b.c", 4, "duplicate key `c` (first at line 3)")


def test_non_string_keys_are_refused() -> None:
    path, line, message = error_of("env:\n  1: x\n")
    assert (path, line) == ("env", 2) and "not a string" in message


def test_every_key_problem_is_reported_in_one_pass_and_complex_keys_by_their_text() -> None:
    text = "a: 1\na: 2\nb:\n  c: 1\n  c: 2\n? [x, y]\n: 1\n? {k: v}\n: 2\n~: 3\n"
    with pytest.raises(ConfigError) as caught:
        parse_yaml(text, "f.yml")
    found = [(p.path, p.line, p.message) for p in caught.value.problems]
    assert found == [
        ("a", 2, "duplicate key `a` (first at line 1)"),
        ("b.c", 5, "duplicate key `c` (first at line 4)"),
        ("<document>", 6, "key `[x, y]` is not a string"),
        ("<document>", 8, "key `{k: v}` is not a string"),
        ("<document>", 10, "key `~` is not a string"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "x: " + "[" * 1000 + "]" * 1000 + "\n",  # about 2 KiB: the composer's recursion, before
        "x: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
        "- " * 1000 + "1\n",
        # shallow as written, deep once the aliases are expanded
        "\n".join(
            ["x0: &x0 " + "[" * 20 + "1" + "]" * 20]
            + [f"x{i}: &x{i} " + "[" * 20 + f"*x{i - 1}" + "]" * 20 for i in range(1, 60)]
        )
        + "\n",
    ],
)
def test_deep_nesting_is_refused_with_the_limit(text: str) -> None:
    _, line, message = error_of(text)
    assert message == f"nests deeper than {MAX_DEPTH} levels" and line is not None


def test_nesting_up_to_the_limit_loads() -> None:
    depth = MAX_DEPTH - 1  # the top-level mapping is one level
    assert parse_yaml("x: " + "[" * depth + "]" * depth + "\n", "f.yml").data is not None


def test_syntax_errors_carry_their_line() -> None:
    path, line, message = error_of("cluster:\n  controller: [\n  workers: x\n")
    assert path == "<document>" and message.startswith("not valid YAML")
    assert line is not None and line >= 2


def test_several_documents_are_refused() -> None:
    _, _, message = error_of("a: 1\n---\nb: 2\n")
    assert "not valid YAML" in message


def test_alias_bombs_stop_at_the_node_cap() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)
    ]
    _, _, message = error_of("\n".join(lines) + "\n")
    assert f"more than {MAX_NODES} values" in message


def test_merge_keys_and_anchors_work() -> None:
    doc = parse_yaml(
        "base: &w {nccl_socket_ifname: eth0, path: /opt/flodl}\nworkers:\n  - <<: *w\n    host: a\n", "f.yml"
    )
    assert doc.data["workers"][0] == {"nccl_socket_ifname": "eth0", "path": "/opt/flodl", "host": "a"}


def test_files_that_cannot_be_read(tmp_path: Path) -> None:
    cases = {
        tmp_path / "missing.yml": "no such file",
        tmp_path: "is a directory",
    }
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"cluster: \xff\xfe\n")
    cases[binary] = "not UTF-8"
    empty = tmp_path / "empty.yml"
    empty.write_text("# nothing but a comment\n")
    cases[empty] = "is empty"
    for path, fragment in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert fragment in caught.value.problems[0].message, path


def test_deep_merge_merges_mappings_and_replaces_everything_else() -> None:
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1}
    top = {"a": {"y": [3], "z": {"k": 1}}, "b": {"now": "a map"}}
    assert deep_merge(base, top) == {"a": {"x": 1, "y": [3], "z": {"k": 1}}, "b": {"now": "a map"}}
    assert base == {"a": {"x": 1, "y": [1, 2]}, "b": 1}  # inputs untouched


def test_overlay_marks_point_into_the_file_that_supplied_the_value(tmp_path: Path) -> None:
    base = tmp_path / "fdl.yml"
    base.write_text(
        "cluster:\n"
        "  env: {NCCL_DEBUG: INFO}\n"
        "  controller:\n"
        "    host: 10.0.0.1\n"
        "    join: {join_timeout: 300}\n"
        "  workers:\n"
        "    - host: a\n"
        "    - host: b\n"
        "      bogus_base: 1\n"
    )
    top = tmp_path / "fdl.cluster.yml"
    top.write_text("cluster:\n  controller:\n    port: 7000\n  workers:\n    - host: c\n")
    doc = load_document(top, base)
    assert doc.data["cluster"]["controller"] == {
        "host": "10.0.0.1",
        "join": {"join_timeout": 300},
        "port": 7000,
    }
    assert doc.data["cluster"]["workers"] == [{"host": "c"}]  # lists are replaced, not merged
    assert doc.marks[("cluster", "env")].file == str(base)
    assert doc.marks[("cluster", "controller", "host")].file == str(base)
    assert doc.marks[("cluster", "controller", "port")].file == str(top)
    assert doc.marks[("cluster", "workers", 0, "host")].file == str(top)
    # the base's second worker was replaced along with its list: no stale mark survives
    assert ("cluster", "workers", 1, "bogus_base") not in doc.marks
    loaded = load_config(top, base)
    assert loaded.config.cluster is not None and loaded.config.cluster.controller.port == 7000


def test_overlay_errors_name_the_file_they_are_in(tmp_path: Path) -> None:
    base = tmp_path / "fdl.yml"
    base.write_text("cluster:\n  controller:\n    host: h\n    prot: 1\n")
    top = tmp_path / "fdl.cluster.yml"
    top.write_text("cluster:\n  workers:\n    - {host: a, local_devices: []}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(top, base)
    where = {p.path: (p.file, p.line) for p in caught.value.problems}
    assert where == {
        "cluster.controller.prot": (str(base), 4),
        "cluster.workers[0].local_devices": (str(top), 3),
    }
