"""The documented example inventory provisions the fleet it describes: site.yml's groups
hold its hosts, every play finds them, every variable is one a role declares, and the
values satisfy the roles' argument specs. Nothing connects to a host."""

from __future__ import annotations

import json
import os
import re
import subprocess
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl_agent.config import validate_data
from tests.support.ansible import plain

ROOT = Path(__file__).parents[2]
BIN = ROOT / ".venv" / "bin"
INVENTORY = ROOT / "inventories" / "example" / "hosts.yml"
SITE = ROOT / "playbooks" / "site.yml"
CHECK = ROOT / "tests" / "ansible" / "check_inventory.yml"
CONTROLLERS = ["ctrl.example.com"]
WORKERS = ["gpu-a.example.com", "gpu-b.example.com", "amd-a.example.com", "cloud-a.example.net"]

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists(), reason="ansible is not installed in .venv (make setup)"
)


def ansible(tool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run an ansible tool from the repository root with the project's ansible.cfg."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(BIN / tool), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def inventory(source: Path) -> dict[str, Any]:
    proc = ansible("ansible-inventory", "-i", source, "--list")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = plain(json.loads(proc.stdout))
    return data


def spec_options(role: str) -> set[str]:
    spec = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    return set(spec["argument_specs"]["main"]["options"])


def site_plays() -> dict[str, dict[str, Any]]:
    return {play["name"]: play for play in yaml.safe_load(SITE.read_text())}


def undeclared(source: Path) -> dict[str, list[str]]:
    """Per host, the variables the roles never read: not in the spec of the role the host
    runs, nor read by site.yml, or overridden by site.yml's play vars (so dead here)."""
    plays = site_plays()
    site_text = SITE.read_text()
    worker_ok = spec_options("flodl_worker") - set(plays["Workers"].get("vars", {}))
    controller_ok = (
        spec_options("flodl_controller")
        | set(re.findall(r"hostvars\[flodl_site_controller\]\.(\w+)", site_text))
    ) - set(plays["Controller, with the workers' keys in its door"].get("vars", {}))
    data = inventory(source)
    groups = {
        name: set(data.get(name, {}).get("hosts", [])) for name in ("flodl_controllers", "flodl_workers")
    }
    found: dict[str, list[str]] = {}
    for host, hostvars in data["_meta"]["hostvars"].items():
        allowed = (worker_ok if host in groups["flodl_workers"] else set()) | (
            controller_ok if host in groups["flodl_controllers"] else set()
        )
        bad = sorted(k for k in hostvars if not k.startswith("ansible_") and k not in allowed)
        if bad:
            found[host] = bad
    return found


def test_the_graph_has_site_yml_groups_with_the_fleet() -> None:
    proc = ansible("ansible-inventory", "-i", INVENTORY, "--graph")
    assert proc.returncode == 0, proc.stderr
    members: dict[str, list[str]] = {}
    group = ""
    for line in proc.stdout.splitlines():
        if m := re.search(r"@(\w+):$", line):
            group = m.group(1)
            members.setdefault(group, [])
        elif m := re.search(r"--(\S+)$", line):
            members[group].append(m.group(1))
    assert members["flodl_controllers"] == CONTROLLERS
    assert members["flodl_workers"] == WORKERS  # rank order
    site_groups = {g for play in site_plays().values() for g in play["hosts"].split(":")}
    site_groups |= set(re.findall(r"groups\['(\w+)'\]", SITE.read_text()))
    assert site_groups <= set(members), (
        f"site.yml names groups the example lacks: {site_groups - set(members)}"
    )
    assert not members.get("ungrouped")


def test_every_play_of_site_yml_lists_its_hosts() -> None:
    proc = ansible("ansible-playbook", "-i", INVENTORY, "site.yml", "--list-hosts")
    assert proc.returncode == 0, proc.stderr
    listed: dict[str, set[str]] = {}
    name = ""
    for line in proc.stdout.splitlines():
        if m := re.match(r"\s+play #\d+ \(.*?\): (.*?)\tTAGS", line):
            name = m.group(1)
            listed[name] = set()
        elif name and (m := re.match(r"\s{6}(\S+)$", line)):
            listed[name].add(m.group(1))
    members = {"flodl_controllers": set(CONTROLLERS), "flodl_workers": set(WORKERS)}
    expected = {
        name: set().union(*(members[g] for g in play["hosts"].split(":")))
        for name, play in site_plays().items()
    }
    assert listed == expected
    assert listed["Workers"] == set(WORKERS)
    assert listed["Controller, with the workers' keys in its door"] == set(CONTROLLERS)


def test_site_yml_passes_its_syntax_check() -> None:
    proc = ansible("ansible-playbook", "-i", INVENTORY, "site.yml", "--syntax-check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_variable_is_one_the_roles_read() -> None:
    assert undeclared(INVENTORY) == {}


def test_a_variable_no_role_reads_is_caught(tmp_path: Path) -> None:
    broken = tmp_path / "hosts.yml"
    broken.write_text(
        INVENTORY.read_text().replace(
            "flodl_worker_local_devices: [0, 1, 2, 3]", "flodl_worker_path: /opt/flodl"
        )
    )
    assert undeclared(broken) == {"gpu-a.example.com": ["flodl_worker_path"]}


def test_the_check_playbook_computes_what_site_yml_computes() -> None:
    site = site_plays()
    check = {play["name"]: play for play in yaml.safe_load(CHECK.read_text())}
    with_vars = {name for name, play in site.items() if play.get("vars")}
    assert with_vars <= set(check), f"site.yml plays with vars the check lacks: {with_vars - set(check)}"
    for name in with_vars:
        assert check[name]["vars"] == site[name]["vars"], f"{name}: the check's vars drifted from site.yml's"
        assert check[name]["hosts"] == site[name]["hosts"]


def test_the_values_satisfy_the_roles_argument_specs() -> None:
    proc = ansible("ansible-playbook", "-i", INVENTORY, CHECK)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recap = dict(re.findall(r"^(\S+)\s+: ok=(\d+)", proc.stdout, re.MULTILINE))
    assert set(recap) == set(CONTROLLERS + WORKERS)
    assert "failed=0" in proc.stdout and not re.search(r"failed=[1-9]", proc.stdout)


@pytest.mark.parametrize(
    ("before", "after", "named"),
    [
        ("flodl_worker_data_mount: true", "flodl_worker_data_mount: maybe", "flodl_worker_data_mount"),
        (
            "flodl_controller_door_mode: rrsync",
            "flodl_controller_door_mode: sftp",
            "flodl_controller_door_mode",
        ),
        ("flodl_controller_port: 1337", "flodl_controller_port: ctrl", "flodl_worker_controller_port"),
    ],
)
def test_a_wrong_value_fails_the_check(tmp_path: Path, before: str, after: str, named: str) -> None:
    text = INVENTORY.read_text()
    assert before in text
    broken = tmp_path / "hosts.yml"
    broken.write_text(text.replace(before, after))
    proc = ansible("ansible-playbook", "-i", broken, CHECK)
    assert proc.returncode != 0
    errors = " ".join(re.findall(r'"argument_errors": \[(.*?)\]', proc.stdout))
    assert named in errors, proc.stdout[-4000:]  # the spec's own words, naming the variable


def test_the_controller_renders_a_valid_cluster_file() -> None:
    """The roster the controller role renders from this inventory passes the schema."""
    spec = spec_from_file_location(
        "flodl_cluster_filter",
        ROOT / "collections/ansible_collections/flodl/cluster/plugins/filter/cluster.py",
    )
    assert spec and spec.loader
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    data = inventory(INVENTORY)
    hostvars = data["_meta"]["hostvars"]
    ctrl = hostvars[data["flodl_controllers"]["hosts"][0]]
    controller = {
        "host": ctrl.get("flodl_controller_bind", "127.0.0.1"),
        "port": ctrl.get("flodl_controller_port", 1337),
        "path": ctrl.get("flodl_controller_home", "/opt/flodl"),
    }
    if ctrl.get("flodl_controller_join"):
        controller["join"] = ctrl["flodl_controller_join"]
    workers = module.cluster_workers(data["flodl_workers"]["hosts"], hostvars)
    validate_data({"cluster": {"controller": controller, "workers": workers}})
    assert [w["arch"] for w in workers] == ["cu128", "cu128", "rocm6.4", "cu128"]
