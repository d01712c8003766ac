"""Door B against the real thing: an OpenSSH server whose key line (or ForceCommand) runs the
controller role's door program, the real rrsync behind it, and a real rsync client asking for
more than the published tree."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from flodl_agent.fleet.publish import PublishRequest, publish
from flodl_agent.sources.manifest import MANIFEST
from flodl_agent.sources.spec import parse_source
from tests.support import sshd as sshd_kit
from tests.support.sshd import Sshd, door_fetch

pytestmark = pytest.mark.skipif(
    shutil.which("rsync") is None or not Path("/usr/bin/rrsync").exists(),
    reason="rsync (with its rrsync) is not installed",
)
SECRET = "controller-only secret"


def served_run(tmp_path: Path) -> Path:
    """A published run, a secret beside it, a link in the tree that leads to the secret
    (planted by hand: publish refuses such links), and the publish's scratch beside the tree."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "train.py").write_text("print('train')\n")
    served = tmp_path / "served"
    publish(PublishRequest(parse_source(f"file://{src}"), served, bin="train.py", cwd="pkg", build="true"))
    (tmp_path / "secret.txt").write_text(SECRET)
    (served / "tree" / "shared").symlink_to("../..")  # tree/shared -> tmp_path
    assert (served / "tree" / "shared" / "secret.txt").read_text() == SECRET
    assert (served / "gate").is_dir() and (served / "incoming").is_dir()
    return served


def pull(sshd: Sshd, into: Path, *options: str, path: str = "/") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["rsync", "-a", *options, "-e", shlex.join(sshd.client), f"root@127.0.0.1:{path}", f"{into}/"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def holds_secret(root: Path) -> bool:
    return any(SECRET in path.read_text(errors="replace") for path in root.rglob("*") if path.is_file())


def test_door_b_serves_the_published_tree_and_nothing_else(tmp_path: Path, sshd: Sshd) -> None:
    served = served_run(tmp_path)
    sshd.authorize(f'restrict,command="{door_fetch(served, tmp_path / "door-fetch")}"')

    plain = pull(sshd, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    got = tmp_path / "plain"
    assert (got / MANIFEST).is_file() and (got / "pkg" / "train.py").is_file()
    # The door's root is the tree: the publish's scratch is not there to ask for.
    assert not {"gate", "incoming", "checkout", "tree"} & {p.name for p in got.iterdir()}
    assert (got / "shared").is_symlink() and not holds_secret(got)

    for options, refusal in (
        (("--copy-unsafe-links",), "the rsync option --copy-unsafe-links is not served"),
        (("-L",), "follow links"),
        (("--copy-dirlinks",), "follow links"),  # sent as -k
        (("--files-from", str(tmp_path / "list")), "--files-from is not served"),
    ):
        (tmp_path / "list").write_text("shared/secret.txt\n")
        into = tmp_path / "try"
        shutil.rmtree(into, ignore_errors=True)
        tried = pull(sshd, into, *options)
        refused = tried.returncode != 0 and "flodl door: " in tried.stderr and refusal in tried.stderr
        assert refused, (options, tried.stderr)
        assert not into.exists() or not holds_secret(into)

    for outside in ("/../", "/shared/", "/../gate/"):
        into = tmp_path / "out"
        tried = pull(sshd, into, path=outside)
        assert not into.exists() or not holds_secret(into), outside
    assert "do not use .." in pull(sshd, tmp_path / "up", path="/../gate/").stderr  # rrsync's own check

    pushed = subprocess.run(
        ["rsync", "-e", shlex.join(sshd.client), str(tmp_path / "secret.txt"), "root@127.0.0.1:/x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert pushed.returncode != 0 and not (served / "tree" / "x").exists()
    shell = sshd.ssh("cat", str(tmp_path / "secret.txt"))
    assert shell.returncode != 0 and SECRET not in shell.stdout
    assert "flodl door: no shell, no commands and no uploads" in shell.stderr


def test_a_key_line_without_its_options_still_gets_only_the_pull(tmp_path: Path) -> None:
    served = served_run(tmp_path)
    fetch = door_fetch(served, tmp_path / "door-fetch")
    # The role's door: ForceCommand in the sshd configuration, whatever the key line says.
    with sshd_kit.serve(tmp_path / "sshd", extra=f"ForceCommand {fetch}\nPermitUserRC no\n") as door:
        door.authorize()  # a bare key line: no restrict, no command=
        shell = door.ssh("cat", str(tmp_path / "secret.txt"))
        assert shell.returncode != 0 and SECRET not in shell.stdout and "flodl door" in shell.stderr
        login = door.ssh(stdin=f"cat {tmp_path / 'secret.txt'}\n")  # no command: a login shell
        assert login.returncode != 0 and SECRET not in login.stdout and "flodl door: no shell" in login.stderr
        fetched = pull(door, tmp_path / "got")
        assert fetched.returncode == 0 and (tmp_path / "got" / MANIFEST).is_file()
    # And as a login shell read by an sshd with no forced command at all (sshd runs SHELL -c CMD).
    env = {key: value for key, value in os.environ.items() if key != "SSH_ORIGINAL_COMMAND"}
    for argv in ([str(fetch), "-c", f"cat {tmp_path / 'secret.txt'}"], [str(fetch)]):
        ran = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
        assert ran.returncode == 1 and SECRET not in ran.stdout and "flodl door" in ran.stderr
