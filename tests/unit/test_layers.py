"""The package's layering: folders in a declared order, pure cores import no IO, imports form
no cycle (counting those under ``TYPE_CHECKING`` and inside functions), modules stay small.

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

from tests.support import syntax

PACKAGE = Path(__file__).resolve().parents[2] / "flodl_agent"
ROOT = PACKAGE.parent
MAX_LINES = 500

# The folders (and the modules at the package's top) from the bottom up: a module imports
# only from its own entry or one below it. A new folder or top-level module is declared here.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "__init__ errors names address pin credentials retry net",  # the leaves everything shares
        "sources",  # where a run comes from: specs, fetch, build, the manifest
        "config",  # the cluster schema, the rank helpers
        "protocol",  # the join protocol: preamble, wire, messages, handshake, streams, TLS, tunnel
        "observe",  # progress and /metrics, history, status page, fdl status, verdict
        "train",  # the data plane: rendezvous, averaging and its hub, the Trainer
        "placement",  # fleet roles, pre-flight, NVLink segments, Ray
        "controller",  # window, admission, supervision; the port, links, traffic
        "hardware",  # GPUs, the offer's gate, torch variants and their venvs
        "probing",  # fdl probe: facts, findings, data root, capture, NCCL pins
        "agent",  # the walk-in: options, persist loop, box, ranks, containers, preparation
        "fleet",  # launch, fan-out, dispatch, publish, deploy, the cluster probe
        "cli demo_rank",  # the command line and the demo's rank: nothing imports them
    )
)

IO_MODULES = frozenset({"asyncio", "ssl", "subprocess", "socket", "torch", "ray"})
# pydantic's plugin loader imports importlib.metadata when the first model class
# is built, and importlib.metadata imports email.utils, which imports socket:
# unavoidable for a core that defines pydantic models. Nothing else is let through.
PYDANTIC = IO_MODULES - {"socket"}

PURE_CORES: dict[str, frozenset[str]] = {
    "flodl_agent.errors": IO_MODULES,
    "flodl_agent.retry": IO_MODULES,
    "flodl_agent.address": IO_MODULES,
    "flodl_agent.names": IO_MODULES,
    "flodl_agent.pin": IO_MODULES,
    "flodl_agent.credentials": IO_MODULES,
    "flodl_agent.sources.spec": IO_MODULES,
    "flodl_agent.sources.manifest": PYDANTIC,
    "flodl_agent.protocol.wire": IO_MODULES,
    "flodl_agent.protocol.keys": IO_MODULES,
    "flodl_agent.protocol.join_events": PYDANTIC,
    "flodl_agent.train.hub": IO_MODULES,
    "flodl_agent.observe.history": IO_MODULES,
    "flodl_agent.controller.log_limit": IO_MODULES,
    "flodl_agent.config.ranks": PYDANTIC,
    "flodl_agent.controller.window": PYDANTIC,
    "flodl_agent.protocol.messages": PYDANTIC,
    "flodl_agent.controller.admission": PYDANTIC,
    "flodl_agent.protocol.join_protocol": PYDANTIC,
    "flodl_agent.controller.supervision": PYDANTIC,  # its log words use config.ranks.rank_span
    "flodl_agent.controller.settings": PYDANTIC,
    "flodl_agent.controller.journal": PYDANTIC,  # its file is os and fcntl, no socket
    "flodl_agent.hardware.offer": PYDANTIC,
    "flodl_agent.hardware.variants": PYDANTIC,
    "flodl_agent.agent.rank_env": PYDANTIC,
    "flodl_agent.train.device_memory": IO_MODULES,
    "flodl_agent.probing.findings": IO_MODULES,
    "flodl_agent.agent.compose": IO_MODULES,
    "flodl_agent.cli.options": PYDANTIC,
    "flodl_agent.cli.precedence": IO_MODULES,
    "flodl_agent.agent.spec": PYDANTIC,
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


def every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import in the module: at load, under ``if TYPE_CHECKING`` and inside functions.
    A loop hidden in a function or behind the type checker is still a loop in the design."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in every_import(syntax.parse(path)):
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


def entry(module: str) -> str:
    """The folder (or top-level module) a module belongs to: ``flodl_agent.protocol.wire`` ->
    ``protocol``; ``flodl_agent.names`` -> ``names``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str, layers: tuple[frozenset[str], ...] = LAYERS) -> int | None:
    return next((i for i, names in enumerate(layers) if entry(module) in names), None)


def upward_imports(graph: dict[str, set[str]], layers: tuple[frozenset[str], ...] = LAYERS) -> list[str]:
    """Each import of a module from a layer above its own, as `importer -> imported`."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module, layers)
        for target in sorted(targets):
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module} ({entry(module)}) -> {target} ({entry(target)})")
    return found


def test_the_graph_reader_sees_relative_package_and_hidden_imports() -> None:
    graph = import_graph()
    assert "flodl_agent.config.models" in graph["flodl_agent.config"]
    assert "flodl_agent.address" in graph["flodl_agent.config.fields"]
    assert "flodl_agent.config.models" in graph["flodl_agent.config.ranks"]  # under TYPE_CHECKING
    # inside a function: gpus runs vendor tools with capture_files' bounded run
    assert "flodl_agent.hardware.capture_files" in graph["flodl_agent.hardware.gpus"]


def test_the_cycle_finder_names_the_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_layer_rule_names_an_import_that_reaches_up() -> None:
    layers = (frozenset({"names"}), frozenset({"protocol"}), frozenset({"agent"}))
    graph = {
        "flodl_agent.protocol.wire": {"flodl_agent.names"},
        "flodl_agent.agent.box": {"flodl_agent.protocol.wire", "flodl_agent.agent.options"},
        "flodl_agent.agent.options": set(),
        "flodl_agent.names": {"flodl_agent.agent.box"},
    }
    assert upward_imports(graph, layers) == ["flodl_agent.names (names) -> flodl_agent.agent.box (agent)"]


def test_every_folder_and_top_level_module_has_a_declared_layer() -> None:
    undeclared = sorted({entry(m) for m in import_graph() if layer_of(m) is None})
    assert undeclared == [], f"declare these in LAYERS: {undeclared}"


def test_a_folder_imports_only_from_folders_below_it() -> None:
    assert upward_imports(import_graph()) == []


def test_no_module_is_over_the_line_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_about_a_dozen_modules_stand_at_the_top() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
