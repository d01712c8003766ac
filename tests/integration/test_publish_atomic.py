"""fdl publish replaces the served run whole or not at all: every refusal leaves it byte for
byte, the swap is one step, and a pull already inside the old tree reads the old run whole."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from flodl_agent.cli.main import cli
from flodl_agent.fleet import publish as publishing
from flodl_agent.fleet.publish import PublishReport, publish
from flodl_agent.sources.manifest import DIGEST_FILE, MANIFEST, PublishError, read_manifest, verify
from tests.integration.test_publish import project, request, snapshot

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def standing(tmp_path: Path) -> tuple[Path, Path, PublishReport]:
    """A served run (pkg/train.py its entry) and a next version of the source beside it."""
    src, served = project(tmp_path / "src"), tmp_path / "served"
    report = publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    (src / "pkg" / "train.py").write_text("print('the next version')\n")
    return src, served, report


def outward(src: Path) -> None:
    (src / "pkg" / "shared").symlink_to("../../..")


def unbuilt(src: Path) -> None:
    (src / "pkg" / "train.py").unlink()


# Each way a publish is refused, from the first check to the last step before the swap.
REFUSALS = {
    "bin absolute (no fetch)": ({"bin": "/bin/true"}, None, "bin: /bin/true is an absolute path"),
    "cwd out (no fetch)": ({"cwd": "../.."}, None, "cwd: ../.. leads out of the tree"),
    "probe without bin (no fetch)": ({"bin": None, "model_probe": True}, None, "--model-probe needs"),
    "no source": ({"spec": "file:///nowhere/at/all"}, None, "no such directory on this box"),
    "a link out": ({}, outward, "symlink(s) that lead out of it"),
    "bin missing": ({}, unbuilt, "bin: train.py is not in the fetched source"),
    "build fails": ({"build": "exit 3"}, None, "`exit 3` exited 3"),
    "build makes no bin": ({"bin": "model.bin", "build": "true"}, None, "the build succeeded but bin"),
}


@pytest.mark.parametrize(("change", "spoil", "said"), REFUSALS.values(), ids=REFUSALS.keys())
def test_a_refused_publish_leaves_the_served_run_byte_identical_and_names_it(
    tmp_path: Path, change: dict[str, object], spoil: object, said: str
) -> None:
    src, served, first = standing(tmp_path)
    tree = served / "tree"
    before, inode = snapshot(tree), tree.stat().st_ino
    if callable(spoil):
        spoil(src)
    kw: dict[str, object] = {"cwd": "pkg", "bin": "train.py", **change}
    spec = str(kw.pop("spec", f"file://{src}"))
    with pytest.raises(PublishError) as caught:
        publish(request(spec, served, **kw))
    assert said in caught.value.message
    assert snapshot(tree) == before and tree.stat().st_ino == inode  # never swapped, never touched
    shown = caught.value.render()
    assert f"nothing was published; the served run is unchanged: run {first.manifest.run} (file://" in shown
    assert not (served / "staging").exists()


@pytest.mark.parametrize("change", [{"bin": "/bin/true"}, {"cwd": "../.."}], ids=["bin", "cwd"])
def test_what_needs_no_fetch_is_refused_before_the_fetch(tmp_path: Path, change: dict[str, object]) -> None:
    src, served, _ = standing(tmp_path)
    fetched = snapshot(served / "incoming")
    with pytest.raises(PublishError):
        publish(request(f"file://{src}", served, **{"cwd": "pkg", "bin": "train.py", **change}))
    assert snapshot(served / "incoming") == fetched  # the next version was never fetched


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_pull_inside_the_old_tree_reads_the_old_run_whole_and_a_new_one_the_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    src, served, first = standing(tmp_path)
    if not exchange:  # a kernel, a filesystem (NFS) or a filter without RENAME_EXCHANGE
        monkeypatch.setattr(publishing, "_exchange", lambda *_: False)
    old = snapshot(served / "tree")
    # rrsync behind door B changes into the tree before it reads a file: hold it open so.
    pulling = os.open(served / "tree", os.O_RDONLY | os.O_DIRECTORY)
    try:
        second = publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
        inside = Path(f"/proc/self/fd/{pulling}")
        assert (inside / "pkg" / "train.py").read_text() == "print('train')\n"
        assert snapshot(inside) == old
    finally:
        os.close(pulling)
    new = read_manifest(served / "tree")
    assert new == second.manifest and new.run != first.manifest.run
    assert (served / "tree" / "pkg" / "train.py").read_text() == "print('the next version')\n"
    assert verify(served / "tree", new) == []
    assert snapshot(served / "previous") == old  # kept for the pulls under way, until the next publish


def test_an_unchanged_file_is_linked_not_copied_and_the_old_run_keeps_its_own(tmp_path: Path) -> None:
    src, served, _ = standing(tmp_path)
    old = snapshot(served / "tree")
    kept = (served / "tree" / "README").stat().st_ino
    publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    assert (served / "tree" / "README").stat().st_ino == kept
    # The new tree's manifest and sidecar are files of its own: the old run's stay its own.
    assert snapshot(served / "previous") == old
    for name in (MANIFEST, DIGEST_FILE):
        assert (served / "tree" / name).stat().st_ino != (served / "previous" / name).stat().st_ino


def test_the_served_tree_keeps_the_mode_and_owner_the_role_gave_it(tmp_path: Path) -> None:
    src, served, _ = standing(tmp_path)
    tree = served / "tree"
    tree.chmod(0o750)
    owner = (65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    if os.geteuid() == 0:
        os.chown(tree, *owner)
    publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    now = tree.stat()
    assert (now.st_mode & 0o7777, now.st_uid, now.st_gid) == (0o750, *owner)


def test_a_staging_tree_a_killed_publish_left_is_never_served_and_goes_next_time(tmp_path: Path) -> None:
    src, served, _ = standing(tmp_path)
    (served / "staging" / "pkg").mkdir(parents=True)
    (served / "staging" / "pkg" / "half.py").write_text("cut short\n")
    (served / "staging" / "pkg").chmod(0o500)  # rsync -a keeps a source's read-only directory
    publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    assert not (served / "tree" / "pkg" / "half.py").exists() and not (served / "staging").exists()


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_tree_path_that_is_not_a_directory_of_its_own_is_refused_untouched(
    tmp_path: Path, kind: str
) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    served.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "file":
        (served / "tree").write_text("not a tree\n")
    else:
        (served / "tree").symlink_to(elsewhere)
    with pytest.raises(PublishError) as caught:
        publish(request(f"file://{src}", served))
    assert "is not a directory of its own" in caught.value.message
    assert not (served / "incoming").exists() and list(elsewhere.iterdir()) == []


def test_the_cli_says_the_served_run_is_unchanged_in_words_and_in_json(tmp_path: Path) -> None:
    src, served, first = standing(tmp_path)
    runner = CliRunner()
    args = ["publish", f"file://{src}", "--to", str(served), "--cwd", "pkg", "--bin", "../../bin/true"]
    said = runner.invoke(cli, args)
    assert said.exit_code == 1
    assert "nothing was published; the served run is unchanged: run " + first.manifest.run in said.output
    shown = runner.invoke(cli, [*args, "--json"])
    assert shown.exit_code == 1
    report = json.loads(shown.output)
    assert not report["published"] and report["served"].startswith(f"run {first.manifest.run} (file://{src}")
    assert read_manifest(served / "tree") == first.manifest
