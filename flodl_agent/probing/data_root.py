"""The data root a probe checks: the declared data_path, or the /flodl/data convention.

A declared root reaches the ranks (FLODL_DATA_PATH) and is signed for the hello,
where admission holds every box to one signature ("dataset mismatch"). With none
declared nothing is shipped (the entry keeps its own default), and the
convention root governs only the pre-flight checks: ``fdl probe`` looks there,
and an absent one is no error. Either way the probe signs the root with the
agent's own :func:`~flodl_agent.train.signature.dataset_signature`, so ``fdl @NAME
probe`` compares boxes the way admission will.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

from ..net import DEAD_MOUNT
from ..train.signature import dataset_signature
from .findings import Finding

CONVENTION = Path("/flodl/data")  # the root a box with no data_path is checked at


def data_facts(declared: str | None, convention: Path = CONVENTION) -> dict[str, Any]:
    """path, declared, user; exists, readable, entries; the signature, or why it has none."""
    path = declared or str(convention)
    facts: dict[str, Any] = {"path": path, "declared": bool(declared), "user": _user()}
    try:
        entries = list(Path(path).iterdir())
    except OSError as exc:
        facts["exists"] = exc.errno != errno.ENOENT
        facts["readable"] = False
        facts["error"] = "not connected" if exc.errno in DEAD_MOUNT else exc.strerror
        return facts
    facts.update(exists=True, readable=True, entries=len(entries))
    try:
        # Uncached: the probe reports the root as it is now, not as a dial last saw it.
        facts["signature"] = dataset_signature(path)
    except OSError as exc:
        facts["signature_error"] = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    return facts


def data_findings(d: dict[str, Any]) -> list[Finding]:
    """What :func:`data_facts` found, as the probe's findings (none when no root was checked)."""
    if not d.get("path"):
        return []
    path = d["path"]
    if d.get("error") == "not connected":
        return [
            Finding(
                "data",
                "fail",
                f"the data mount at {path} is not connected (its sshfs died)",
                "restart the mount (flodl-join.service does before each dial), or remount it by hand",
            )
        ]
    if not d.get("declared", True):  # no key: an older fdl, which checked declared roots only
        return _convention(d)
    if not d.get("exists"):
        return [
            Finding(
                "data",
                "fail",
                f"data_path {path} does not exist on this box",
                "mount the data root there (flodl_worker_data_mount), or fix join.data_path",
            )
        ]
    if not d.get("readable") or d.get("signature_error"):
        return [
            Finding(
                "data",
                "fail",
                f"data_path {path} is not readable by {d.get('user', 'this user')} ({_why(d)}): "
                "the agent signs it before every dial",
                "a door A mount needs allow_other; a local root needs read permission for the service user",
            )
        ]
    return [Finding("data", "ok", f"data_path {path} readable ({signed(d)})")]


def signed(d: dict[str, Any]) -> str:
    """A readable root in a few words: its entries and its signature's head."""
    sig = d.get("signature")
    return f"{d.get('entries', 0)} entries" + (f", signature {sig[:12]}" if sig else "")


def _why(d: dict[str, Any]) -> str:
    return str(d.get("error") or d.get("signature_error") or "")


def _convention(d: dict[str, Any]) -> list[Finding]:
    """No data_path declared: the convention root is checked, never shipped; absent is fine."""
    checked = f"no data_path declared; checked the convention root {d['path']}"
    if not d.get("exists"):
        return [Finding("data", "ok", f"{checked}: absent")]
    if not d.get("readable") or d.get("signature_error"):
        return [
            Finding(
                "data",
                "warn",
                f"{checked}: there, but not readable by {d.get('user', 'this user')} ({_why(d)})",
                "give the service user read permission if the entry reads it, or declare data_path",
            )
        ]
    return [
        Finding(
            "data",
            "ok",
            f"{checked}: readable ({signed(d)}); the ranks get no FLODL_DATA_PATH for it "
            "(declare data_path to hand it to them)",
        )
    ]


def _user() -> str:
    with contextlib.suppress(Exception):
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    return str(os.getuid())
