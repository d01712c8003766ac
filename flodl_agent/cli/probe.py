"""`fdl probe`: check this box before it walks in; `fdl @NAME probe`: a whole cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NoReturn

import click
from rich.markup import escape
from rich.table import Table

from ..config import Cluster, ConfigError, load_config
from ..probing.findings import Finding
from .common import (
    CLUSTER_FILE,
    base_opt,
    emit_json,
    err,
    fail,
    json_opt,
    option_error,
    out,
    present,
    project_file,
)
from .join import read_spec
from .options import OptionError, probe_join

LEVEL_STYLE = {"ok": "green", "warn": "yellow", "fail": "red bold"}


def _finding_row(f: Finding, *where: str) -> tuple[str, ...]:
    text = f.message + (f"\n  fix: {f.fix}" if f.fix and f.level != "ok" else "")
    return (f"[{LEVEL_STYLE[f.level]}]{f.level}[/]", *where, f.check, escape(text))


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="fdl.yml (a worker's join: block) or fdl.cluster.yml (a controller). "
    "Default: whichever is in this directory; with neither, the box alone.",
)
@base_opt
@click.option("--no-dial", is_flag=True, help="Do not try to reach the controller.")
@click.option("--spec-stdin", is_flag=True, hidden=True, help="Probe as a cluster entry on stdin says.")
@click.option(
    "--capture",
    "capture_to",
    type=click.Path(path_type=Path),
    metavar="DIR|FILE.tar.gz",
    help="Instead, snapshot this box's GPU stack for a bug report into a new directory (or a "
    ".tar.gz): this probe's report, the kernel's GPU modules, /dev/kfd and /dev/dri against this "
    "user's groups, the KFD topology, rocminfo, rocm-smi, nvidia-smi, torch's build and runtime, "
    "the GPU environment (credentials redacted). Exit 0 when written.",
)
@json_opt
def probe(
    config_file: Path | None,
    base: Path | None,
    no_dial: bool,
    spec_stdin: bool,
    capture_to: Path | None,
    as_json: bool,
) -> None:
    """Check this box before it walks in (or runs a controller).

    torch and its variant against this box's GPUs, NCCL, an AMD box's access
    (/dev/kfd, the render nodes and groups, the ROCm runtime), the socket interface,
    the data root (data_path and its signature; with none declared, the
    /flodl/data convention, where absence is fine), the node-local cache, the
    controller (through the join's ssh forward when it has one), the
    controller port, and stale config keys.
    Exit 0 when nothing failed, 1 otherwise.
    """
    from ..probing.probe import as_json_payload, check, gather

    if capture_to is not None:
        write_capture(capture_to, config_file, base, as_json)
    if config_file is None and not spec_stdin:
        config_file = project_file() or present(CLUSTER_FILE)
    join = cluster = None
    findings: list[Finding] = []
    if spec_stdin:  # `fdl @NAME probe`: this box as its cluster entry describes it
        try:
            join = probe_join(read_spec(True, "probe"))
        except OptionError as exc:
            option_error("probe", exc)
    elif config_file is not None:
        try:
            loaded = load_config(config_file, base)
        except ConfigError as exc:  # a finding like any other: the rest of the box is still probed
            findings += [Finding("config", "fail", p.render()) for p in exc.problems]
        else:
            join, cluster = loaded.config.join, loaded.config.cluster
            findings += [Finding("config", "warn", w.render()) for w in loaded.warnings]
            findings.append(Finding("config", "ok", f"{' + '.join(loaded.files)} is valid"))
    facts = gather(join, cluster, dial=not no_dial)
    findings += check(facts, join, cluster)
    failed = any(f.level == "fail" for f in findings)
    if as_json:
        emit_json(as_json_payload(facts, findings))
    else:
        table = Table("", "check", "finding", box=None, show_header=False, pad_edge=False)
        for f in findings:
            table.add_row(*_finding_row(f))
        out.print(table)
        out.print("[red]not ready[/]" if failed else "[green]ready[/]")
    raise SystemExit(1 if failed else 0)


def probe_cluster(cluster: Cluster, name: str, as_json: bool) -> NoReturn:
    """`fdl @NAME probe`: every worker over ssh, the controller here, and the findings across them."""
    from ..fleet.cluster_probe import across
    from ..fleet.cluster_probe import as_json as cluster_json
    from ..fleet.cluster_probe import probe_cluster as run_probe

    if not as_json:
        err.print(f"probing the controller and {len(cluster.workers)} worker(s) of {name}…", style="dim")
    reports = asyncio.run(run_probe(cluster))
    findings = across(reports)
    payload = cluster_json(reports, findings)
    if as_json:
        emit_json(payload)
        raise SystemExit(0 if payload["ok"] else 1)
    table = Table("", "host", "check", "finding", box=None, show_header=False, pad_edge=False)
    for report in reports:
        for f in report.findings:
            if f.level != "ok":
                table.add_row(*_finding_row(f, report.host))
        if report.payload is not None and not any(f.level != "ok" for f in report.findings):
            table.add_row("[green]ok[/]", report.host, "", "every check passed")
    for f in findings:
        table.add_row(*_finding_row(f, "(across)"))
    out.print(table)
    out.print("[green]ready[/]" if payload["ok"] else "[red]not ready[/]")
    raise SystemExit(0 if payload["ok"] else 1)


def _check_capture_dest(dest: Path) -> None:
    """A new FILE.tar.gz in a directory that exists, or a new or empty directory."""
    if dest.name.endswith((".tar.gz", ".tgz")):
        if dest.exists() or not dest.parent.is_dir():
            why = "exists" if dest.exists() else f"is in no directory ({dest.parent} does not exist)"
            raise click.BadParameter(f"{dest} {why}; name a new .tar.gz", param_hint="--capture")
    elif dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise click.BadParameter(
            f"{dest} exists and is not an empty directory; name a new one (or a FILE.tar.gz)",
            param_hint="--capture",
        )


def write_capture(dest: Path, config_file: Path | None, base: Path | None, as_json: bool) -> NoReturn:
    """`fdl probe --capture DEST`: write it, list what is in it (what was missing, failed or cut)."""
    from ..probing.capture import capture

    try:
        _check_capture_dest(dest)
    except OSError as exc:  # a name the file system cannot hold (too long), a directory we cannot read
        raise click.BadParameter(
            f"{dest}: {exc.strerror or exc}; name another place", param_hint="--capture"
        ) from None
    args = [
        *(["--config", str(config_file)] if config_file else []),
        *(["--base", str(base)] if base else []),
    ]
    try:
        where, index = capture(dest, probe_args=args)
    except OSError as exc:
        fail(
            "probe", f"cannot write the capture at {dest} ({exc.strerror or exc})", "name a writable place", 1
        )
    if as_json:
        emit_json(index)
        raise SystemExit(0)
    table = Table("", "file", "what", box=None, show_header=False, pad_edge=False)
    style = {"ok": "green", "failed": "yellow", "timeout": "red"}
    for entry in index["files"]:
        how = entry["status"] + (f" {entry['exit']}" if entry["status"] == "failed" else "")
        note = f" ({entry['note']})" if entry["note"] else ""
        table.add_row(
            f"[{style.get(entry['status'], 'dim')}]{how}[/]",
            escape(entry["name"]),
            escape(entry["what"] + note),
        )
    out.print(table)
    out.print(
        f"capture written to [bold]{escape(str(where))}[/]: README.txt says what each file is; "
        "look it over, then attach it"
    )
    raise SystemExit(0)
