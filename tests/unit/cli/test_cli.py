"""The fdl command line: exit codes, streams, --json, and no tracebacks."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from flodl_agent import __version__
from flodl_agent.cli import common
from flodl_agent.cli import main as cli

cli_main = importlib.import_module("flodl_agent.cli.main")  # the package's `main` is the entry point

DATA = Path(__file__).parents[2] / "data"
SEED = DATA / "seed-000.fdl.cluster.yml"


def run(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli.cli, list(args), catch_exceptions=False)


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # fdl's own commands load on first use
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            found += all_commands(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


def test_a_command_loads_only_its_own_module_and_every_listed_one_is_there() -> None:
    # `fdl status` in a fresh interpreter: the controller and the agent stay unloaded
    probe = (
        "import sys; from click.testing import CliRunner; from flodl_agent.cli.main import cli; "
        "r = CliRunner().invoke(cli, ['status', '--help']); assert r.exit_code == 0, r.output; "
        "print(sorted(m for m in sys.modules if m.startswith('flodl_agent.')))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "flodl_agent.cli.status" in loaded
    assert "flodl_agent.controller.controller" not in loaded and "flodl_agent.agent.agent'" not in loaded
    group = cli.cli
    ctx = click.Context(group)
    for name, (module, _) in cli_main.COMMANDS.items():
        command = group.get_command(ctx, name)
        assert command is not None and command.name == name
        assert command.callback is None or command.callback.__module__ == f"flodl_agent.cli.{module}", name


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


@pytest.mark.parametrize("command", all_commands(cli.cli), ids=" ".join)
def test_every_command_has_help(command: tuple[str, ...]) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0 and "Usage: " in result.output


def test_check_valid_file_with_a_warning_on_stderr() -> None:
    result = run("config", "check", str(SEED))
    assert result.exit_code == 0
    assert result.stdout.startswith("ok: ") and "2 workers" in result.stdout
    assert "warning: cluster.workers[1].ssh.options[1]" in result.stderr
    assert f"{SEED}:32:" in result.stderr


def test_check_invalid_file_exits_1_naming_field_line_and_fix(tmp_path: Path) -> None:
    bad = tmp_path / "fdl.cluster.yml"
    bad.write_text(SEED.read_text().replace("nccl_socket_ifname: enp1s0", "nccl_socket_ifnam: enp1s0"))
    result = run("config", "check", str(bad))
    assert result.exit_code == 1 and result.stdout == ""
    assert f"{bad}:35: error: cluster.workers[1].nccl_socket_ifnam: unknown key" in result.stderr
    assert "fix: did you mean `nccl_socket_ifname`?" in result.stderr


def test_check_json(tmp_path: Path) -> None:
    ok = json.loads(run("config", "check", "--json", str(SEED)).stdout)
    assert ok["valid"] is True and ok["errors"] == [] and ok["warnings"][0]["line"] == 32
    bad = tmp_path / "bad.yml"
    bad.write_text("cluster:\n  controller: {host: h, port: 0}\n  workers: [{host: a}]\n")
    result = run("config", "check", "--json", str(bad))
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False
    (error,) = report["errors"]
    assert (error["path"], error["line"], error["file"]) == ("cluster.controller.port", 2, str(bad))


def test_check_with_base_overlays(tmp_path: Path) -> None:
    base = tmp_path / "fdl.yml"
    base.write_text("cluster:\n  env: {NCCL_DEBUG: INFO}\n")
    top = tmp_path / "fdl.cluster.yml"
    top.write_text("cluster:\n  controller: {host: h}\n  workers: [{host: a}]\n")
    result = run("config", "show", "--json", "--base", str(base), str(top))
    assert result.exit_code == 0
    assert json.loads(result.stdout)["config"]["cluster"]["env"] == {"NCCL_DEBUG": "INFO"}


def test_show_json_has_capacity_ranks_and_window_and_hides_the_token(tmp_path: Path) -> None:
    f = tmp_path / "c.yml"
    f.write_text(
        "cluster:\n  controller:\n    host: h\n"
        "    join: {token: 0123456789abcdef0123456789abcdef, min_rank_start: 2}\n"
        "  workers:\n    - {host: a, local_devices: [0, 1], nccl_socket_ifname: eth0}\n"
        "    - {host: b, local_devices: cpu:3, nccl_socket_ifname: eth0}\n"
    )
    result = run("config", "show", "--json", str(f))
    assert result.exit_code == 0
    shown = json.loads(result.stdout)
    assert shown["capacity"] == 5
    assert [(w["host"], w["ranks"]) for w in shown["workers"]] == [("a", [0, 2]), ("b", [2, 5])]
    assert shown["window"] == {
        "quorum": 2,
        "target": 5,
        "join_timeout": 300,
        "max_join_timeout": 600,
        "start": "auto",
    }
    assert shown["config"]["cluster"]["controller"]["join"]["token"] == "<redacted>"
    assert "0123456789abcdef" not in result.output
    table = run("config", "show", str(f))
    assert table.exit_code == 0 and "2\u20134" in table.stdout and "0123456789abcdef" not in table.output


def test_schema_is_json_schema_that_accepts_the_examples_and_rejects_typos() -> None:
    schema = json.loads(run("config", "schema").stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in (SEED, DATA / "seed-000.fdl.yml"):
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == []
    typo = yaml.safe_load(SEED.read_text().replace("local_devices: all", "local_device: all"))
    assert any("local_device" in e.message for e in validator.iter_errors(typo))
    bad_devices = {
        "cluster": {"controller": {"host": "h"}, "workers": [{"host": "a", "local_devices": "gpu"}]}
    }
    assert list(validator.iter_errors(bad_devices))


@pytest.mark.parametrize("name", ["lab", "reference"])
def test_examples_print_files_that_check(tmp_path: Path, name: str) -> None:
    f = tmp_path / f"{name}.yml"
    f.write_text(run("config", "example", name).stdout)
    result = run("config", "check", str(f))
    assert result.exit_code == 0 and result.stderr == ""


def test_the_project_example_is_an_fdl_yml_the_lab_cluster_file_lays_over(tmp_path: Path) -> None:
    base, top = tmp_path / "fdl.yml", tmp_path / "fdl.cluster.yml"
    base.write_text(run("config", "example", "project").stdout)
    top.write_text(run("config", "example", "lab").stdout)
    alone = run("config", "check", str(base))
    assert alone.exit_code == 0 and "join block, publish block" in alone.stdout
    laid = run("config", "check", "--base", str(base), str(top))  # the README's overlay command
    assert laid.exit_code == 0 and "cluster with 2 workers, 3 ranks, join block, publish block" in laid.stdout


def test_unexpected_errors_are_reported_not_dumped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def explode(*_: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(common, "load_config", explode)
    monkeypatch.setattr(sys, "argv", ["fdl", "config", "check", str(SEED)])
    monkeypatch.delenv("FDL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 70
    captured = capsys.readouterr()
    assert "internal error: RuntimeError: boom" in captured.err and "Traceback" not in captured.err


@pytest.mark.skipif(shutil.which("fdl") is None, reason="console script not on PATH")
@pytest.mark.parametrize(
    ("content", "code"),
    [(b"cluster: [", 1), (b"\xff\xfe", 1), (b"- a\n- b\n", 1), (b"cluster:\n  controller: 7\n", 1)],
)
def test_installed_console_script_never_prints_a_traceback(tmp_path: Path, content: bytes, code: int) -> None:
    f = tmp_path / "f.yml"
    f.write_bytes(content)
    proc = subprocess.run(["fdl", "config", "check", str(f)], capture_output=True, text=True, check=False)
    assert proc.returncode == code
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr


def test_usage_errors_exit_2() -> None:
    result = CliRunner().invoke(cli.cli, ["config", "check"])
    assert result.exit_code == 2 and "Missing argument 'FILE'" in result.output


def test_show_without_a_cluster_block_prints_the_blocks(tmp_path: Path) -> None:
    f = tmp_path / "fdl.yml"
    f.write_text("join:\n  persist: true\n  token: 0123456789abcdef0123456789abcdef\n")
    for args in ((), ("--json",)):
        result = run("config", "show", *args, str(f))
        assert result.exit_code == 0, result.output
        assert '"persist": true' in result.stdout and "<redacted>" in result.stdout
        assert "0123456789abcdef" not in result.output
    # a provisioned worker's own key is as secret
    f.write_text(f"join:\n  host: w1\n  host_key: {'ab' * 16}\n")
    result = run("config", "show", "--json", str(f))
    assert result.exit_code == 0 and "abab" not in result.output, result.output
    assert '"host_key": "<redacted>"' in result.stdout


def test_project_file_is_the_flag_else_fdl_yml_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert common.project_file() is None
    assert common.project_file(Path("other.yml")) == Path("other.yml")
    (tmp_path / "fdl.yml").write_text("{}\n")
    assert common.project_file() == Path("fdl.yml")
    assert common.project_file(Path("other.yml")) == Path("other.yml")


def test_the_default_project_file_is_spelled_once() -> None:
    package = Path(common.__file__).parent
    spelled = [p.name for p in package.glob("*.py") for _ in range(p.read_text().count('"fdl.yml"'))]
    assert spelled == ["common.py"]


@pytest.mark.parametrize(
    "argv, typo, meant",
    [
        (
            ["launch", "--config", "x.yml", "--max-failur", "1", "--", "python", "train.py"],
            "--max-failur",
            "--max-failure",
        ),
        (["launch", "--prot", "1", "python", "train.py"], "--prot", "--port"),
        (["join", "127.0.0.1:1337", "--devcies", "cpu:1"], "--devcies", "--devices"),
        (["join", "127.0.0.1:1337", "--devices", "cpu:1", "--hots", "w1"], "--hots", "--host"),
    ],
)
def test_a_typo_before_the_command_is_a_usage_error_not_part_of_a_run(
    argv: list[str], typo: str, meant: str
) -> None:
    result = CliRunner().invoke(cli.cli, argv)
    assert result.exit_code == 2
    assert f"No such option '{typo}'" in result.output and f"Did you mean '{meant}'" in result.output


def test_options_after_the_command_or_after_dashes_are_the_run_s() -> None:
    ctx = cli.cli.make_context("fdl", ["launch", "--port", "0", "python", "train.py", "--lr", "1"])
    launch = ctx.command.get_command(ctx, "launch")  # type: ignore[attr-defined]
    sub = launch.make_context("launch", ["--port", "0", "python", "train.py", "--lr", "1"])
    assert sub.params["command"] == ("python", "train.py", "--lr", "1") and sub.params["port"] == 0
    join = ctx.command.get_command(ctx, "join")  # type: ignore[attr-defined]
    sub = join.make_context("join", ["127.0.0.1:1", "--devices", "cpu:1", "--", "--lr", "1"])
    assert sub.meta["tail"] == ["--lr", "1"] and sub.params["devices"] == "cpu:1"
    # what follows `--` is the entry's arguments, never the ADDRESS (which fdl.yml may supply)
    sub = join.make_context("join", ["--bin", "train.py", "--", "10.0.0.1:1", "--lr"])
    assert sub.params["address"] is None and sub.meta["tail"] == ["10.0.0.1:1", "--lr"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["join", "127.0.0.1:1", "--host", "a b"], "Invalid value for --host: `a b` is not a host name"),
        (["join", "127.0.0.1:1", "--host", ""], "Invalid value for --host: is empty"),
        (["join", "127.0.0.1:1", "--devices", "cpu:1025"], "a box offers at most 1024"),
        (["join", "127.0.0.1:1", "--devices", ""], "Invalid value for --devices: is empty"),
        (["join", "http://127.0.0.1:1337"], "drop the `http://`"),
        (["join", "fd00::1"], "an IPv6 address goes in brackets"),
        (["status", "--addr", "http://127.0.0.1:1337"], "Invalid value for --addr"),
        (["start", "--addr", "fd00::1:1337"], "Invalid value for --addr"),
        (["launch", "--bind", "a b", "--", "python3"], "Invalid value for --bind"),
        (["tls", "generate", "--cert", "c", "--key", "k", "--name", "a b"], "Invalid value for --name"),
        (["@", "x" * 5000, "train"], "is 5000 characters long"),
    ],
)
def test_input_that_cannot_work_is_a_usage_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./fdl.yml; and nothing is dialled: each is refused first
    result = CliRunner().invoke(cli.cli, argv, input="")
    assert result.exit_code == 2, result.output
    assert said in result.output and "Traceback" not in result.output


def test_token_dash_with_empty_stdin_is_refused_not_read_as_no_token() -> None:
    result = CliRunner().invoke(cli.cli, ["start", "--addr", "127.0.0.1:1", "--token", "-"], input="")
    assert result.exit_code == 2 and "--token - read no token" in result.output


def test_a_network_discovery_window_nobody_can_enter_fails_check_and_launch(tmp_path: Path) -> None:
    local = run("config", "example", "local").stdout
    network = tmp_path / "net.yml"
    network.write_text(local.replace("host: 127.0.0.1", "host: 0.0.0.0"))
    checked = run("config", "check", str(network))
    assert checked.exit_code == 1 and "admits no walk-in" in checked.stderr
    launched = CliRunner().invoke(cli.cli, ["launch", "--config", str(network), "--", "true"])
    assert launched.exit_code == 1 and "admits no walk-in" in launched.stderr
    # the file is fine on loopback; --bind moves the window where nobody can enter
    (tmp_path / "lo.yml").write_text(local)
    moved = CliRunner().invoke(
        cli.cli, ["launch", "--config", str(tmp_path / "lo.yml"), "--bind", "0.0.0.0", "--", "true"]
    )
    assert moved.exit_code == 1 and "--bind 0.0.0.0 admits no walk-in" in moved.stderr


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["libtorch", "acquire", "cpu", "--source"], "--source"),
        (["probe", "--capture"], "--capture"),
        (["probe", "--capture", "x.tar.gz"], "--capture"),
    ],
)
def test_a_path_too_long_for_the_file_system_is_a_usage_error_naming_the_flag(
    argv: list[str], flag: str
) -> None:
    # found by the hostile-input suite: Path.is_dir raises ENAMETOOLONG rather than say no
    long = "x" * 3000
    args = [*argv[:-1], long + argv[-1]] if argv[-1].endswith(".tar.gz") else [*argv, long]
    result = CliRunner().invoke(cli.cli, args)
    assert result.exit_code == 2, result.output[-500:]
    assert flag in result.output and "internal error" not in result.output


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0", "0 is not in the range 1<=x<=1000000"),
        ("1000001", "1000001 is not in the range"),
        ("x", "'x' is not a valid integer"),
    ],
)
def test_an_elastic_ceiling_that_cannot_work_is_a_usage_error_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    monkeypatch.chdir(tmp_path)  # no cluster file: the flag is refused before any is read
    result = CliRunner().invoke(cli.cli, ["launch", "--elastic", value, "--", "true"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--elastic'" in result.output and said in result.output
    assert "Traceback" not in result.output


def test_the_elastic_flag_reaches_the_launch_and_is_unset_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "local.yml"
    f.write_text(run("config", "example", "local").stdout)
    seen: list[object] = []
    monkeypatch.setattr(
        "flodl_agent.cli.launch.launch_loaded", lambda _l, _f, options, _j=False: seen.append(options.elastic)
    )
    for argv in (["--elastic", "6"], []):
        result = CliRunner().invoke(cli.cli, ["launch", "--config", str(f), *argv, "--", "true"])
        assert result.exit_code == 0, result.output
    assert seen == [6, None]


def test_a_launch_flag_below_the_file_s_window_fails_naming_flag_and_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def went_on(*_: object) -> None:
        raise AssertionError("the launch went on past its settings")  # no journal, no port opened

    monkeypatch.setattr("flodl_agent.fleet.launcher._journal", went_on)
    f = tmp_path / "local.yml"
    f.write_text(run("config", "example", "local").stdout)  # target_ranks: 4
    result = CliRunner().invoke(cli.cli, ["launch", "--config", str(f), "--elastic", "3", "--", "true"])
    assert result.exit_code == 1, result.output
    assert "--elastic 3 is below cluster.controller.join.target_ranks (4)" in result.stderr
    assert "fix: pass --elastic 4 or more" in result.stderr


def test_the_schema_holds_an_elastic_block_to_the_file_s_rules() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(run("config", "schema").stdout))

    def doc(elastic: object) -> object:
        return {
            "cluster": {"controller": {"host": "h", "join": {"elastic": elastic}}, "workers": [{"host": "a"}]}
        }

    assert list(validator.iter_errors(doc({"max_ranks": 4, "planes": ["cpu", "nccl"]}))) == []
    for bad in ({"planes": ["cpu"]}, {"max_ranks": 0}, {"max_ranks": 4, "planes": []}):
        assert list(validator.iter_errors(doc(bad))), bad
    assert list(validator.iter_errors(doc({"max_ranks": 4, "planes": ["cpu", "cpu"]})))
