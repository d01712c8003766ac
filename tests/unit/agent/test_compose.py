"""The compose plan from facts: which tool, which files, the override, the argv, the
environment file, the names, the exit code, podman-compose 1.0.3's repair."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePath
from typing import Any

import pytest
import yaml

from flodl_agent.agent.compose import (
    ENTRY,
    PROVIDERS,
    Container,
    compose_files,
    container_command,
    container_env,
    container_name,
    env_script,
    exit_code,
    override,
    providers,
    repair_podman_args,
    run_argv,
    services_in,
    stop_argv,
)

DOCKER, DOCKER_COMPOSE, PODMAN_COMPOSE, PODMAN = PROVIDERS
PROJECT = PurePath("/srv/proj")


def box(**facts: Any) -> Container:
    return Container(
        **{"service": "train", "name": "flodl-r0", "workdir": "/srv/proj", "user": "1000:1000", **facts}
    )


def test_the_tools_are_tried_in_a_documented_order_or_the_one_named() -> None:
    assert [p.name for p in providers(None)] == [
        "docker compose",
        "docker-compose",
        "podman-compose",
        "podman compose",
    ]
    assert providers(" podman-compose ") == (PODMAN_COMPOSE,)
    with pytest.raises(ValueError, match="FLODL_COMPOSE='compose' names no compose tool"):
        providers("compose")


@pytest.mark.parametrize(
    ("env", "present", "found"),
    [
        ({}, {"/srv/proj/compose.yaml"}, ["/srv/proj/compose.yaml"]),
        # docker compose's order, and the override beside the file it picked
        (
            {},
            {"/srv/proj/docker-compose.yml", "/srv/proj/compose.yml", "/srv/proj/compose.override.yml"},
            ["/srv/proj/compose.yml", "/srv/proj/compose.override.yml"],
        ),
        ({}, {"/srv/compose.yaml"}, ["/srv/compose.yaml"]),  # the nearest parent that has one
        ({}, set(), []),
        # COMPOSE_FILE: relative to the working directory, on its separator
        ({"COMPOSE_FILE": "a.yml:/etc/b.yml"}, set(), ["/srv/proj/a.yml", "/etc/b.yml"]),
        (
            {"COMPOSE_FILE": "a.yml;b.yml", "COMPOSE_PATH_SEPARATOR": ";"},
            set(),
            ["/srv/proj/a.yml", "/srv/proj/b.yml"],
        ),
    ],
)
def test_the_project_files_are_found_as_docker_compose_finds_them(
    env: dict[str, str], present: set[str], found: list[str]
) -> None:
    files = compose_files(PROJECT, env, lambda p: str(p) in present)
    assert [str(f) for f in files] == found


def test_services_are_read_from_every_file() -> None:
    docs = [{"services": {"train": {}, "db": None}}, {"services": {"cuda": {}}}, None, {"version": "3"}]
    assert services_in(docs) == {"train", "db", "cuda"}


def test_the_override_puts_a_cpu_rank_on_the_hosts_network_as_the_agents_user() -> None:
    plan = override(DOCKER, box(mounts=(("/dev/shm/flodl-plane-x", False), ("/data", True))))
    assert plan == {
        "services": {
            "train": {
                "init": True,  # a rank as PID 1 would ignore SIGTERM
                "user": "1000:1000",
                "working_dir": "/srv/proj",
                "volumes": [
                    "/srv/proj:/srv/proj",
                    "/dev/shm/flodl-plane-x:/dev/shm/flodl-plane-x",
                    "/data:/data:ro",
                ],
                "labels": {},
                "network_mode": "host",
            }
        }
    }


@pytest.mark.parametrize(
    ("provider", "gpu", "groups", "expected"),
    [
        (
            DOCKER,
            "nvidia",
            (),
            {
                "deploy": {
                    "resources": {
                        "reservations": {
                            "devices": [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
                        }
                    }
                },
                "ipc": "host",
            },
        ),
        (PODMAN, "nvidia", (), {"devices": ["nvidia.com/gpu=all"], "ipc": "host"}),  # CDI
        (PODMAN_COMPOSE, "nvidia", (), {"devices": ["nvidia.com/gpu=all"]}),  # ipc: on its argv
        (
            DOCKER_COMPOSE,
            "amd",
            (44, 105),
            {"devices": ["/dev/kfd", "/dev/dri"], "ipc": "host", "group_add": ["44", "105"]},
        ),
        (PODMAN_COMPOSE, "amd", (44, 105), {"devices": ["/dev/kfd", "/dev/dri"]}),
        (DOCKER, "", (), {}),
    ],
)
def test_gpus_reach_the_container_the_way_each_tool_spells_it(
    provider: Any, gpu: str, groups: tuple[int, ...], expected: dict[str, Any]
) -> None:
    service = override(provider, box(gpu=gpu, groups=groups))["services"]["train"]
    keys = ("deploy", "devices", "ipc", "group_add")
    assert {k: service[k] for k in keys if k in service} == expected


def test_the_override_refuses_to_mount_the_root_and_mounts_a_path_once() -> None:
    with pytest.raises(ValueError, match="cannot mount /"):
        override(DOCKER, box(workdir="/"))
    plan = override(DOCKER, box(mounts=(("/srv/proj", True), ("/d", True))))
    assert plan["services"]["train"]["volumes"] == ["/srv/proj:/srv/proj", "/d:/d:ro"]
    assert "network_mode" not in override(DOCKER, box(host_network=False))["services"]["train"]


def test_the_run_argv_names_the_container_and_carries_no_environment_value() -> None:
    files = [PurePath("/srv/proj/compose.yaml")]
    argv = run_argv(DOCKER, files, "/run/o.yml", box(), "/run/env-0", ["python3", "train.py"])
    assert argv == [
        "docker", "compose", "-f", "/srv/proj/compose.yaml", "-f", "/run/o.yml",
        "run", "-T", "--no-deps", "--name", "flodl-r0", "train",
        "sh", "-c", ENTRY, "/run/env-0", "python3", "train.py",
    ]  # fmt: skip


def test_podman_compose_gets_the_shim_and_the_run_args_it_cannot_read_from_a_file() -> None:
    amd = box(gpu="amd", groups=(44,))
    argv = run_argv(PODMAN_COMPOSE, ["c.yml"], "o.yml", amd, "env", ["x"], podman_shim="/run/podman")
    assert argv[:4] == [
        "podman-compose",
        "--podman-path",
        "/run/podman",
        "--podman-run-args=--ipc=host --group-add=44",
    ]
    # Without the host's network there is no bug to repair, and nothing to add for a CPU build.
    gate = run_argv(PODMAN_COMPOSE, ["c.yml"], "o.yml", box(host_network=False), "env", ["x"], "/run/podman")
    assert gate[:3] == ["podman-compose", "-f", "c.yml"]


def test_the_environment_file_round_trips_through_sh(tmp_path: Path) -> None:
    env = {"PLAIN": "1", "ODD": "a=b $HOME `id` 'q' \"d\" \\ \nsecond line", "EMPTY": ""}
    script = tmp_path / "env"
    script.write_text(env_script(env))
    dump = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('PLAIN', 'ODD', 'EMPTY')}))"
    out = subprocess.run(
        ["sh", "-c", ENTRY, str(script), "python3", "-c", dump],
        capture_output=True,
        text=True,
        check=True,
        env={},
    )
    assert yaml.safe_load(out.stdout) == env
    with pytest.raises(ValueError, match="`A-B` is not an environment variable name"):
        env_script({"A-B": "x"})


def test_inside_the_container_the_image_keeps_its_path_and_its_python() -> None:
    env = {"PATH": "/venv/bin:/usr/bin", "RANK": "0"}
    assert container_env(env, {}) == {"RANK": "0"}
    assert container_env(env, {"PATH": "/venv/bin:/usr/bin"}) == env  # an env: entry set it
    assert container_command(["/venv/bin/python", "train.py"], "/venv/bin/python") == ["python3", "train.py"]
    assert container_command(["torchrun", "x"], "/venv/bin/python") == ["torchrun", "x"]


def test_container_names_are_per_launch_attempt_and_rank() -> None:
    assert container_name("c0ffee01", "ab12cd", 3) == "flodl-c0ffee01-ab12cd-r3"
    assert container_name("", "ab12cd", 0) == "flodl-ab12cd-r0"
    assert container_name("a b/c", "t", "build") == "flodl-a-b-c-t-rbuild"


@pytest.mark.parametrize(
    ("inspected", "client", "code"),
    [
        ("exited 3\n", 0, 3),  # podman-compose 1.0.3's run exits 0 whatever the rank did
        ("exited 0", 0, 0),
        ("exited 137", 137, 137),
        ("created 0", 0, 125),  # it never ran: never a success
        (None, 0, 125),
        (None, 1, 1),
    ],
)
def test_the_exit_code_is_the_containers_own(inspected: str | None, client: int, code: int) -> None:
    assert exit_code(inspected, client) == code


def test_a_stop_gives_at_least_a_second_of_grace() -> None:
    assert stop_argv("podman", ["a", "b"], 5.0) == ["podman", "stop", "-t", "5", "a", "b"]
    assert stop_argv("docker", ["a"], 0.2)[3] == "1"


HOST_RUN = ["run", "--name=x", "--network", "host", "-v", "a:a"]
DEFAULT_NET = ["--net", "p_default", "--network-alias", "train"]
TAIL = ["-u", "0:0", "img", "sh", "--net", "n", "--network-alias", "m"]  # the rank's own args stay


@pytest.mark.parametrize(
    ("args", "repaired"),
    [
        (HOST_RUN + DEFAULT_NET + TAIL, HOST_RUN + TAIL),
        (["run", *DEFAULT_NET, "img"], ["run", *DEFAULT_NET, "img"]),  # no host network: it stays
        (["network", "exists", "p_default"], None),  # unused under host networking: none is made
        (["--version"], ["--version"]),
    ],
)
def test_the_podman_shim_repairs_podman_compose_1_0_3s_host_network(
    args: list[str], repaired: list[str] | None
) -> None:
    assert repair_podman_args(args) == repaired
