"""fdl deploy over ansible-runner: a real ansible-playbook run against two local hosts
(connection local), one of which fails; progress, recap, artifacts and the exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ansible_runner")
FDL = Path(sys.executable).with_name("fdl")
pytestmark = pytest.mark.skipif(
    shutil.which("ansible-playbook", path=str(FDL.parent)) is None, reason="ansible is not in this venv"
)

PLAY = """
- name: A small play
  hosts: all
  gather_facts: false
  tasks:
    - name: Write a marker
      ansible.builtin.copy:
        dest: "{{ out }}/{{ inventory_hostname }}"
        content: "{{ greeting | default('hello') }}\\n"
        mode: "0644"
    - name: Fail on the odd host
      ansible.builtin.fail:
        msg: "{{ inventory_hostname }} is the odd one"
      when: inventory_hostname == 'host-b'
"""


def project(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "project"
    (root / "playbooks").mkdir(parents=True)
    (root / "ansible.cfg").write_text("[defaults]\ninventory = hosts.yml\nretry_files_enabled = False\n")
    (root / "hosts.yml").write_text(
        "all:\n  vars:\n    ansible_connection: local\n    ansible_python_interpreter: "
        f"{sys.executable}\n  hosts:\n    host-a:\n    host-b:\n"
    )
    (root / "playbooks" / "small.yml").write_text(PLAY)
    return root, root / "playbooks" / "small.yml"


def fdl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FDL), "deploy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
        check=False,
    )


def test_a_deploy_reports_each_host_keeps_its_events_and_exits_with_the_play(tmp_path: Path) -> None:
    root, playbook = project(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    run = fdl(str(playbook), "-e", f"out={out}", "-e", "greeting=hi", cwd=root)
    assert run.returncode == 2, run.stderr  # ansible-playbook's code for a failed host
    assert (out / "host-a").read_text() == "hi\n"  # the extra variables reached the play
    lines = run.stdout.splitlines()
    assert any(line.startswith("changed") and "host-a" in line and "Write a marker" in line for line in lines)
    assert any(line.startswith("failed") and "host-b" in line for line in lines)
    assert "host-b is the odd one" in run.stdout
    assert "failed (ansible-playbook exited 2)" in run.stdout

    again = fdl(
        str(playbook), "-e", f"out={out}", "-e", "greeting=hi", "--limit", "host-a", "--json", cwd=root
    )
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["ok"] and report["recap"] == {
        "host-a": {"ok": 1, "changed": 0, "failures": 0, "dark": 0, "skipped": 1, "rescued": 0, "ignored": 0}
    }
    events = sorted(Path(report["artifacts"], "job_events").glob("*.json"))
    kinds = {json.loads(e.read_text())["event"] for e in events}
    assert {"playbook_on_start", "runner_on_ok", "playbook_on_stats"} <= kinds
    assert Path(report["artifacts"]).is_relative_to(root / "build" / "deploy")


def test_a_missing_playbook_or_inventory_is_named(tmp_path: Path) -> None:
    root, playbook = project(tmp_path)
    missing = fdl("nope.yml", cwd=root)
    assert missing.returncode == 2 and "no playbook at nope.yml" in missing.stderr
    bad = fdl(str(playbook), "-i", "absent.yml", cwd=root)
    assert bad.returncode == 2 and "no inventory at absent.yml" in bad.stderr
    extra = fdl(str(playbook), "-e", "not an assignment", cwd=root)
    assert extra.returncode == 2 and "is not KEY=VALUE" in extra.stderr


def installed_collection(tmp_path: Path) -> Path:
    """The flodl.cluster collection as the wheel's build assembles it, in a collections path."""
    script = Path(__file__).parents[2] / "scripts" / "collection.py"
    done = subprocess.run(
        [sys.executable, str(script), "assemble", str(tmp_path / "collections")], check=False
    )
    assert done.returncode == 0
    return tmp_path / "collections"


def test_away_from_a_checkout_deploy_runs_the_installed_collections_playbooks_by_name(tmp_path: Path) -> None:
    away = tmp_path / "ops"
    away.mkdir()
    (away / "hosts.yml").write_text("all:\n  hosts:\n    elsewhere:\n")  # no flodl groups: nothing to do
    env = {**os.environ, "NO_COLOR": "1", "HOME": str(tmp_path / "home")}
    bare = subprocess.run([str(FDL), "deploy", "-i", "hosts.yml"], cwd=away, env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert bare.returncode == 2
    assert "no playbook at site.yml, and no installed flodl.cluster collection has it" in bare.stderr
    assert "pip install 'flodl-fleet[ansible]' carries it" in bare.stderr
    env["ANSIBLE_COLLECTIONS_PATH"] = str(installed_collection(tmp_path))
    for argv in (["-i", "hosts.yml"], ["flodl.cluster.probe", "-i", "hosts.yml", "--json"]):
        ran = subprocess.run([str(FDL), "deploy", *argv], cwd=away, env=env, capture_output=True,
                             text=True, timeout=300, check=False)  # fmt: skip
        assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    assert report["recap"] == {} and Path(report["artifacts"]).is_relative_to(tmp_path / "home" / ".flodl")
    events = [json.loads(p.read_text()) for p in Path(report["artifacts"], "job_events").glob("*.json")]
    assert any(e.get("event_data", {}).get("playbook", "").endswith("flodl/cluster/playbooks/probe.yml")
               for e in events)  # fmt: skip
    unknown = subprocess.run([str(FDL), "deploy", "flodl.cluster.nope", "-i", "hosts.yml"], cwd=away, env=env,
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert unknown.returncode == 2 and "no playbook at flodl.cluster.nope" in unknown.stderr
