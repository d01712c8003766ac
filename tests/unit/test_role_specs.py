"""The roles' argument specs declare every role-prefixed variable the project reads.

A role's `meta/argument_specs.yml` is its interface: ansible checks it before the
role runs and the role's README is generated from it. Every `flodl_controller_*` /
`flodl_worker_*` name that the role's tasks, handlers, templates, defaults and vars
mention - and that the playbooks and the collection's plugins read from a host's
variables - must be declared there, unless the role makes it itself: derived values
in `vars/main.yml`, results it `register`s, facts it `set_fact`s.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import syntax

ROOT = Path(__file__).parents[2]
ROLES = ROOT / "roles"
PLUGINS = ROOT / "collections" / "ansible_collections" / "flodl" / "cluster" / "plugins"
ROLE_NAMES = sorted(p.name for p in ROLES.iterdir() if (p / "meta" / "argument_specs.yml").exists())
# What a role reads; meta/ is its description, not a reader.
ROLE_PARTS = ("tasks", "handlers", "templates", "defaults", "vars")
SET_FACT = {"set_fact", "ansible.builtin.set_fact", "ansible.legacy.set_fact"}


def names(text: str, role: str) -> set[str]:
    return set(re.findall(rf"\b{role}_[a-z0-9_]*[a-z0-9]\b", text))


def spec(role: str) -> dict[str, Any]:
    options: dict[str, Any] = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())[
        "argument_specs"
    ]["main"]["options"]
    return options


def defaults(role: str) -> dict[str, Any]:
    return yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text()) or {}


def tasks_in(node: Any) -> list[dict[str, Any]]:
    """Every task mapping of a tasks/handlers/playbook file, blocks and plays included."""
    found: list[dict[str, Any]] = []
    if isinstance(node, list):
        for item in node:
            found += tasks_in(item)
    elif isinstance(node, dict):
        found.append(node)
        for key in ("block", "rescue", "always", "tasks", "pre_tasks", "post_tasks", "handlers"):
            found += tasks_in(node.get(key))
    return found


def made_by(paths: list[Path]) -> set[str]:
    """The names these files make themselves: `register:` targets, `set_fact` keys, task vars."""
    made: set[str] = set()
    for path in paths:
        for task in tasks_in(yaml.safe_load(path.read_text())):
            if isinstance(task.get("register"), str):
                made.add(task["register"])
            if isinstance(task.get("vars"), dict):  # a task's own vars (an include's parameters)
                made |= set(task["vars"])
            for module in SET_FACT & task.keys():
                if isinstance(task[module], dict):
                    made |= {k for k in task[module] if k != "cacheable"}
    return made


def role_files(role: str) -> list[Path]:
    return sorted(p for part in ROLE_PARTS for p in (ROLES / role / part).rglob("*") if p.is_file())


def role_task_files(role: str) -> list[Path]:
    return sorted(p for part in ("tasks", "handlers") for p in (ROLES / role / part).glob("*.yml"))


def internal(role: str) -> set[str]:
    """What the role makes itself: vars/main.yml, registered results and set facts."""
    derived = yaml.safe_load((ROLES / role / "vars" / "main.yml").read_text()) or {}
    return set(derived) | made_by(role_task_files(role))


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_every_variable_the_role_reads_is_declared(role: str) -> None:
    read: dict[str, set[str]] = {}
    for path in role_files(role):
        for name in names(path.read_text(), role):
            read.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    declared, made = set(spec(role)), internal(role)
    undeclared = {name: sorted(where) for name, where in read.items() if name not in declared | made}
    assert not undeclared, f"{role}: read but not in meta/argument_specs.yml: {undeclared}"


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_the_spec_and_defaults_agree(role: str) -> None:
    options, values = spec(role), defaults(role)
    assert not set(values) - set(options), f"{role}: defaults not in the spec: {set(values) - set(options)}"
    for name, option in options.items():
        if option.get("required"):
            # A default would make `required` meaningless: the variable is always there.
            assert "default" not in option, f"{role}: {name} is required yet has a spec default"
            assert name not in values, f"{role}: {name} is required yet has a default in defaults/main.yml"
        elif "default" in option:
            assert name in values, f"{role}: {name} has a spec default but none in defaults/main.yml"
            assert option["default"] == values[name], f"{role}: {name}: spec default != defaults/main.yml"
    assert not set(options) & internal(role), f"{role}: declared but made by the role itself"


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_literal_defaults_pass_the_spec(role: str) -> None:
    pytest.importorskip("ansible")
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    options = {name: {k: v for k, v in o.items() if k != "required"} for name, o in spec(role).items()}
    literal = {k: v for k, v in defaults(role).items() if "{{" not in str(v)}
    result = ArgumentSpecValidator(options).validate(literal)
    assert not result.error_messages, f"{role}: {result.error_messages}"


def carried_only() -> set[str]:
    """The inventory plugin's CARRIED_ONLY: host variables it sets that no role reads yet
    (read from its source: the plugin imports ansible, which this test does not need)."""
    tree = syntax.parse(PLUGINS / "inventory" / "fdl_cluster.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "CARRIED_ONLY" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def test_what_the_playbooks_and_plugins_read_is_declared() -> None:
    """site.yml hands the controller's variables to the workers (hostvars), the controller
    role's filter reads the workers' (cluster_workers), and the inventory plugin sets both
    (less its CARRIED_ONLY facts, which no role reads yet)."""
    readers = [*sorted((ROOT / "playbooks").glob("*.yml")), ROOT / "site.yml"]
    plugins = sorted(PLUGINS.rglob("*.py"))
    made = made_by(readers) | set().union(*(internal(role) for role in ROLE_NAMES)) | carried_only()
    undeclared: dict[str, set[str]] = {}
    for path in readers + plugins:
        text = path.read_text()
        for role in ROLE_NAMES:
            for name in names(text, role) - set(spec(role)) - made:
                undeclared.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert not undeclared, f"read but not declared in any role's argument spec: {undeclared}"


def test_carried_only_facts_are_exactly_the_undeclared_ones() -> None:
    """Once a role declares a carried-only fact, it leaves the plugin's CARRIED_ONLY."""
    carried = carried_only()
    assert carried, "fdl_cluster.py has no CARRIED_ONLY"
    declared = set().union(*(set(spec(role)) for role in ROLE_NAMES))
    assert not carried & declared, f"declared by a role now; drop from CARRIED_ONLY: {carried & declared}"


def test_the_check_finds_an_undeclared_variable(tmp_path: Path) -> None:
    """The scan itself: a read name is caught, registered and set_fact names are not."""
    tasks = tmp_path / "main.yml"
    tasks.write_text(
        "- name: A\n  ansible.builtin.command: echo {{ flodl_worker_nope }}\n  register: flodl_worker_out\n"
        "- name: B\n  block:\n    - name: C\n      ansible.builtin.set_fact:\n"
        "        flodl_worker_fact: '{{ flodl_worker_out.stdout }}'\n"
    )
    assert names(tasks.read_text(), "flodl_worker") - made_by([tasks]) == {"flodl_worker_nope"}


def test_the_role_readmes_match_their_specs() -> None:
    """`make lint` runs `scripts/role_readme.py --check` too; this says which README drifted."""
    import importlib.util

    loader = importlib.util.spec_from_file_location("role_readme", ROOT / "scripts" / "role_readme.py")
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    stale = [r for r in ROLE_NAMES if (ROLES / r / "README.md").read_text() != module.render(ROLES / r)]
    assert not stale, f"README.md not its argument spec: {stale}; run python scripts/role_readme.py"
