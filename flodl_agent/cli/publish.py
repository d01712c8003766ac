"""`fdl publish`: fetch a source into the served tree, build it once as a gate, write its manifest."""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from .common import (
    CLUSTER_FILE,
    FilePath,
    TailCommand,
    emit_json,
    err,
    json_opt,
    load,
    log,
    option_error,
    out,
    present,
    project_file,
)
from .options import OptionError, PublishFlags, resolve_publish


class _PublishCommand(TailCommand):
    usage = "[OPTIONS] [SPEC] [-- ARGS...]"


@click.command(cls=_PublishCommand)
@click.argument("spec", required=False)
@click.option("--bin", "entry", help="Entry point, relative to --cwd.")
@click.option("--cwd", help="Project directory inside the tree (default: its root).")
@click.option("--build", help="Build line, run once here as the gate (and by every worker).")
@click.option(
    "--to",
    "served",
    type=FilePath(path_type=Path, file_okay=False),
    help="Publish directory: door B serves its tree/ (default: publish.to, else ~/.flodl/run).",
)
@click.option(
    "--identity", type=FilePath(path_type=Path, dir_okay=False), help="ssh key for rsync:// and git+ssh://."
)
@click.option("--no-build", is_flag=True, help="Publish without running the build gate.")
@click.option(
    "--model-probe/--no-model-probe",
    default=None,
    help="Probe the entry's model here; every box then probes its own before it dials, and the "
    "join window refuses a box that builds a different model. The entry must build its model "
    "through flodl_agent.train.Trainer (or call flodl_agent.train.answer_probe).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml whose publish: block supplies the defaults (default: ./fdl.yml if present).",
)
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Cluster file whose controller says where the gate builds: its docker service or its arch "
    "variant (default: ./fdl.cluster.yml if present, else fdl.yml's cluster: block).",
)
@json_opt
@click.pass_context
def publish(
    ctx: click.Context,
    spec: str | None,
    entry: str | None,
    cwd: str | None,
    build: str | None,
    served: Path | None,
    identity: Path | None,
    no_build: bool,
    model_probe: bool | None,
    config_file: Path | None,
    cluster_file: Path | None,
    as_json: bool,
) -> None:
    """Publish a run: fetch SPEC, build it once as a gate, swap it in as the served tree.

    SPEC is file:///abs, rsync://[user@]host[:port]:/abs, or git+https|ssh|file://…#ref.
    Everything after `--` is the run's arguments. Flags default from the publish: block of
    fdl.yml, field by field; a `--` tail replaces its args even when empty. The gate builds
    with this venv (the CPU variant), or where the cluster file's controller says: in its
    docker compose service, or with its arch variant (<path>/libtorch/<arch>). A published tree
    is self-contained: a symlink that leads out of the source, a bin outside the tree, or a
    publish directory inside the source is refused. A git SPEC is fetched shallow, that commit
    alone (a commit id in full). The served tree changes in one step, once everything passed:
    a refused or failed publish leaves the served run as it was, and says which run that is.
    Workers pick the run up on their next dial. Exit 0 published, 1 otherwise (nothing
    published, the served run unchanged).
    """
    from ..config import Publish
    from ..fleet.publish import PublishRequest
    from ..fleet.publish import publish as run_publish
    from ..sources.manifest import PublishError

    path = project_file(config_file)
    project = load(path, None, as_json).config if path else None
    block = (project.publish if project else None) or Publish()
    cluster_path = cluster_file or present(CLUSTER_FILE)
    cluster = load(cluster_path, None, as_json).config.cluster if cluster_path else None
    cluster = cluster or (project.cluster if project else None)
    tail = ctx.meta["tail"]
    flags = PublishFlags(
        spec=spec,
        bin=entry,
        cwd=cwd,
        build=build,
        served=served,
        identity=identity,
        no_build=no_build,
        model_probe=model_probe,
        tail=tuple(tail) if tail is not None else None,
    )
    try:
        settings = resolve_publish(flags, block, cluster.controller if cluster else None)
    except OptionError as exc:
        option_error("publish", exc)
    request = PublishRequest(
        source=settings.source,
        served=settings.served.expanduser().absolute(),
        bin=settings.bin,
        cwd=settings.cwd,
        build=settings.build,
        args=settings.args,
        no_build=settings.no_build,
        model_probe=settings.model_probe,
        identity=str(settings.identity.expanduser()) if settings.identity else None,
        gate_docker=settings.gate_docker,
        gate_venv=settings.gate_venv,
    )
    try:
        report = run_publish(request, log=log if not as_json else lambda _: None)
    except PublishError as exc:
        if as_json:
            emit_json({"published": False, "error": exc.message, "fix": exc.fix, "served": exc.unchanged})
        else:
            err.print(f"fdl publish: {exc.render()}", style="red", markup=False)
        raise SystemExit(1) from None
    host = socket.getfqdn()
    spellings = report.spellings(host)
    manifest = report.manifest
    if as_json:
        emit_json(
            {
                "published": True,
                "tree": str(report.tree),
                "files": report.files,
                "manifest": manifest.model_dump(),
                "fetch": spellings,
            }
        )
        return
    built = (
        f"passed: {manifest.build}"
        if manifest.built
        else ("not built (--no-build)" if manifest.build else "no build line")
    )
    table = Table("", "", box=None, show_header=False, pad_edge=False)
    for name, value in (
        ("run", manifest.run),
        (
            "tree",
            f"{report.tree}  ({report.files} file{'' if report.files == 1 else 's'}, "
            f"digest {manifest.digest[:12]})",
        ),
        ("origin", manifest.origin),
        ("build", built),
        ("cwd", manifest.cwd),
        ("bin", manifest.bin or "(the launch command's)"),
        ("args", shlex.join(manifest.args) if manifest.args else "(none)"),
        (
            "model",
            f"{manifest.model_sig[:12]}  (every box probes its own before it dials)"
            if manifest.model_sig
            else "not probed (the formation check compares models)",
        ),
        ("fetch", f"{spellings['plain']}   (a key without a forced command)"),
        ("", f"{spellings['rrsync']}   (through door B, whose root is the tree)"),
    ):
        table.add_row(f"[bold]{name}[/]", escape(value))
    out.print("[green]published[/]")
    out.print(table)
