"""The package's layering: pure cores import no IO, imports form no cycle, modules stay small.

Each core is imported in a fresh interpreter, so what another test imported
cannot hide (or fake) a dependency.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flodl_agent"
ROOT = PACKAGE.parent
MAX_LINES = 520

IO_MODULES = frozenset({"asyncio", "ssl", "subprocess", "socket", "torch", "ray"})
# pydantic's plugin loader imports importlib.metadata when the first model class
# is built, and importlib.metadata imports email.utils, which imports socket:
# unavoidable for a core that defines pydantic models. Nothing else is let through.
PYDANTIC = IO_MODULES - {"socket"}

PURE_CORES: dict[str, frozenset[str]] = {
    "flodl_agent.errors": IO_MODULES,
    "flodl_agent.address": IO_MODULES,
    "flodl_agent.names": IO_MODULES,
    "flodl_agent.pin": IO_MODULES,
    "flodl_agent.credentials": IO_MODULES,
    "flodl_agent.sources": IO_MODULES,
    "flodl_agent.manifest": PYDANTIC,
    "flodl_agent.wire": IO_MODULES,
    "flodl_agent.keys": IO_MODULES,
    "flodl_agent.join_events": PYDANTIC,
    "flodl_agent.hub": IO_MODULES,
    "flodl_agent.history": IO_MODULES,
    "flodl_agent.log_limit": IO_MODULES,
    "flodl_agent.ranks": IO_MODULES,
    "flodl_agent.window": IO_MODULES,
    "flodl_agent.messages": PYDANTIC,
    "flodl_agent.admission": PYDANTIC,
    "flodl_agent.join_protocol": PYDANTIC,
    "flodl_agent.supervision": IO_MODULES,
    "flodl_agent.controller_settings": PYDANTIC,
    "flodl_agent.retry": IO_MODULES,
    "flodl_agent.offer": PYDANTIC,
    "flodl_agent.variants": PYDANTIC,
    "flodl_agent.rank_env": PYDANTIC,
    "flodl_agent.device_memory": IO_MODULES,
    "flodl_agent.findings": IO_MODULES,
    "flodl_agent.compose": IO_MODULES,
    "flodl_agent.options": PYDANTIC,
    "flodl_agent.agent_spec": PYDANTIC,
    "flodl_agent.placement": IO_MODULES,
    "flodl_agent.placement.fleet": IO_MODULES,
    "flodl_agent.placement.parallel": IO_MODULES,
    "flodl_agent.placement.segments": IO_MODULES,
    # The package itself is the YAML shell (load_config); yaml imports none of IO_MODULES.
    "flodl_agent.config": PYDANTIC,
    "flodl_agent.config.problems": PYDANTIC,
    "flodl_agent.config.devices": PYDANTIC,
    "flodl_agent.config.fields": PYDANTIC,
    "flodl_agent.config.join_window": PYDANTIC,
    "flodl_agent.config.cluster": PYDANTIC,
    "flodl_agent.config.join": PYDANTIC,
    "flodl_agent.config.models": PYDANTIC,
    "flodl_agent.config.source": PYDANTIC,
    "flodl_agent.config.validate": PYDANTIC,
    "flodl_agent.config.builder": PYDANTIC,
}


def imported_by(module: str) -> set[str]:
    """Top-level module names in ``sys.modules`` after importing ``module`` in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted({name.partition('.')[0] for name in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", sorted(PURE_CORES))
def test_a_pure_core_imports_no_io(module: str) -> None:
    assert imported_by(module) & PURE_CORES[module] == set()


# -- the import graph ------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module loads: its body, and the bodies of top-level if/try blocks;
    not those inside functions or classes, nor under ``if TYPE_CHECKING`` (never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not is_type_checking(node):
            pending += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending += [*node.body, *node.orelse, *node.finalbody]
            for handler in node.handlers:
                pending += handler.body
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import sub` imports the submodule; `from mod import name`, the module.
            subs = {f"{base}.{alias.name}" for alias in node.names} & paths.keys()
            targets |= subs or {base}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_relative_and_package_imports() -> None:
    graph = import_graph()
    assert "flodl_agent.config.models" in graph["flodl_agent.config"]
    assert "flodl_agent.address" in graph["flodl_agent.config.fields"]
    assert "flodl_agent.config.models" not in graph["flodl_agent.ranks"]  # under TYPE_CHECKING


def test_the_cycle_finder_names_the_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_is_over_the_line_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}
