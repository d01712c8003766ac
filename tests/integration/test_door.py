"""Door B against the real thing: an OpenSSH server whose key line (or ForceCommand) runs the
controller role's door program, the real rrsync behind it, and a real rsync client asking for
more than the published tree."""

from __future__ import annotations

import ctypes
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


# --- Filter rules: the merge-file leak -------------------------------------------------------
# A client's filter rules travel inside the rsync protocol: a `dir-merge` rule naming a file
# above the tree makes the sender open it and read its lines as rules (the first bad one printed
# back, `Unknown filter rule: ...`; with the `-` modifier every line an exclude pattern, so which
# of the tree's files go missing tells the lines). Door B confines the pull to the tree
# (Landlock, else rrsync's --confine-root); the control is the same server unconfined.

# rrsync as rsync 3.2.7 ships it, as far as merge files go: the request, run in the tree, and
# nothing bounding what the sender opens. It lives in the tree: under Landlock the pull reads
# nothing else (door_fetch runs it with python3 as it runs rrsync).
UNCONFINED_RRSYNC = """import os, sys
os.chdir(sys.argv[-1])
words = os.environ["SSH_ORIGINAL_COMMAND"].split()
dot = words.index(".")
os.execv("/usr/bin/rsync", words[: dot + 1] + ["./" + word.lstrip("/") for word in words[dot + 1 :]])
"""
ORACLE = "train.py"  # a line that, read as an exclude pattern, takes a file out of the pull


def landlock_available() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1))) >= 1


def ancestors_with_secrets(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A published run at <tmp>/opt/flodl/run (the role's layout: the service user's home above
    it), and in every directory above its tree a `.bashrc` whose first line is no filter rule
    (and holds the secret) and a `names` file whose line names a file of the tree."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / ORACLE).write_text("print('train')\n")
    served = tmp_path / "opt" / "flodl" / "run"
    publish(PublishRequest(parse_source(f"file://{src}"), served, bin=ORACLE, cwd="pkg", build="true"))
    (served / "tree" / "unconfined-rrsync").write_text(UNCONFINED_RRSYNC)
    ancestors = [tmp_path / "opt", tmp_path / "opt" / "flodl", served]
    for where in ancestors:
        (where / ".bashrc").write_text(f"case $- in  # {SECRET}\n")
        (where / "names").write_text(f"{ORACLE}\n")
    return served, ancestors


def merge_rules(ancestors: list[Path]) -> list[str]:
    """dir-merge rules, plain and with `-`, naming each ancestor's files absolutely and by
    climbing from the tree, and a file elsewhere (/etc/passwd)."""
    rules = []
    for where in ancestors:
        for name in (".bashrc", "names"):
            rules += [f"dir-merge {where / name}", f"dir-merge,- {where / name}", f":- {where / name}"]
    for up in range(1, len(ancestors) + 1):
        rules += [f"dir-merge {'../' * up}names", f"dir-merge,- {'../' * up}names"]
    return [*rules, "dir-merge /etc/passwd", "dir-merge,- /etc/passwd", f"dir-merge {'../' * 12}etc/passwd"]


def planted_merges(served: Path, ancestors: list[Path]) -> list[str]:
    """`merge` rules the sender itself parses (a stock client reads a `merge` file on its own
    box): lines of a rules file in the tree, which a `dir-merge` rule names."""
    names: list[str] = []
    for where in ancestors:
        for rule in (f"merge {where / 'names'}", f"merge,- {where / 'names'}", f"merge {where / '.bashrc'}"):
            name = f"rules.{len(names)}"
            (served / "tree" / name).write_text(f"{rule}\n")
            names.append(f"dir-merge {name}")
    return names


def leak(got: subprocess.CompletedProcess[str], into: Path) -> str | None:
    """What of an ancestor's file came back, if anything."""
    if SECRET in got.stderr or "Unknown filter rule" in got.stderr:
        return f"its lines, in stderr: {got.stderr.strip()[-300:]}"
    if into.exists() and holds_secret(into):
        return "its lines, in the pulled files"
    if got.returncode == 0 and not (into / "pkg" / ORACLE).exists():
        return f"its lines, as the tree's {ORACLE} gone missing"
    return None


def attempt(door: Sshd, tmp_path: Path, *rules: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    into = tmp_path / "attempt"
    shutil.rmtree(into, ignore_errors=True)
    return pull(door, into, *(f"--filter={rule}" for rule in rules)), into


def test_an_unconfined_sender_leaks_every_ancestor_through_merge_rules(tmp_path: Path) -> None:
    """The control: without the door's confinement these rules do read the ancestors' files."""
    served, ancestors = ancestors_with_secrets(tmp_path)
    tree = served / "tree"
    plain = f"/usr/bin/python3 -I -S {tree / 'unconfined-rrsync'} -ro {tree}"
    planted = planted_merges(served, ancestors)
    with sshd_kit.serve(tmp_path / "sshd", extra=f"ForceCommand {plain}\n") as door:
        for up, where in enumerate(reversed(ancestors), start=1):
            climb = f"dir-merge,- {'../' * up}names"  # from the tree up to this ancestor
            for rule in (f"dir-merge {where / '.bashrc'}", f"dir-merge,- {where / 'names'}", climb):
                assert leak(*attempt(door, tmp_path, rule)), rule
        for rule in planted:
            assert leak(*attempt(door, tmp_path, rule)), (rule, (tree / rule.split()[1]).read_text())


def door_holds(door: Sshd, tmp_path: Path, served: Path, ancestors: list[Path]) -> None:
    # One pull with every dir-merge rule: a file read in plain form aborts it (its line is no
    # rule), and one read with `-` takes the oracle out; so a clean, whole pull read nothing.
    got, into = attempt(door, tmp_path, *merge_rules(ancestors))
    assert got.returncode == 0 and leak(got, into) is None, got.stderr
    assert (into / MANIFEST).is_file() and (into / "pkg" / ORACLE).is_file()
    for rule in planted_merges(served, ancestors):  # each stops its own pull: the file is not opened
        got, into = attempt(door, tmp_path, rule)
        assert leak(got, into) is None, (rule, got.stderr)
    honest = pull(door, tmp_path / "honest", "--checksum", "--delete", "--exclude=.git")
    assert honest.returncode == 0 and (tmp_path / "honest" / "pkg" / ORACLE).is_file(), honest.stderr


@pytest.mark.parametrize("rrsync", ["box", "unconfined"])
def test_door_b_reads_no_file_above_the_tree_whatever_the_filter_rules(tmp_path: Path, rrsync: str) -> None:
    """Door B with the box's rrsync, and with one that confines nothing (rsync 3.2.7's): the
    door's own Landlock keeps every file above the tree shut either way."""
    if rrsync == "unconfined" and not landlock_available():
        pytest.skip("this kernel has no Landlock: door B then needs rrsync's --confine-root (rsync 3.5.0+)")
    served, ancestors = ancestors_with_secrets(tmp_path)
    stand_in = served / "tree" / "unconfined-rrsync" if rrsync == "unconfined" else None
    fetch = door_fetch(served, tmp_path / "door-fetch", rrsync=stand_in)
    with sshd_kit.serve(tmp_path / "sshd", extra=f"ForceCommand {fetch}\n") as door:
        door_holds(door, tmp_path, served, ancestors)


def test_without_landlock_door_b_leans_on_rrsyncs_confinement_or_serves_nothing(tmp_path: Path) -> None:
    """A unit whose system-call filter refuses Landlock: the box's rrsync must confine the
    sender itself (--confine-root, rsync 3.5.0+), and one that cannot gets no pull at all."""
    served, ancestors = ancestors_with_secrets(tmp_path)
    box = door_fetch(served, tmp_path / "door-fetch")
    unconfined = door_fetch(served, tmp_path / "door-fetch-old", rrsync=served / "tree" / "unconfined-rrsync")
    with sshd_kit.serve(tmp_path / "sshd", extra=f"ForceCommand {unconfined}\n", no_landlock=True) as door:
        got, into = attempt(door, tmp_path, f"dir-merge {ancestors[1] / '.bashrc'}")
        assert got.returncode != 0 and leak(got, into) is None and not into.exists()
        assert "flodl door: this box cannot confine a pull to the published tree" in got.stderr
    if b"--confine-root" not in Path("/usr/bin/rrsync").read_bytes():
        return  # this box's rrsync predates it: the refusal above is all door B does here
    with sshd_kit.serve(tmp_path / "sshd2", extra=f"ForceCommand {box}\n", no_landlock=True) as door:
        door_holds(door, tmp_path, served, ancestors)
