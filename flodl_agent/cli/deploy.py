"""`fdl deploy`: run a playbook of the project against an inventory."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from .common import FilePath, emit_json, err, fail, json_opt, out

DEPLOY_STYLE = {"changed": "yellow", "failed": "red bold", "unreachable": "red bold", "ok": "green"}


@click.command()
@click.argument("playbook", type=FilePath(path_type=Path, dir_okay=False), default="site.yml")
@click.option("-i", "--inventory", type=FilePath(path_type=Path), help="Inventory (default: ansible.cfg's).")
@click.option("-l", "--limit", help="Only these hosts or groups (ansible's --limit pattern).")
@click.option("-e", "--extra", "extras", multiple=True, metavar="KEY=VALUE", help="An extra variable.")
@click.option("--check", is_flag=True, help="Dry run: report what would change (--check --diff).")
@click.option(
    "--artifacts",
    type=FilePath(path_type=Path, file_okay=False),
    help="Where each run's artifacts go (default: build/deploy in the project).",
)
@click.option("-q", "--quiet", is_flag=True, help="Only the summary: no per-host progress lines.")
@json_opt
def deploy(
    playbook: Path,
    inventory: Path | None,
    limit: str | None,
    extras: tuple[str, ...],
    check: bool,
    artifacts: Path | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Run a playbook of the project (site.yml by default) against an inventory.

    Per-host progress as it happens, a summary table per host, the event stream kept
    under the artifacts directory, and the exit code of ansible-playbook itself
    (0 ok, 2 a host failed, 4 a host unreachable).
    """
    from ..fleet.deploy import DeployError, HostResult
    from ..fleet.deploy import deploy as run_deploy

    extravars: dict[str, str] = {}
    for item in extras:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"`{item}` is not KEY=VALUE", param_hint="--extra")
        extravars[key] = value

    def show(result: HostResult) -> None:
        if quiet or as_json or result.status == "skipped":
            return
        style = DEPLOY_STYLE.get(result.status, "dim")
        line = f"[{style}]{result.status:<11}[/] {escape(result.host):<28} {escape(result.task)}"
        out.print(line + (f"\n            [red]{escape(result.message)}[/]" if result.message else ""))

    try:
        result = run_deploy(
            playbook,
            inventory=inventory,
            limit=limit,
            extravars=extravars,
            check=check,
            artifacts=artifacts,
            on_result=show,
        )
    except DeployError as exc:
        err.print(f"fdl deploy: {exc.render()}", style="red", markup=False)
        raise SystemExit(2) from None
    except OSError as exc:  # the artifacts directory (beside the playbook by default) cannot be made
        fail(
            "deploy",
            f"cannot write {exc.filename or 'the artifacts'}: {exc.strerror}",
            "pass --artifacts DIR, a directory this user can write",
        )
    if as_json:
        emit_json(result.as_json())
        raise SystemExit(result.rc)
    table = Table("host", "ok", "changed", "failed", "unreachable", "skipped", box=None, pad_edge=False)
    for host, counts in result.recap.items():
        bad = counts["failures"] or counts["dark"]
        table.add_row(
            f"[{'red' if bad else 'green'}]{escape(host)}[/]",
            str(counts["ok"]),
            str(counts["changed"]),
            str(counts["failures"]),
            str(counts["dark"]),
            str(counts["skipped"]),
        )
    out.print(table)
    verdict = "[green]deployed[/]" if result.ok else f"[red]failed[/] (ansible-playbook exited {result.rc})"
    out.print(f"{verdict}; events in {escape(str(result.artifacts))}")
    raise SystemExit(result.rc)
