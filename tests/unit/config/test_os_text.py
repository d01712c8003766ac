"""Text that reaches a process (argv, an environment, a path) is text the OS can pass: a NUL or
a lone surrogate is refused where it is written, naming the field, never at rank start."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from flodl_agent.cli import main as cli
from tests.support import load, problems_of


def cluster(controller: str = "", worker: str = "") -> str:
    return f"cluster:\n  controller: {{host: 127.0.0.1{controller}}}\n  workers:\n  - host: a\n{worker}"


def join(block: str) -> str:
    return f"join:\n{block}"


# (document with `@V` where the value goes, the field path the refusal names); each value
# ends up in a rank's (or fdl's own tools') argv, environment, path or cwd.
FIELDS = [
    (cluster() + '  env: {A: "@V"}\n', "cluster.env.A"),
    (cluster(worker='    env: {B: "@V"}\n'), "cluster.workers[0].env.B"),
    (cluster(worker='    path: "/p@V"\n'), "cluster.workers[0].path"),
    (cluster(worker='    data_path: "/d@V"\n'), "cluster.workers[0].data_path"),
    (cluster(worker='    arch: "cu128@V"\n'), "cluster.workers[0].arch"),
    (
        cluster(worker='    ssh: {identity_file: "/k@V"}\n'),
        "cluster.workers[0].ssh.identity_file",
    ),
    (
        cluster(worker='    ssh: {options: ["ProxyJump=b@V"]}\n'),
        "cluster.workers[0].ssh.options[0]",
    ),
    (cluster(', path: "/c@V"'), "cluster.controller.path"),
    (
        cluster(', tls: {cert: "/c@V", key: /k}'),
        "cluster.controller.tls.cert",
    ),
    (join('  env: {A: "@V"}\n'), "join.env.A"),
    (join('  bin: "/b@V"\n'), "join.bin"),
    (join('  bin: /b\n  args: [ok, "x@V"]\n'), "join.args[1]"),
    (join('  data_path: "/d@V"\n'), "join.data_path"),
    (join('  data_path: /d\n  data_source: "rsync://h:/x@V"\n'), "join.data_source"),
    (join('  torch_sources: {cu126: "/w@V"}\n'), "join.torch_sources.cu126"),
    (join('  source: {from: "file:///t@V"}\n'), "join.source.from"),
    (join('  source: {from: file:///t, cwd: "p@V"}\n'), "join.source.cwd"),
    (join('  source: {from: file:///t, build: "make@V"}\n'), "join.source.build"),
    (join('  source: {from: file:///t, bin: "b@V"}\n'), "join.source.bin"),
    ('publish:\n  args: ["@V"]\n', "publish.args[0]"),
    *((f'publish:\n  {key}: "x@V"\n', f"publish.{key}") for key in ("bin", "cwd", "build", "to", "identity")),
    ('commands:\n  go: [python, "a@V"]\n', "commands.go[1]"),
    ('commands:\n  go: "python b@V"\n', "commands.go[1]"),
]


@pytest.mark.parametrize(("escape", "fragment"), [("\\0", "NUL byte"), ("\\ud800", "lone surrogate")])
@pytest.mark.parametrize(("template", "path"), FIELDS)
def test_text_no_process_can_take_is_refused_by_field(
    template: str, path: str, escape: str, fragment: str
) -> None:
    problems = problems_of(template.replace("@V", escape))
    assert [p.path for p in problems] == [path]
    assert fragment in problems[0].message and problems[0].hint and problems[0].line is not None


ENV_SCOPES = [
    (cluster() + "  env: {@K: x}\n", "cluster.env"),
    (cluster(worker="    env: {@K: x}\n"), "cluster.workers[0].env"),
    (join("  env: {@K: x}\n"), "join.env"),
]
BAD_NAMES = [
    ('"A\\0B"', "A\\x00B", "NUL byte"),
    ('"A=B"', "A=B", "holds `=`"),
    ('""', '""', "name is empty"),
]


@pytest.mark.parametrize(("key", "shown", "fragment"), BAD_NAMES)
@pytest.mark.parametrize(("template", "scope"), ENV_SCOPES)
def test_an_env_name_no_environment_can_hold_is_refused(
    template: str, scope: str, key: str, shown: str, fragment: str
) -> None:
    problems = problems_of(template.replace("@K", key))
    assert [p.path for p in problems] == [f"{scope}.{shown}"]
    assert fragment in problems[0].message


def test_names_and_services_ending_in_a_newline_are_refused() -> None:
    # `$` matches before a trailing newline: the rules hold for the whole text.
    worker = '    env: {"A\\n": x}\n    docker: "svc\\n"\n    nccl_socket_ifname: "eth0\\n"\n'
    paths = {p.path for p in problems_of(cluster(worker=worker))}
    assert paths == {
        "cluster.workers[0].env.A\\x0a",
        "cluster.workers[0].docker",
        "cluster.workers[0].nccl_socket_ifname",
    }


def test_passable_text_still_passes() -> None:
    config = load(
        cluster(worker='    env: {B: "two\\nlines\\tand \\u00e9"}\n')
        + '  env: {A: "x y", N: 2}\n'
        + 'join:\n  bin: /b\n  args: ["--lr=0.1", "\\u65e5\\u672c"]\n'
    )
    assert config.cluster is not None and config.cluster.env == {"A": "x y", "N": "2"}
    assert config.cluster.workers[0].env == {"B": "two\nlines\tand é"}
    assert config.join is not None and config.join.args == ["--lr=0.1", "日本"]


def test_config_check_refuses_a_nul_by_field_and_exits_1(tmp_path: Path) -> None:
    f = tmp_path / "fdl.cluster.yml"
    f.write_text(cluster() + '  env: {A: "x\\0y"}\n')
    result = CliRunner().invoke(cli.cli, ["config", "check", str(f)])
    assert result.exit_code == 1, result.output
    assert f"{f}:5: error: cluster.env.A: holds a NUL byte" in result.output
    assert "fix: remove it" in result.output and "internal error" not in result.output
