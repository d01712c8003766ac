"""`fdl deploy`: run the project's playbooks through ansible-runner.

:func:`deploy` is the Python API: a playbook (``site.yml`` by default) against an
inventory, with per-host progress as it happens (:class:`Progress`, pure: events
in, lines out), the play's recap per host, the event stream kept as an artifact
(``<artifacts>/<ident>/job_events/*.json``, ansible-runner's own), and the exit
code of ``ansible-playbook`` itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import Failure

# Host results as ansible-runner names them, and as the progress lines say them.
RESULTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
    "runner_item_on_failed": "failed",
}
RECAP = ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored")


class DeployError(Failure):
    pass


@dataclass(frozen=True)
class HostResult:
    host: str
    status: str  # ok, changed, failed, unreachable, skipped
    task: str
    message: str = ""


@dataclass
class Progress:
    """Per-host progress from ansible-runner's events (pure)."""

    results: list[HostResult] = field(default_factory=list)
    tasks: int = 0

    def feed(self, event: Mapping[str, Any]) -> HostResult | None:
        kind = str(event.get("event", ""))
        data = event.get("event_data") or {}
        if kind == "playbook_on_task_start":
            self.tasks += 1
            return None
        status = RESULTS.get(kind)
        if status is None or not data.get("host"):
            return None
        res = data.get("res") or {}
        if status == "ok" and res.get("changed"):
            status = "changed"
        if status == "failed" and data.get("ignore_errors"):
            status = "ignored"
        message = str(res.get("msg", "")) if status in ("failed", "unreachable") else ""
        result = HostResult(str(data["host"]), status, str(data.get("task", "")), message.strip())
        self.results.append(result)
        return result


@dataclass(frozen=True)
class DeployResult:
    rc: int  # ansible-playbook's exit code: 0, 2 (a host failed), 4 (unreachable), ...
    status: str  # ansible-runner's: successful, failed, timeout, canceled
    recap: dict[str, dict[str, int]]  # host -> ok, changed, failures, dark, skipped, rescued, ignored
    artifacts: Path  # the run's artifact directory: stdout, job_events/, rc, status
    results: list[HostResult]

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "rc": self.rc,
            "status": self.status,
            "recap": self.recap,
            "artifacts": str(self.artifacts),
        }


def recap_of(stats: Mapping[str, Mapping[str, int]] | None) -> dict[str, dict[str, int]]:
    """ansible-runner's stats (counter -> host -> n) as host -> counter -> n, every counter present."""
    stats = stats or {}
    hosts = sorted({host for counter in RECAP for host in stats.get(counter, {})})
    return {host: {counter: int(stats.get(counter, {}).get(host, 0)) for counter in RECAP} for host in hosts}


def project_of(playbook: Path) -> Path:
    """The project a playbook belongs to: the nearest directory up with an ansible.cfg
    (its roles and collections paths apply), else the playbook's own directory."""
    for parent in playbook.resolve().parents:
        if (parent / "ansible.cfg").is_file():
            return parent
    return playbook.resolve().parent


COLLECTION = "flodl.cluster"
COLLECTION_PLAYBOOKS = ("site", "run", "golden_image", "probe")
NO_PLAYBOOK_FIX = (
    "name a playbook of the project (site.yml) from its checkout, or install the flodl.cluster "
    "collection: pip install 'flodl-fleet[ansible]' carries it, as does `ansible-galaxy collection "
    "install flodl-cluster-*.tar.gz` (make dist builds both)"
)


def collections_paths() -> list[Path]:
    """Where ansible-playbook looks for collections: ANSIBLE_COLLECTIONS_PATH (or its
    defaults), then every sys.path entry (pip-installed ones: the wheel's, the `ansible`
    package's)."""
    configured = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or os.environ.get("ANSIBLE_COLLECTIONS_PATHS")
    paths = (
        configured.split(os.pathsep)
        if configured
        else ["~/.ansible/collections", "/usr/share/ansible/collections"]
    )
    return [Path(p).expanduser() for p in [*paths, *sys.path] if p]


def collection_playbook(playbook: Path, search: list[Path]) -> str | None:
    """``flodl.cluster.NAME`` when ``playbook`` names one of the collection's playbooks (as
    ``flodl.cluster.site``, or ``site.yml`` / ``site`` where no such file is here) and an
    installed collection holds it; None otherwise."""
    name = str(playbook)
    book = name.removeprefix(f"{COLLECTION}.") if name.startswith(f"{COLLECTION}.") else None
    if book is None and not playbook.exists() and playbook.parent == Path():
        book = name.removesuffix(".yml")
    if book not in COLLECTION_PLAYBOOKS:
        return None
    inside = Path("ansible_collections", *COLLECTION.split("."), "playbooks", f"{book}.yml")
    return f"{COLLECTION}.{book}" if any((root / inside).is_file() for root in search) else None


def _project(playbook: Path) -> tuple[Path, str, str, Path]:
    """Where ansible-runner runs ``playbook``: the project directory, the playbook as
    ansible-playbook takes it, its short name, and the default artifacts directory."""
    if playbook.is_file():
        project = project_of(playbook)
        return (
            project,
            str(playbook.resolve().relative_to(project)),
            playbook.stem,
            project / "build" / "deploy",
        )
    named = collection_playbook(playbook, collections_paths())
    if named is None:
        raise DeployError(
            f"no playbook at {playbook}, and no installed {COLLECTION} collection has it", NO_PLAYBOOK_FIX
        )
    return Path.cwd(), named, named.rsplit(".", 1)[1], Path("~/.flodl/deploy").expanduser()


def deploy(
    playbook: Path,
    *,
    inventory: Path | None = None,
    limit: str | None = None,
    extravars: Mapping[str, Any] | None = None,
    check: bool = False,
    artifacts: Path | None = None,
    on_result: Callable[[HostResult], None] = lambda _: None,
) -> DeployResult:
    """Run ``playbook`` (ansible-playbook through ansible-runner); raises DeployError when it
    cannot start (a missing playbook or inventory, no ansible), never for a failed play."""
    try:
        import ansible_runner
    except ImportError:
        raise DeployError(
            "ansible-runner is not installed", "pip install 'flodl-fleet[ansible]' (make setup does)"
        ) from None
    project, book, stem, default_artifacts = _project(playbook)
    if inventory is not None and not inventory.exists():
        raise DeployError(f"no inventory at {inventory}", "pass -i with an inventory file or directory")
    root = (artifacts or default_artifacts).absolute()
    root.mkdir(parents=True, exist_ok=True)
    ident = f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{stem}-{os.getpid()}"
    progress = Progress()

    def handle(event: dict[str, Any]) -> bool:
        result = progress.feed(event)
        if result is not None:
            on_result(result)
        return True  # keep the event in the artifact

    # ansible-playbook from this venv (where ansible-core is installed beside us).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    runner = ansible_runner.run(
        private_data_dir=str(root),
        project_dir=str(project),
        playbook=book,
        inventory=str(inventory.absolute()) if inventory is not None else None,
        limit=limit,
        extravars=dict(extravars or {}),
        cmdline="--check --diff" if check else None,
        envvars={"PATH": path, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_CONFIG": str(project / "ansible.cfg")}
        if (project / "ansible.cfg").is_file()
        else {"PATH": path, "ANSIBLE_FORCE_COLOR": "0"},
        ident=ident,
        event_handler=handle,
        quiet=True,
    )
    return DeployResult(
        rc=int(runner.rc if runner.rc is not None else 1),
        status=str(runner.status),
        recap=recap_of(runner.stats),
        artifacts=Path(runner.config.artifact_dir),
        results=progress.results,
    )
