"""Mounting the data root, step by step: a mount already there, sshfs's options and remote,
and a failed mount's words classed as the troubleshooting guide words them."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent.prepare import (
    PrepareFailure,
    data_remote,
    mount_failure,
    mount_state,
    mount_words,
    sshfs_options,
)
from flodl_agent.config import Ssh
from flodl_agent.errors import PERMANENT, TRANSIENT
from flodl_agent.sources.spec import parse_data_source

DATA = "sshfs://door:/data"
BASE = "ro,reconnect,ServerAliveInterval=15,ServerAliveCountMax=3,BatchMode=yes,StrictHostKeyChecking=yes"


def done(code: int, stderr: str = "", stdout: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["sshfs"], code, stdout, stderr)


@pytest.mark.parametrize(
    ("broken", "state"),
    [
        (None, "live"),  # the root answers: reuse it
        (OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN)), "dead"),  # its sshfs died
        (OSError(errno.ECONNABORTED, os.strerror(errno.ECONNABORTED)), "dead"),  # the same, other timing
    ],
)
def test_a_mount_already_there_is_reused_when_it_answers_and_replaced_when_dead(
    broken: OSError | None, state: str
) -> None:
    assert mount_state(Path("/mnt/data"), broken) == state


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EIO])
def test_a_mount_that_is_not_dead_but_cannot_be_read_stops_for_good(code: int) -> None:
    with pytest.raises(PrepareFailure) as caught:
        mount_state(Path("/mnt/data"), OSError(code, os.strerror(code)))
    assert caught.value.code == PERMANENT
    assert caught.value.message == f"the data mount at /mnt/data cannot be read: {os.strerror(code)}"
    assert "allow_other" in caught.value.fix


@pytest.mark.parametrize(
    ("spec", "ssh", "options"),
    [
        (DATA, Ssh(), BASE),
        # the ssh block's options after the fixed ones: they cannot turn read-only off
        (DATA, Ssh(options=["UserKnownHostsFile=/k"]), f"{BASE},UserKnownHostsFile=/k"),
        ("sshfs://door:2200:/data", Ssh(), f"{BASE},port=2200"),
        (DATA, Ssh(port=2201), f"{BASE},port=2201"),
        ("sshfs://door:2200:/data", Ssh(port=2201), f"{BASE},port=2200"),  # the spec's port wins
        (DATA, Ssh(identity_file="/id"), f"{BASE},IdentityFile=/id,IdentitiesOnly=yes"),
        (
            "sshfs://door:2200:/data",
            Ssh(identity_file="/id", options=["A=b"]),
            f"{BASE},A=b,port=2200,IdentityFile=/id,IdentitiesOnly=yes",
        ),
    ],
)
def test_sshfs_options_mount_read_only_with_the_pin_and_the_join_ssh_block(
    spec: str, ssh: Ssh, options: str
) -> None:
    assert sshfs_options(parse_data_source(spec), ssh) == options


@pytest.mark.parametrize(
    ("spec", "ssh", "remote"),
    [
        (DATA, Ssh(), "door:/data"),
        (DATA, Ssh(user="svc"), "svc@door:/data"),
        ("sshfs://data@door:/data", Ssh(), "data@door:/data"),
        ("sshfs://data@door:2200:/data", Ssh(user="svc"), "data@door:/data"),  # the spec's user wins
    ],
)
def test_the_remote_names_the_spec_user_else_the_ssh_blocks(spec: str, ssh: Ssh, remote: str) -> None:
    assert data_remote(parse_data_source(spec), ssh) == remote


@pytest.mark.parametrize(
    ("proc", "said", "text", "last"),
    [
        (done(1, "a\nb\nc\nread: Connection reset by peer\n"), None,
         "a\nb\nc\nread: Connection reset by peer", "b / c / read: Connection reset by peer"),
        (done(1, stdout="only stdout\n"), None, "only stdout", "only stdout"),  # stderr empty
        (done(3), None, "", "sshfs exited 3"),  # silent
        # ssh's own words replace sshfs's last lines, and join the text the classes read
        (done(1, "read: Connection reset by peer"), done(255, "x\ny\nPermission denied (publickey).\n"),
         "read: Connection reset by peer\nx\ny\nPermission denied (publickey).\n",
         "y / Permission denied (publickey)."),
        (done(1, "read: Connection reset by peer"), done(0), "read: Connection reset by peer\n",
         "read: Connection reset by peer"),  # ssh said nothing: sshfs's words stay
    ],
)  # fmt: skip
def test_a_failed_mount_says_ssh_s_own_words_over_sshfs_s(
    proc: subprocess.CompletedProcess[str],
    said: subprocess.CompletedProcess[str] | None,
    text: str,
    last: str,
) -> None:
    assert mount_words(proc, said) == (text, last)


FORCED = done(1, stdout="This account is currently not available.\n")

MOUNT_FAILURES: list[tuple[str, subprocess.CompletedProcess[str] | None, dict[str, Any]]] = [
    (
        "Permission denied (publickey).",
        done(255),
        {
            "message": f"mounting {DATA}: permission denied (LAST)",
            "code": PERMANENT,
            "fix": 'restrict,command="internal-sftp -R" <key>',
        },
    ),
    # a denied key is said as such even when the host key or FUSE words come along
    ("Permission denied\nHost key verification failed.\nfuse: device not found", None,
     {"message": f"mounting {DATA}: permission denied (LAST)", "code": PERMANENT}),
    (
        "Host key verification failed.",
        None,
        {
            "message": f"mounting {DATA}: the host key does not match the one pinned in known_hosts "
            "(ssh: Host key verification failed)",
            "code": PERMANENT,
            "fix": "Never turn StrictHostKeyChecking off",
        },
    ),
    ("REMOTE HOST IDENTIFICATION HAS CHANGED\nfuse: device not found", FORCED,
     {"message": f"mounting {DATA}: the host key does not match", "code": PERMANENT}),
    (
        "fuse: device not found, try 'modprobe fuse' first",
        None,
        {
            "message": f"mounting {DATA}: this box cannot mount FUSE filesystems (LAST)",
            "code": PERMANENT,
            "fix": "apt-get install sshfs fuse3",
        },
    ),
    ("FUSE: mount: Operation not permitted", FORCED,
     {"message": f"mounting {DATA}: this box cannot mount FUSE filesystems (LAST)", "code": PERMANENT}),
    # "fuse" alone (no device, nothing refused) is not a FUSE failure
    ("fuse: unknown option", None, {"message": f"mounting {DATA} failed: LAST", "code": TRANSIENT}),
    (
        "read: Connection reset by peer",
        FORCED,
        {
            "message": f"mounting {DATA}: permission denied: this box's key opens the door for the tunnel "
            "only (its forced command ran instead of sftp: This account is currently not available.)",
            "code": PERMANENT,
            "fix": "declare a bare join.data_path",
        },
    ),
    ("read: Connection reset by peer", done(7),
     {"message": "(its forced command ran instead of sftp: exit 7)", "code": PERMANENT}),
    # ssh's own failure (255) or success (0), or no ssh at all: not a forced command
    ("read: Connection reset by peer", done(255, "kex_exchange_identification: closed"),
     {"message": f"mounting {DATA} failed: LAST", "code": TRANSIENT}),
    ("read: Connection reset by peer", done(0),
     {"message": f"mounting {DATA} failed: LAST", "code": TRANSIENT}),
    (
        "ssh: Could not resolve hostname door: Name or service not known",
        done(255),
        {
            "message": f"mounting {DATA}: the door's name door does not resolve (LAST)",
            "code": TRANSIENT,
            "fix": "--persist re-dials",
        },
    ),
    ("read: Connection reset by peer", None,
     {"message": f"mounting {DATA} failed: LAST", "code": TRANSIENT, "fix": "is the door reachable?"}),
]  # fmt: skip


@pytest.mark.parametrize(("text", "said", "want"), MOUNT_FAILURES)
def test_a_failed_mount_is_classed_as_the_guide_words_it(
    text: str, said: subprocess.CompletedProcess[str] | None, want: dict[str, Any]
) -> None:
    failure = mount_failure(DATA, "door", text, "LAST", said)
    assert failure.code == want["code"]
    assert want["message"] in failure.message
    assert want.get("fix", "") in failure.fix
