"""Every validation rule of the cluster schema: the field it blames, the line,
the message and the fix."""

from __future__ import annotations

import pytest

from flodl_agent.config import ConfigError, Problem, validate_data, warnings_for
from tests.support import load, problems_of


def only(problems: list[Problem], path: str) -> Problem:
    found = [p for p in problems if p.path == path]
    assert found, f"no problem at {path}; got {[p.path for p in problems]}"
    return found[0]


def test_two_worker_fixture_is_valid(two_workers: str) -> None:
    assert problems_of(two_workers) == []


def test_nccl_socket_ifname_required_on_every_worker_when_spanning_hosts(two_workers: str) -> None:
    text = two_workers.replace("      nccl_socket_ifname: eth0\n", "", 1)
    problems = problems_of(text)
    p = only(problems, "cluster.workers[0].nccl_socket_ifname")
    assert "spans hosts (2 workers)" in p.message
    assert p.hint and "eth0" in p.hint
    assert p.line == 5  # the worker entry that lacks it
    assert len(problems) == 1


def test_single_worker_needs_no_interface() -> None:
    assert (
        problems_of(
            """
            cluster:
              controller: {host: 127.0.0.1}
              workers: [{host: solo, local_devices: [0]}]
            """
        )
        == []
    )


@pytest.mark.parametrize(
    "key",
    [
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "FLODL_INTERNAL_AGENT_JSON",
        "FLODL_INTERNAL_ANYTHING",
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
    ],
)
@pytest.mark.parametrize("scope", ["cluster", "worker"])
def test_reserved_env_keys_are_refused(key: str, scope: str) -> None:
    env_block = f"env:\n    {key}: '1'\n    NCCL_DEBUG: INFO"
    if scope == "cluster":
        text = f"cluster:\n  controller: {{host: h}}\n  workers: [{{host: a}}]\n  {env_block}\n"
        path = f"cluster.env.{key}"
        line = 5
    else:
        text = f"cluster:\n  controller: {{host: h}}\n  workers:\n  - host: a\n    env:\n      {key}: '1'\n"
        path = f"cluster.workers[0].env.{key}"
        line = 6
    p = only(problems_of(text), path)
    assert "reserved" in p.message and p.line == line
    assert p.hint and "drop it" in p.hint


def test_all_reserved_keys_in_one_block_are_reported_together() -> None:
    problems = problems_of(
        """
        cluster:
          controller: {host: h}
          workers: [{host: a}]
          env: {CUDA_VISIBLE_DEVICES: "0", FLODL_INTERNAL_X: "1", "bad-name": "2"}
        """
    )
    assert {p.path for p in problems} == {
        "cluster.env.CUDA_VISIBLE_DEVICES",
        "cluster.env.FLODL_INTERNAL_X",
        "cluster.env.bad-name",
    }


def test_numeric_env_values_become_strings_but_booleans_are_refused() -> None:
    config = load(
        """
        cluster:
          controller: {host: h}
          workers: [{host: a, env: {NCCL_SOCKET_NTHREADS: 2, RATIO: 0.5}}]
        """
    )
    assert config.cluster is not None
    assert config.cluster.workers[0].env == {"NCCL_SOCKET_NTHREADS": "2", "RATIO": "0.5"}
    p = only(
        problems_of("cluster:\n  controller: {host: h}\n  workers: [{host: a}]\n  env: {NCCL_DEBUG: yes}\n"),
        "cluster.env.NCCL_DEBUG",
    )
    assert "expected a string" in p.message


JOIN = (
    "cluster:\n  controller:\n    host: h\n    join:\n{knobs}"
    "  workers: [{{host: a, local_devices: [0, 1, 2, 3]}}]\n"
)


def join_problems(**knobs: object) -> list[Problem]:
    lines = "".join(f"      {k}: {v}\n" for k, v in knobs.items())
    return problems_of(JOIN.format(knobs=lines))


@pytest.mark.parametrize(
    ("knobs", "path", "fragment"),
    [
        ({"token": "abc"}, "token", "32 hex characters (got 3"),
        ({"token": "g" * 32}, "token", "32 hex characters"),
        ({"token": "a" * 32, "open_admission": "true"}, "open_admission", "contradicts `token`"),
        ({"start": "manual", "target_ranks": 2}, "target_ranks", "refused under `start: manual`"),
        ({"min_rank_start": 3, "target_ranks": 2}, "target_ranks", "below min_rank_start (3)"),
        ({"join_timeout": 300, "max_join_timeout": 200}, "max_join_timeout", "below join_timeout (300s)"),
        ({"join_timeout": 900}, "max_join_timeout", "below join_timeout (900s)"),
        ({"discovery": "true"}, "min_rank_start", "required under `discovery: true`"),
        ({"tunnel_only": "true"}, "tunnel_only", "only applies under `discovery: true`"),
        ({"min_rank_start": 0}, "min_rank_start", "greater than or equal to 1"),
        ({"join_timeout": 0}, "join_timeout", "greater than 0"),
        ({"start": "manul"}, "start", "`manul` is not one of auto, manual, hybrid"),
    ],
)
def test_join_window_rules(knobs: dict[str, object], path: str, fragment: str) -> None:
    problems = join_problems(**knobs)
    p = only(problems, f"cluster.controller.join.{path}")
    assert fragment in p.message
    assert p.hint
    assert p.line is not None and p.line >= 4


@pytest.mark.parametrize(
    "knobs",
    [
        {"token": "0123456789abcdef0123456789ABCDEF"},
        {"start": "hybrid", "target_ranks": 4, "min_rank_start": 2},
        {"start": "manual", "min_rank_start": 2, "max_join_timeout": 3600},
        {"discovery": "true", "min_rank_start": 1, "tunnel_only": "true"},
        {"join_timeout": 600, "max_join_timeout": 600},
    ],
)
def test_join_window_valid_combinations(knobs: dict[str, object]) -> None:
    assert join_problems(**knobs) == []


def test_token_is_normalized_to_lowercase() -> None:
    config = load(JOIN.format(knobs="      token: 0123456789ABCDEF0123456789ABCDEF\n"))
    assert config.cluster is not None
    assert config.cluster.controller.join.token == "0123456789abcdef0123456789abcdef"


def test_did_you_mean_suggests_the_closest_key(two_workers: str) -> None:
    p = only(
        problems_of(two_workers.replace("local_devices: cpu:2", "local_device: cpu:2")),
        "cluster.workers[1].local_device",
    )
    assert p.message == "unknown key `local_device`" and p.hint == "did you mean `local_devices`?"
    assert p.line == 9


def test_unknown_key_without_a_close_match_lists_the_allowed_keys() -> None:
    p = only(
        problems_of("cluster:\n  controller: {host: h, zebra: 1}\n  workers: [{host: a}]\n"),
        "cluster.controller.zebra",
    )
    assert p.hint is not None and p.hint.startswith("allowed keys here: host, port, path")


@pytest.mark.parametrize(
    ("where", "key", "replacement"),
    [
        ("cluster", "master_addr", "cluster.controller.host"),
        ("cluster", "master_port", "cluster.controller.port"),
        ("worker", "ssh_user", "ssh.user"),
        ("worker", "ssh_port", "ssh.port"),
        ("worker", "ssh_key", "ssh.identity_file"),
    ],
)
def test_legacy_keys_are_reported_as_stale(where: str, key: str, replacement: str) -> None:
    if where == "cluster":
        text = f"cluster:\n  {key}: x\n  controller: {{host: h}}\n  workers: [{{host: a}}]\n"
        path = f"cluster.{key}"
    else:
        text = f"cluster:\n  controller: {{host: h}}\n  workers:\n    - host: a\n      {key}: x\n"
        path = f"cluster.workers[0].{key}"
    p = only(problems_of(text), path)
    assert "stale key" in p.message and p.hint == f"use `{replacement}` instead"


def test_gpu_ram_share_must_be_positive_and_may_exceed_one() -> None:
    base = (
        "cluster:\n  controller: {host: h}\n  gpu_ram_share: %s\n  workers: [{host: a, gpu_ram_share: %s}]\n"
    )
    assert problems_of(base % (0.5, 1.25)) == []
    assert problems_of(base % (1, 2)) == []  # whole numbers are numbers too
    problems = problems_of(base % (0, -0.5))
    assert {p.path for p in problems} == {"cluster.gpu_ram_share", "cluster.workers[0].gpu_ram_share"}
    assert all("must be positive" in p.message for p in problems)


PLANE = """
cluster:
  controller:
    host: h
    join: {discovery: true, min_rank_start: 1, tunnel_only: %s}
  plane: %s
  workers:
    - host: a
      tunnel: %s
      local_devices: %s
"""


@pytest.mark.parametrize(
    ("tunnel_only", "tunnel", "devices", "path", "line", "fragment"),
    [
        ("false", "true", "[0]", "cluster.workers[0].tunnel", 9, "a tunnel carries only the CPU plane"),
        (
            "true",
            "false",
            "[0]",
            "cluster.controller.join.tunnel_only",
            5,
            "admits through the ssh door alone",
        ),
        ("false", "false", "cpu:2", "cluster.workers[0].local_devices", 10, "offers CPU ranks (cpu:2)"),
    ],
)
def test_an_nccl_plane_refuses_what_cannot_carry_it(
    tunnel_only: str, tunnel: str, devices: str, path: str, line: int, fragment: str
) -> None:
    problems = problems_of(PLANE % (tunnel_only, "nccl", tunnel, devices))
    p = only(problems, path)
    assert len(problems) == 1 and fragment in p.message and p.line == line
    assert p.hint and "a CPU mode (plane: cpu, or fdl launch --plane cpu)" in p.hint
    # the CPU plane carries all of it (unset is cpu)
    assert problems_of(PLANE % (tunnel_only, "cpu", tunnel, devices)) == []
    assert problems_of((PLANE % (tunnel_only, "cpu", tunnel, devices)).replace("  plane: cpu\n", "")) == []


def test_an_nccl_plane_with_every_mistake_reports_each_and_a_bad_plane_is_named() -> None:
    problems = problems_of(PLANE % ("true", "nccl", "true", "cpu:1"))
    assert {p.path for p in problems} == {
        "cluster.controller.join.tunnel_only",
        "cluster.workers[0].tunnel",
        "cluster.workers[0].local_devices",
    }
    assert problems_of(PLANE % ("false", "nccl", "false", "all")) == []
    p = only(problems_of(PLANE % ("false", "gloo", "false", "all")), "cluster.plane")
    assert "gloo" in p.message


def test_join_args_need_an_entry_point() -> None:
    p = only(problems_of("join:\n  args: [--model, resnet]\n", "fdl.yml"), "join.args")
    assert "none is named" in p.message and p.line == 2
    assert p.hint and "join.bin" in p.hint
    assert problems_of("join:\n  bin: train.py\n  args: [--model, resnet]\n", "fdl.yml") == []
    assert problems_of("join:\n  source: {from: 'file:///t'}\n  args: [--x]\n", "fdl.yml") == []


def test_worker_host_names_are_unique(two_workers: str) -> None:
    p = only(problems_of(two_workers.replace("node-b", "node-a")), "cluster.workers[1].host")
    assert "already cluster.workers[0].host" in p.message and p.line == 8


def test_empty_roster_needs_discovery() -> None:
    p = only(problems_of("cluster:\n  controller: {host: h}\n"), "cluster.workers")
    assert "discovery" in (p.hint or "")
    ok = "cluster:\n  controller:\n    host: 127.0.0.1\n    join: {discovery: true, min_rank_start: 2}\n"
    assert problems_of(ok) == []


@pytest.mark.parametrize(
    ("devices", "fragment"),
    [
        ("[]", "offers no device"),
        ("[0, 0]", "device 0 is listed twice"),
        ("[-1]", "is not a GPU index"),
        ("cpu:0", "needs a CPU rank count"),
        ("gpu", "is not a device offer"),
        ("{a: 1}", "is not a device offer"),
        ("cpu:1025", "offers 1025 devices: a box offers at most 1024"),
        ("cpu:100000", "offers 100000 devices: a box offers at most 1024"),
        ("cpu:" + "9" * 5000, "needs a CPU rank count"),  # not a 5000-digit int()
        ("'cpu:²'", "needs a CPU rank count"),
        ("[1024]", "is not a GPU index"),
        ("'" + ",".join(map(str, range(1025))) + "'", "offers 1025 devices"),
        ("''", "is empty"),
    ],
)
def test_bad_device_offers(devices: str, fragment: str) -> None:
    p = only(
        problems_of(
            f"cluster:\n  controller: {{host: h}}\n  workers: [{{host: a, local_devices: {devices}}}]\n"
        ),
        "cluster.workers[0].local_devices",
    )
    assert fragment in p.message


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("port", "70000", "less than or equal to 65535"),
        ("port", "'1337'", "expected a whole number"),
        ("path", "opt/flodl", "is not an absolute path"),
        ("arch", "/abs/cu128", "is not a variant sub-path"),
        ("arch", "../cu128", "is not a variant sub-path"),
        ("host", "'a b'", "is neither an IP address nor a host name"),
        ("host", "http://10.0.0.1", "is not a host: drop the `http://`"),
        ("host", "10.0.0.1:1337", "carries brackets or a port"),
        ("host", "a" * 254, "is 254 characters long: a host name has at most 253"),
    ],
)
def test_controller_field_checks(field: str, value: str, fragment: str) -> None:
    text = f"cluster:\n  controller:\n    host: h\n    {field}: {value}\n  workers: [{{host: a}}]\n"
    if field == "host":
        text = f"cluster:\n  controller:\n    host: {value}\n  workers: [{{host: a}}]\n"
    p = only(problems_of(text), f"cluster.controller.{field}")
    assert fragment in p.message and p.line == (3 if field == "host" else 4)


@pytest.mark.parametrize("field", ["join_timeout", "max_join_timeout"])
def test_window_seconds_are_capped_at_a_year(field: str) -> None:
    """A 400-digit timeout once reached asyncio's clock and overflowed there (exit 70)."""
    join = f"    join:\n      {field}: {'9' * 400}\n"
    text = f"cluster:\n  controller:\n    host: h\n{join}  workers: [{{host: a}}]\n"
    p = only(problems_of(text), f"cluster.controller.join.{field}")
    assert "less than or equal to 31536000" in p.message and p.line == 5


def test_missing_required_field_names_the_fix() -> None:
    p = only(
        problems_of("cluster:\n  controller: {port: 1}\n  workers: [{host: a}]\n"), "cluster.controller.host"
    )
    assert p.message == "is required" and p.hint is not None and p.hint.startswith("add `host:`")
    assert p.line == 2


@pytest.mark.parametrize("ifname", ["eth0", "enp1s0", "^lo,docker0", "=eth0", "eth0,eth1", "bond0.100"])
def test_nccl_interface_spellings(ifname: str) -> None:
    assert (
        problems_of(
            f"cluster:\n  controller: {{host: h}}\n  workers: [{{host: a, nccl_socket_ifname: '{ifname}'}}]\n"
        )
        == []
    )


@pytest.mark.parametrize("ifname", ["", "eth 0", "waytoolonginterfacename", "^"])
def test_bad_nccl_interface_names(ifname: str) -> None:
    p = only(
        problems_of(
            f"cluster:\n  controller: {{host: h}}\n  workers: [{{host: a, nccl_socket_ifname: '{ifname}'}}]\n"
        ),
        "cluster.workers[0].nccl_socket_ifname",
    )
    assert "not a network interface name" in p.message


def test_ssh_block_and_options() -> None:
    config = load(
        """
        cluster:
          controller: {host: h}
          workers:
            - host: a
              ssh: {target: a.example, port: 2222, user: ubuntu, identity_file: ~/.ssh/k,
                    options: [ProxyJump=bastion, "ServerAliveInterval 15"]}
        """
    )
    assert config.cluster is not None
    ssh = config.cluster.workers[0].ssh
    assert ssh is not None and ssh.port == 2222 and ssh.options[1] == "ServerAliveInterval 15"
    p = only(
        problems_of("cluster:\n  controller: {host: h}\n  workers: [{host: a, ssh: {options: ['-v']}}]\n"),
        "cluster.workers[0].ssh.options[0]",
    )
    assert "not an ssh option" in p.message


def test_errors_from_code_carry_paths_but_no_lines() -> None:
    with pytest.raises(ConfigError) as caught:
        validate_data({"cluster": {"controller": {"host": "h", "port": 0}, "workers": [{"host": "a"}]}})
    (p,) = caught.value.problems
    assert p.path == "cluster.controller.port" and p.line is None and p.file is None


def test_several_problems_are_reported_in_one_pass(two_workers: str) -> None:
    text = two_workers.replace("host: 10.0.0.1", "host: 10.0.0.1\n    port: 0").replace("cpu:2", "cpu:x")
    assert {p.path for p in problems_of(text)} == {
        "cluster.controller.port",
        "cluster.workers[1].local_devices",
    }


@pytest.mark.parametrize(
    "option",
    [
        "StrictHostKeyChecking=no",
        "StrictHostKeyChecking no",
        "stricthostkeychecking=No",
        "UserKnownHostsFile=/dev/null",
    ],
)
def test_disabling_host_key_pinning_is_warned_about_in_every_spelling(option: str) -> None:
    config = load(
        f"cluster:\n  controller: {{host: h}}\n  workers: [{{host: a, ssh: {{options: ['{option}']}}}}]\n"
    )
    (warning,) = warnings_for(config)
    assert warning.path == "cluster.workers[0].ssh.options[0]" and "host key pinning" in warning.message
    assert (
        warnings_for(
            load(
                "cluster:\n  controller: {host: h}\n  workers: [{host: a, ssh: {options: "
                "['StrictHostKeyChecking=yes']}}]\n"
            )
        )
        == []
    )


@pytest.mark.parametrize(
    ("host", "fragment"),
    [
        ("'a b'", "no spaces, `/`, `\\`, `:` or `@`"),
        ("../../etc", "no spaces, `/`, `\\`, `:` or `@`"),
        ("'a\\b'", "no spaces, `/`, `\\`, `:` or `@`"),
        ("a" * 254, "is 254 characters long: a host name has at most 253"),
        ('"ev\\u202eil"', "holds \\u202e, a control, bidi or invisible character"),
        ('"box\\x9b31m"', "holds \\x9b"),
        ("-oProxyCommand=x", "starts with `-`"),
        ("''", "is empty"),
    ],
)
def test_host_names_follow_one_rule_in_the_roster_and_the_join_block(host: str, fragment: str) -> None:
    roster = (
        f"cluster:\n  controller: {{host: 127.0.0.1}}\n  workers: [{{host: {host}, local_devices: [0]}}]\n"
    )
    assert fragment in only(problems_of(roster), "cluster.workers[0].host").message
    assert fragment in only(problems_of(f"join:\n  host: {host}\n"), "join.host").message


def test_a_253_character_host_name_is_a_host_name() -> None:
    assert problems_of(f"join:\n  host: {'a' * 253}\n") == []


DISCOVERY = "    join: {discovery: true, min_rank_start: 1%s}\n"


@pytest.mark.parametrize("bind", ["10.0.0.1", "0.0.0.0", "ctrl.example.com", "::"])
def test_a_network_discovery_window_nobody_can_enter_is_an_error(bind: str) -> None:
    text = f"cluster:\n  controller:\n    host: '{bind}'\n" + DISCOVERY % ""
    p = only(problems_of(text), "cluster.controller.join.discovery")
    assert p.severity == "error" and "admits no walk-in" in p.message and "no roster" in p.message
    assert p.hint and "token" in p.hint and "tunnel_only" in p.hint and "open_admission" in p.hint


def test_with_a_roster_only_the_walk_ins_are_locked_out_a_warning() -> None:
    text = (
        "cluster:\n  controller:\n    host: 10.0.0.1\n"
        + DISCOVERY % ""
        + "  workers: [{host: a, local_devices: [0]}]\n"
    )
    (warning,) = warnings_for(load(text))
    assert warning.path == "cluster.controller.join.discovery" and warning.severity == "warning"
    assert "only the 1 fanned-out worker(s) can join" in warning.message


@pytest.mark.parametrize(
    ("bind", "knob"),
    [
        ("127.0.0.1", ""),  # loopback: open admission by construction
        ("10.0.0.1", ", token: " + "ab" * 16),
        ("10.0.0.1", ", open_admission: true"),
        ("10.0.0.1", ", tunnel_only: true"),  # binds loopback at launch
    ],
)
def test_walk_ins_that_can_verify_are_no_problem(bind: str, knob: str) -> None:
    text = f"cluster:\n  controller:\n    host: {bind}\n" + DISCOVERY % knob
    assert [p for p in problems_of(text) if p.path.endswith("discovery")] == []
    assert [w for w in warnings_for(load(text)) if w.path.endswith("discovery")] == []


def test_problems_never_print_what_a_terminal_acts_on() -> None:
    (p,) = problems_of('join:\n  "ev\\u202eil\\x9b": 1\n')
    assert all(line.isprintable() for line in p.render().splitlines())
    assert "\\u202e" in p.render() and "\u202e" not in p.render()


@pytest.mark.parametrize(
    ("elastic", "path", "fragment"),
    [
        ("{max_ranks: 0}", "elastic.max_ranks", "greater than or equal to 1"),
        ("{planes: [cpu]}", "elastic.max_ranks", "is required"),
        ("{max_ranks: 8, planes: [gpu]}", "elastic.planes[0]", "`gpu` is not one of cpu, nccl"),
        ("{max_ranks: 8, planes: []}", "elastic.planes", "is empty: no plane would grow"),
        ("{max_ranks: 8, planes: [cpu, nccl, cpu]}", "elastic.planes", "names cpu twice"),
        ("{max_ranks: 8, planes: cpu}", "elastic.planes", "expected a list"),
        ("{max_ranks: 8, plane: [cpu]}", "elastic.plane", "unknown key `plane`"),
    ],
)
def test_an_elastic_block_that_cannot_work_names_its_field(elastic: str, path: str, fragment: str) -> None:
    p = only(join_problems(elastic=elastic), f"cluster.controller.join.{path}")
    assert fragment in p.message and p.hint
    assert p.line is not None and p.line >= 4


@pytest.mark.parametrize(
    ("knobs", "floor"),
    [
        ({"target_ranks": 4, "min_rank_start": 2}, "target_ranks (4)"),
        ({"min_rank_start": 3}, "min_rank_start (3)"),
    ],
)
def test_an_elastic_ceiling_below_the_world_the_window_forms_is_refused(
    knobs: dict[str, object], floor: str
) -> None:
    p = only(join_problems(**knobs, elastic="{max_ranks: 2}"), "cluster.controller.join.elastic.max_ranks")
    assert p.message == f"(2) is below {floor}: the ceiling would be below the world the window forms"
    name, value = floor.split()
    assert p.hint == f"set elastic.max_ranks to at least {value.strip('()')}, or lower {name}"


def test_a_valid_elastic_block_loads_with_cpu_as_its_default_plane() -> None:
    assert (
        join_problems(target_ranks=4, min_rank_start=2, elastic="{max_ranks: 4, planes: [nccl, cpu]}") == []
    )
    config = load(JOIN.format(knobs="      target_ranks: 3\n      elastic: {max_ranks: 16}\n"))
    assert config.cluster is not None
    elastic = config.cluster.controller.join.elastic
    assert elastic is not None and (elastic.max_ranks, elastic.planes) == (16, ["cpu"])
    frozen = load(JOIN.format(knobs="      target_ranks: 3\n"))
    assert frozen.cluster is not None and frozen.cluster.controller.join.elastic is None
