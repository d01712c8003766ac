"""The flodl.cluster collection's Python: GPU facts parsing and the filters."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
PLUGINS = ROOT / "collections" / "ansible_collections" / "flodl" / "cluster" / "plugins"


def load(relative: str) -> ModuleType:
    pytest.importorskip("ansible")
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_"), PLUGINS / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nvidia_smi_csv() -> None:
    facts = load("modules/gpu_facts.py")
    out = "0, NVIDIA A100-SXM4-80GB, 81920, 8.0\n1, NVIDIA GeForce RTX 4090, 24564, 8.9\n"
    gpus = facts.parse_nvidia(out)
    assert [(g["index"], g["arch"], g["memory_mib"]) for g in gpus] == [
        (0, "sm_80", 81920),
        (1, "sm_89", 24564),
    ]
    summary = facts.summarize(gpus)
    assert (summary["flodl_gpu_count"], summary["flodl_gpu_vendor"], summary["flodl_gpu_variant"]) == (
        2,
        "nvidia",
        "cu128",
    )


def test_rocm_smi_json() -> None:
    facts = load("modules/gpu_facts.py")
    out = json.dumps(
        {
            "card0": {
                "Card Series": "AMD Instinct MI300X",
                "GFX Version": "gfx942",
                "VRAM Total Memory (B)": "206141652992",
            },
            "system": {"Driver version": "6.8.5"},
        }
    )
    gpus = facts.parse_rocm(out)
    assert gpus == [
        {"index": 0, "vendor": "amd", "name": "AMD Instinct MI300X", "memory_mib": 196592, "arch": "gfx942"}
    ]
    assert facts.summarize(gpus, '{"system": {"Driver version": "6.4.1"}}')["flodl_gpu_variant"] == "rocm6.4"


def test_a_cpu_box_reports_nothing_and_no_vendor() -> None:
    facts = load("modules/gpu_facts.py")
    assert facts.parse_nvidia("") == [] and facts.parse_rocm("not json") == []
    assert facts.summarize([]) == {
        "flodl_gpus": [],
        "flodl_gpu_count": 0,
        "flodl_gpu_vendor": "",
        "flodl_gpu_variant": "cpu",
    }
    mixed = facts.summarize([{"vendor": "nvidia"}, {"vendor": "amd"}])
    assert mixed["flodl_gpu_vendor"] == "mixed" and mixed["flodl_gpu_variant"] == "cpu"


# The same tool outputs through the module's parsers and the package's (flodl_agent.hardware.gpus):
# the module keeps its own copy (it runs where the package is not installed).
NVIDIA_OUTPUTS = [
    "0, NVIDIA A100-SXM4-80GB, 81920, 8.0\n1, NVIDIA GeForce RTX 4090, 24564, 8.9\n",
    "0, NVIDIA H200, 143771, 9.0\n1, NVIDIA RTX PRO 6000 Blackwell, 97887, 12.0\n",
    "0, Tesla K80, Rev 2, [N/A], [N/A]\n",  # a comma in the name; a tool that cannot say
    "No devices were found\n",
    "",
]
ROCM_OUTPUTS = [
    json.dumps(
        {
            "card1": {"Card Series": "AMD Instinct MI210", "GFX Version": "gfx90a:sramecc+:xnack-"},
            "card0": {
                "Card Series": "AMD Instinct MI300X",
                "GFX Version": "gfx942",
                "VRAM Total Memory (B)": "206141652992",
            },
            "system": {"Driver version": "6.8.5"},
        }
    ),
    json.dumps({"card10": {"Card series": "b"}, "card9": {"Card model": "a", "GFX Version": "gfx1100"}}),
    "not json",
    "[]",
]


@pytest.mark.parametrize(
    ("vendor", "text"), [*(("nvidia", t) for t in NVIDIA_OUTPUTS), *(("amd", t) for t in ROCM_OUTPUTS)]
)
def test_the_module_and_the_package_read_gpus_alike(vendor: str, text: str) -> None:
    from flodl_agent.hardware import gpus

    facts = load("modules/gpu_facts.py")
    ours = gpus.parse_nvidia(text) if vendor == "nvidia" else gpus.parse_rocm(text)
    theirs = facts.parse_nvidia(text) if vendor == "nvidia" else facts.parse_rocm(text)
    assert theirs == [
        {"index": g.index, "vendor": g.vendor, "name": g.name, "memory_mib": g.memory_mib, "arch": g.arch}
        for g in ours
    ]
    assert all(g.arch == "" or g.arch.startswith(("sm_", "gfx")) for g in ours)
    # and both ask the tools the same questions
    assert [
        "nvidia-smi",
        f"--query-gpu={facts.NVIDIA_QUERY}",
        f"--format={facts.NVIDIA_FORMAT}",
    ] == gpus.NVIDIA_SMI
    assert ["rocm-smi", *facts.ROCM_QUERY] == gpus.ROCM_SMI


def test_cluster_workers_filter_reads_vars_then_facts() -> None:
    flt = load("filter/cluster.py")
    hostvars: dict[str, dict[str, Any]] = {
        "gpu-a": {
            "ansible_host": "10.0.0.11",
            "flodl_worker_local_devices": "all",
            "flodl_worker_libtorch": "cu128",
            "ansible_facts": {"default_ipv4": {"interface": "enp1s0"}, "flodl_gpu_count": 2},
        },
        "cpu-b": {
            "flodl_worker_local_devices": "cpu:4",
            "flodl_worker_nccl_socket_ifname": "eth1",
            "flodl_worker_data_path": "/flodl/data",
            "flodl_worker_env": {"X": "1"},
            "ansible_facts": {},
        },
    }
    workers = flt.cluster_workers(["gpu-a", "cpu-b"], hostvars)
    assert workers == [
        {
            "host": "gpu-a",
            "local_devices": [0, 1],
            "nccl_socket_ifname": "enp1s0",
            "arch": "cu128",
            "ssh": {"target": "10.0.0.11"},
        },
        {
            "host": "cpu-b",
            "local_devices": "cpu:4",
            "nccl_socket_ifname": "eth1",
            "arch": "cpu",
            "data_path": "/flodl/data",
            "env": {"X": "1"},
            "ssh": {"target": "cpu-b"},
        },
    ]
    # what the filter writes is a valid cluster file
    from flodl_agent.config import validate_data

    assert validate_data({"cluster": {"controller": {"host": "127.0.0.1"}, "workers": workers}}).cluster


@pytest.mark.skipif(shutil.which("systemd-escape") is None, reason="needs systemd-escape")
def test_mount_unit_names_match_systemd_escape() -> None:
    flt = load("filter/mount_unit.py")
    for path in ["/flodl/data", "/", "/mnt/my-data//set.v2/", "/srv/ü data", "/.hidden/x"]:
        want = subprocess.run(
            ["systemd-escape", "--path", "--suffix=mount", path], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert flt.mount_unit(path) == want, path
    with pytest.raises(ValueError, match="absolute"):
        flt.mount_unit("relative/path")


def test_the_host_key_filter_derives_what_the_controller_derives() -> None:
    from flodl_agent.protocol import wire

    derive = load("filter/host_key.py").host_key
    token = "00112233445566778899AABBCCDDEEFF"
    for host in ("w1", "node-b.example.com", "ünï"):
        assert derive(token, host) == wire.host_key(bytes.fromhex(token), host).hex()
    for token, host, message in (("abc", "w1", "not 32 hex"), ("ab" * 16, "", "no host name")):
        with pytest.raises(ValueError, match=message):
            derive(token, host)


def test_the_collection_carries_what_galaxy_publishes() -> None:
    """galaxy.yml, meta/runtime.yml and the changelog agree (`make collection` builds it)."""
    import yaml

    root = PLUGINS.parent
    galaxy = yaml.safe_load((root / "galaxy.yml").read_text())
    assert galaxy["repository"] and galaxy["tags"]
    assert yaml.safe_load((root / "meta" / "runtime.yml").read_text())["requires_ansible"].startswith(">=")
    releases = yaml.safe_load((root / "changelogs" / "changelog.yaml").read_text())["releases"]
    assert galaxy["version"] in releases, "a new collection version needs its changelogs/changelog.yaml entry"
    listed = {m["name"] for release in releases.values() for m in release.get("modules", [])}
    for release in releases.values():
        listed |= {p["name"] for kind in release.get("plugins", {}).values() for p in kind}
    # a filter file may hold several filters; a module or an inventory plugin is named after its file
    shipped = {p.stem for kind in ("modules", "inventory") for p in (PLUGINS / kind).glob("*.py")}
    assert shipped and shipped <= listed, f"not in changelogs/changelog.yaml: {shipped - listed}"


def test_each_torch_variant_installs_from_its_own_source_alone() -> None:
    plan = load("filter/torch_plan.py").torch_plan
    online = plan(
        ["cu126", "rocm6.4", "cpu"], {"rocm6.4": "/srv/rocm", "cpu": "http://mirror:8000/cpu/simple"}
    )
    assert online["cu126"]["pip_env"] == {"PIP_INDEX_URL": "https://download.pytorch.org/whl/cu126"}
    assert online["rocm6.4"]["wheelhouse"] == "/srv/rocm"
    assert online["rocm6.4"]["pip_env"] == {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "/opt/flodl/wheels/torch-rocm6.4",
    }
    assert online["cpu"]["pip_env"] == {
        "PIP_INDEX_URL": "http://mirror:8000/cpu/simple",
        "PIP_TRUSTED_HOST": "mirror",
    }
    assert online["cpu"]["box_source"] == "http://mirror:8000/cpu/simple"
    offline = plan(
        ["cpu", "cu128"], {"cu128": "/w/cu128"}, home="/h", wheelhouse=True, index="https://m/whl/"
    )
    assert offline["cpu"]["pip_env"] == {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/h/wheels"}
    assert offline["cu128"]["pip_env"]["PIP_FIND_LINKS"] == "/h/wheels/torch-cu128 /h/wheels"
    assert plan(["cu128"], index="https://m/whl/")["cu128"]["source"] == "https://m/whl/cu128"
    with pytest.raises(ValueError, match="not a torch variant"):
        plan(["cuda12"])
    with pytest.raises(ValueError, match="neither an http"):
        plan(["cpu"], {"cpu": "relative/dir"})


def test_the_worker_role_pins_the_torch_extras_range() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    role_vars = yaml.safe_load((ROOT / "roles" / "flodl_worker" / "vars" / "main.yml").read_text())
    assert [role_vars["flodl_worker_torch_requirement"]] == extra


def test_a_wheelhouse_digest_follows_names_sizes_and_times(tmp_path: Path) -> None:
    digest = load("filter/files_digest.py").files_digest
    a, b = tmp_path / "a.whl", tmp_path / "b.whl"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    first = digest([str(a), str(b)])
    assert digest([str(b), str(a)]) == first
    b.write_bytes(b"333")
    assert digest([str(a), str(b)]) != first
    assert digest([str(a)]) != digest([str(a), str(b)])


def test_the_validate_commands_catch_a_bad_unit_and_a_bad_key(tmp_path: Path) -> None:
    unit = load("filter/verify_unit.py").verify_unit
    keys = load("filter/verify_authorized_keys.py").verify_authorized_keys
    assert unit("flodl-data.mount").endswith("verify-unit %s flodl-data.mount")
    with pytest.raises(ValueError):
        unit("flodl-join")  # systemd reads the type from the suffix
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True)
    good = f'# managed\nrestrict,permitopen="127.0.0.1:1337" {(tmp_path / "k.pub").read_text()}'
    for text, ok in ((good, True), (good + "restrict ssh-ed25519 AAAAmangled\n", False), ("# none\n", True)):
        path = tmp_path / "authorized_keys"
        path.write_text(text)
        run = subprocess.run(shlex.split(keys("x") % path), capture_output=True, check=False)
        assert (run.returncode == 0) is ok, text


def test_the_role_and_join_default_to_the_same_variant_index() -> None:
    from flodl_agent.hardware.variants import default_source

    plan = load("filter/torch_plan.py").torch_plan(["cu126", "rocm6.4", "cpu"])
    assert {v: p["source"] for v, p in plan.items()} == {v: default_source(v) for v in plan}


def assembler() -> ModuleType:
    spec = importlib.util.spec_from_file_location("collection_script", ROOT / "scripts" / "collection.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_collection_is_assembled_from_the_top_level_roles_and_playbooks_and_drift_is_named(
    tmp_path: Path,
) -> None:
    script = assembler()
    tree = script.assemble(tmp_path)
    assert script.drift(tree) == []
    # The roles as the collection names them, whole but for their molecule scenarios.
    for repo_name, name in script.ROLES.items():
        source = {p.relative_to(ROOT / "roles" / repo_name) for p in (ROOT / "roles" / repo_name).rglob("*")
                  if p.is_file() and "molecule" not in p.parts and "__pycache__" not in p.parts}  # fmt: skip
        assert {
            p.relative_to(tree / "roles" / name) for p in (tree / "roles" / name).rglob("*") if p.is_file()
        } == source
    # Each file keeps its mode (a script the role copies stays executable).
    assert all((tree / inside).stat().st_mode == source.stat().st_mode for inside, source in script.sources())
    # Every playbook names the roles by the collection's names, and nothing else changed.
    for playbook in script.PLAYBOOKS:
        text = (tree / "playbooks" / playbook).read_text()
        refs = [
            line.strip() for line in text.splitlines() if re.search(r"\bflodl_(controller|worker)\s*$", line)
        ]
        assert refs == [], (playbook, refs)
    site = (tree / "playbooks" / "site.yml").read_text()
    assert "name: flodl.cluster.controller" in site and "- flodl.cluster.worker" in site
    assert (tree / "LICENSE").read_text().lstrip().startswith("Apache License")
    release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((tree / "galaxy.yml").read_text())["version"] == release  # one version for both
    # An edit in the assembled tree, a file no source has, a file gone: each is named.
    (tree / "roles" / "worker" / "defaults" / "main.yml").write_text("drifted: true\n")
    (tree / "roles" / "worker" / "stray.yml").write_text("")
    (tree / "playbooks" / "probe.yml").unlink()
    assert sorted(script.drift(tree)) == [
        "playbooks/probe.yml: missing",
        "roles/worker/defaults/main.yml: differs from roles/flodl_worker/defaults/main.yml",
        "roles/worker/stray.yml: comes from no source",
    ]


def test_role_references_are_rewritten_in_every_spelling_and_variables_are_not() -> None:
    script = assembler()
    text = """roles:
  - flodl_worker
  - role: flodl_controller   # the door
tasks:
  - ansible.builtin.include_role:
      name: flodl_controller
      tasks_from: token.yml
  - ansible.builtin.debug:
      var: flodl_controller_token
    when: flodl_worker_door_port | int > 0
"""
    assert (
        script.fqcn_roles(text)
        == """roles:
  - flodl.cluster.worker
  - role: flodl.cluster.controller   # the door
tasks:
  - ansible.builtin.include_role:
      name: flodl.cluster.controller
      tasks_from: token.yml
  - ansible.builtin.debug:
      var: flodl_controller_token
    when: flodl_worker_door_port | int > 0
"""
    )
