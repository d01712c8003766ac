"""What site.yml gives each box to walk in with, by a real ansible-playbook run on local
hosts (connection local; the config directory in a temporary place): the controller's
token tasks (the inventory's token, else one generated once and kept) and the worker
role's join block, which carries the key derived for the box's own name, never the token."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl_agent.agent.spec import AgentSpec
from flodl_agent.cli.options import JoinFlags, resolve_join
from flodl_agent.config import Join
from flodl_agent.protocol import wire

ROOT = Path(__file__).parents[2]
BIN = ROOT / ".venv" / "bin"
TOKEN = "00112233445566778899aabbccddeeff"

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists(), reason="ansible is not installed in .venv (make setup)"
)

# The token tasks as site.yml runs them on the controller, then each worker's join block as the
# worker role renders it (its defaults, in the inventory, and derived vars, with the vars site.yml
# passes).
PLAYBOOK = """
- name: The run's join token, on the controller
  hosts: ctrl
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: flodl_controller
        tasks_from: token.yml
- name: Each worker's join block
  hosts: workers
  gather_facts: false
  vars_files:
    - {roles}/flodl_worker/vars/main.yml
  vars:
    flodl_worker_controller: 10.0.0.1
    flodl_worker_token: "{{{{ hostvars['ctrl'].flodl_controller_token | default('') }}}}"
  tasks:
    - ansible.builtin.copy:
        content: "{{{{ {{'join': flodl_worker_join}} | to_nice_yaml }}}}"
        dest: "{out}/{{{{ inventory_hostname }}}}.fdl.yml"
        mode: "0600"
      no_log: true
"""


def provision(tmp_path: Path, controller: dict[str, Any], workers: dict[str, dict[str, Any]]) -> str:
    """Run the play; the output, and each worker's fdl.yml under tmp_path/out."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    # The worker role's defaults as the group's vars: below host vars, as role defaults are.
    defaults = yaml.safe_load((ROOT / "roles" / "flodl_worker" / "defaults" / "main.yml").read_text())
    inventory = {
        "all": {
            "vars": local | defaults,
            "hosts": {"ctrl": {"flodl_controller_config_dir": str(tmp_path / "etc"), **controller}},
            "children": {"workers": {"hosts": workers}},
        }
    }
    (tmp_path / "hosts.yml").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(PLAYBOOK.format(roles=ROOT / "roles", out=out))
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


def join_block(tmp_path: Path, host: str) -> dict[str, Any]:
    block: dict[str, Any] = yaml.safe_load((tmp_path / "out" / f"{host}.fdl.yml").read_text())["join"]
    return block


def dials_with(block: dict[str, Any]) -> bytes | None:
    """The key `fdl join` on that box dials with."""
    return resolve_join(JoinFlags(), AgentSpec(), Join.model_validate(block), "hostname").key


def test_a_generated_token_is_kept_and_each_worker_gets_its_own_names_key_alone(tmp_path: Path) -> None:
    workers = {"w1": {}, "w2": {}, "golden": {"flodl_worker_host_name": ""}}
    output = provision(tmp_path, {}, workers)
    kept = tmp_path / "etc" / "join.token"
    token = kept.read_text().strip()
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and len(token) == 32
    assert token not in output  # never printed
    run_key = bytes.fromhex(token)
    for host in ("w1", "w2"):
        block = join_block(tmp_path, host)
        assert block["host"] == host and "token" not in block
        assert bytes.fromhex(block["host_key"]) == wire.host_key(run_key, host) == dials_with(block)
    assert join_block(tmp_path, "w1")["host_key"] != join_block(tmp_path, "w2")["host_key"]
    # a box that names itself (a golden image) carries the shared token
    golden = join_block(tmp_path, "golden")
    assert golden["token"] == token and "host_key" not in golden and "host" not in golden
    # the next converge keeps the token, so every box's key stays what it was
    provision(tmp_path, {}, workers)
    assert kept.read_text().strip() == token
    assert bytes.fromhex(join_block(tmp_path, "w1")["host_key"]) == wire.host_key(run_key, "w1")


@pytest.mark.parametrize(
    ("controller", "key"),
    [
        ({"flodl_controller_join": {"token": TOKEN.upper()}}, TOKEN),  # the inventory's token wins
        ({"flodl_controller_join": {"open_admission": True}}, None),  # a token would contradict it
        ({"flodl_controller_token_generate": False}, None),  # open behind the door: names self-declared
    ],
    ids=["inventory-token", "open-admission", "no-generation"],
)
def test_what_the_inventory_says_of_the_token(
    tmp_path: Path, controller: dict[str, Any], key: str | None
) -> None:
    provision(tmp_path, controller, {"w1": {}})
    assert not (tmp_path / "etc" / "join.token").exists()
    block = join_block(tmp_path, "w1")
    assert "token" not in block
    if key is None:
        assert "host_key" not in block and dials_with(block) is None
    else:
        assert bytes.fromhex(block["host_key"]) == wire.host_key(bytes.fromhex(key), "w1")
