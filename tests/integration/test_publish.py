"""fdl publish: every transport into the served tree, the digest, the gate, the commit point."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from flodl_agent.cli.main import cli
from flodl_agent.fleet.publish import PublishRequest, publish
from flodl_agent.sources.manifest import DIGEST_FILE, MANIFEST, PublishError, read_manifest, verify
from flodl_agent.sources.spec import parse_source
from tests.support.sshd import Sshd

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")


def project(root: Path) -> Path:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "pkg" / "train.py").write_text("print('train')\n")
    (root / "README").write_text("a training project\n")
    (root / "pkg" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"\x00")
    (root / ".venv" / "bin" / "python").write_text("not ours to publish\n")
    return root


def snapshot(tree: Path) -> dict[str, bytes]:
    """Every file of ``tree`` and its bytes: what a box fetching it would get."""
    return {p.relative_to(tree).as_posix(): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def request(spec: str, served: Path, **kw: object) -> PublishRequest:
    return PublishRequest(source=parse_source(spec), served=served, **kw)  # type: ignore[arg-type]


def test_a_file_source_is_mirrored_digested_gated_and_committed(tmp_path: Path) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    build = 'test -f train.py && python -c \'open("model.bin", "w").write("built")\''
    report = publish(
        request(f"file://{src}", served, cwd="pkg", bin="model.bin", build=build, args=["--lr", "1"])
    )
    tree = served / "tree"
    manifest = read_manifest(tree)
    assert manifest == report.manifest and manifest is not None
    assert (manifest.cwd, manifest.bin, manifest.args, manifest.built) == (
        "pkg",
        "model.bin",
        ["--lr", "1"],
        True,
    )
    assert manifest.origin == f"file://{src}" and len(manifest.run) == 32
    # Caches and virtualenvs stay behind; the gate's build output stays in the gate's copy.
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == sorted(
        [MANIFEST, DIGEST_FILE, "README", "pkg/train.py"]
    )
    assert (served / "gate" / "pkg" / "model.bin").read_text() == "built"
    # The sidecar is sha256sum's own format: the real tool checks a copy.
    checked = subprocess.run(["sha256sum", "-c", DIGEST_FILE], cwd=tree, capture_output=True, text=True)
    assert checked.returncode == 0 and "./pkg/train.py: OK" in checked.stdout
    assert verify(tree, manifest) == []
    (tree / "README").write_text("tampered\n")
    assert verify(tree, manifest) == ["./README"]

    # A republish follows the source (deletions too) and mints a new run identity.
    (src / "README").unlink()
    again = publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    assert not (tree / "README").exists() and again.manifest.run != manifest.run
    assert again.manifest.built is False and again.manifest.args == []


def test_a_failed_gate_leaves_the_served_run_as_it_was_and_says_so(tmp_path: Path) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    first = publish(request(f"file://{src}", served))
    before = snapshot(served / "tree")
    (src / "README").write_text("the next version\n")
    with pytest.raises(PublishError) as caught:
        publish(
            request(f"file://{src}", served, build="echo compiling; echo 'error: no such crate' >&2; exit 3")
        )
    assert "the source does not build" in caught.value.message and "exited 3" in caught.value.message
    assert "| error: no such crate" in caught.value.message
    # A box dialling now still finds the run it had: every byte and file of it, and the error says which.
    assert snapshot(served / "tree") == before
    assert f"the served run is unchanged: run {first.manifest.run} (file://{src}" in caught.value.render()
    assert not (served / "staging").exists()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cwd": "nowhere"}, "cwd: nowhere names no directory in the fetched source"),
        ({"cwd": "../.."}, "cwd: ../.. leads out of the tree"),
        ({"cwd": "pkg", "bin": "train", "build": "true"}, "the build succeeded but bin: train is not there"),
        ({"cwd": "pkg", "bin": "missing.py"}, "bin: missing.py is not in the fetched source"),
    ],
)
def test_a_tree_that_cannot_run_is_refused_by_name(
    tmp_path: Path, kw: dict[str, object], message: str
) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    with pytest.raises(PublishError) as caught:
        publish(request(f"file://{src}", served, **kw))
    assert message in caught.value.message
    assert read_manifest(served / "tree") is None


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_git_source_is_the_pinned_ref_not_the_branch_tip(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("v1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "v1")
    git(repo, "tag", "v1")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("v2\n")
    git(repo, "commit", "-qam", "v2")
    served = tmp_path / "served"
    report = publish(request(f"git+file://{repo}#v1", served, bin="train.py"))
    assert (served / "tree" / "train.py").read_text() == "v1\n"
    assert report.manifest.origin == f"git+file://{repo}#v1 ({first})"
    assert not (served / "tree" / ".git").exists()
    # A commit id pins too; publishing it again moves the tree.
    second = git(repo, "rev-parse", "HEAD")
    publish(request(f"git+file://{repo}#{second}", served, bin="train.py"))
    assert (served / "tree" / "train.py").read_text() == "v2\n"
    with pytest.raises(PublishError, match="`no-such-tag` is not a branch, tag or commit"):
        publish(request(f"git+file://{repo}#no-such-tag", served))


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_git_publish_holds_the_pinned_commit_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "secret.txt").write_text("deleted later, still in the history\n")
    (repo / "train.py").write_text("v1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "with the secret")
    leaked = git(repo, "rev-parse", "HEAD")
    git(repo, "rm", "-q", "secret.txt")
    git(repo, "commit", "-qm", "without it")
    pinned = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-qb", "unpublished")
    (repo / "wip.txt").write_text("not for the fleet\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "wip")
    unpublished = git(repo, "rev-parse", "HEAD")
    served = tmp_path / "served"
    for ref in ("main", pinned):
        report = publish(request(f"git+file://{repo}#{ref}", served, bin="train.py"))
        assert report.manifest.origin.endswith(f"({pinned})")
        checkout = served / "checkout"
        # One commit, shallow, and no ref of its own: neither the history nor the other branch.
        assert git(checkout, "rev-list", "--all", "--count") == "1"
        assert git(checkout, "for-each-ref") == ""
        for absent in (leaked, unpublished):
            missing = subprocess.run(["git", "-C", str(checkout), "cat-file", "-e", absent], check=False)
            assert missing.returncode != 0
        assert sorted(p.name for p in (served / "tree").iterdir()) == sorted(
            [DIGEST_FILE, MANIFEST, "train.py"]
        )
    # An abbreviated id cannot be fetched exactly (the old fallback pulled every ref): refused.
    with pytest.raises(PublishError) as caught:
        publish(request(f"git+file://{repo}#{unpublished[:10]}", served))
    assert caught.value.message.endswith(
        f"`{unpublished[:10]}` is an abbreviated commit id: a fetch names a commit only in full"
    )
    assert f"git rev-parse {unpublished[:10]}" in caught.value.fix
    assert subprocess.run(["git", "-C", str(served / "checkout"), "cat-file", "-e", unpublished]).returncode


def links(root: Path, **made: str) -> Path:
    for name, target in made.items():
        path = root / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
    return root


@pytest.mark.parametrize(
    ("made", "named"),
    [
        ({"shared": "../../.."}, "shared -> ../../.."),
        ({"etc": "/etc"}, "etc -> /etc"),
        ({"loop": "loop"}, "loop -> loop"),  # resolves nowhere
        # Each link alone stays in; the second goes through the first and out (resolved as the kernel does).
        ({"pkg__up": "..", "out": "pkg/up/.."}, "out -> pkg/up/.."),
    ],
)
def test_a_source_whose_links_leave_it_publishes_nothing(
    tmp_path: Path, made: dict[str, str], named: str
) -> None:
    src, served = links(project(tmp_path / "src"), **made), tmp_path / "served"
    with pytest.raises(PublishError) as caught:
        publish(request(f"file://{src}", served, cwd="pkg", bin="train.py"))
    assert "symlink(s) that lead out of it" in caught.value.message and named in caught.value.message
    assert "self-contained" in caught.value.fix
    # Refused before the door could serve any of it.
    assert not (served / "tree").exists()


def test_links_inside_the_tree_are_published_as_links(tmp_path: Path) -> None:
    src = links(
        project(tmp_path / "src"), alias="pkg/train.py", pkg__up="..", venv__bin__python="/usr/bin/python3"
    )
    served = tmp_path / "served"
    publish(request(f"file://{src}", served, cwd="pkg", bin="up/pkg/train.py"))  # venv/ is never published
    tree = served / "tree"
    assert (tree / "alias").readlink() == Path("pkg/train.py") and not (tree / "venv").exists()


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("/bin/true", "is an absolute path"),
        ("../../../../bin/true", "leads out of the tree"),
        ("up/../../bin/true", "leads out of the tree through a symlink"),  # pkg/up -> .. (the root)
    ],
)
def test_bin_names_a_path_inside_the_tree(tmp_path: Path, entry: str, why: str) -> None:
    src, served = links(project(tmp_path / "src"), pkg__up=".."), tmp_path / "served"
    with pytest.raises(PublishError) as caught:
        publish(request(f"file://{src}", served, cwd="pkg", bin=entry))
    assert caught.value.message == f"bin: {entry} {why} (cwd pkg)"
    assert read_manifest(served / "tree") is None


def test_the_served_directory_and_a_file_source_never_hold_each_other(tmp_path: Path) -> None:
    src = project(tmp_path / "src")
    for served, spec in (
        (src / "run", f"file://{src}"),
        (tmp_path / "served", f"file://{tmp_path / 'served'}/tree"),
    ):
        with pytest.raises(PublishError) as caught:
            publish(request(spec, served))
        assert "hold one another" in caught.value.message
    assert not (src / "run").exists()  # refused before anything was made


def test_an_rsync_source_comes_over_ssh_with_the_host_key_pinned(tmp_path: Path, sshd: Sshd) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    spec = f"rsync://root@127.0.0.1:{sshd.port}:{src}"
    req = request(spec, served, identity=str(sshd.client_key), ssh_options=tuple(sshd.options), bin="README")
    publish(req)
    assert (served / "tree" / "pkg" / "train.py").read_text() == "print('train')\n"
    # A host key that does not match the pin stops the fetch: nothing is published.
    sshd.known_hosts.write_text(
        f"[127.0.0.1]:{sshd.port} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + "A" * 43 + "\n"
    )
    before = snapshot(served / "tree")
    with pytest.raises(PublishError, match="fetching") as caught:
        publish(req)
    assert snapshot(served / "tree") == before and "the served run is unchanged: run" in caught.value.render()


def test_the_cli_takes_defaults_from_the_publish_block_and_a_dash_tail_replaces_args(tmp_path: Path) -> None:
    src = project(tmp_path / "src")
    served = tmp_path / "served"
    (tmp_path / "fdl.yml").write_text(
        yaml.safe_dump(
            {
                "publish": {
                    "source": f"file://{src}",
                    "cwd": "pkg",
                    "bin": "train.py",
                    "to": str(served),
                    "args": ["--epochs", "3"],
                }
            }
        )
    )
    runner = CliRunner()
    config = ["--config", str(tmp_path / "fdl.yml")]
    shown = runner.invoke(cli, ["publish", *config, "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["published"] and report["manifest"]["args"] == ["--epochs", "3"]
    assert report["fetch"]["rrsync"].endswith(":/") and report["fetch"]["plain"].endswith(f":{served}/tree")
    emptied = runner.invoke(cli, ["publish", *config, "--json", "--"])
    assert json.loads(emptied.output)["manifest"]["args"] == []  # `--` with nothing after it: no args
    flagged = runner.invoke(cli, ["publish", *config, "--cwd", ".", "--bin", "README", "--", "--lr", "2"])
    assert flagged.exit_code == 0 and "published" in flagged.output
    manifest = read_manifest(served / "tree")
    assert manifest is not None and (manifest.cwd, manifest.bin, manifest.args) == (
        ".",
        "README",
        ["--lr", "2"],
    )
    failed = runner.invoke(cli, ["publish", *config, "--build", "exit 1"])
    assert failed.exit_code == 1 and "the source does not build" in failed.output
    unpinned = runner.invoke(cli, ["publish", f"git+file://{src}"])
    assert unpinned.exit_code == 2 and "pins no ref" in unpinned.output


def test_python_builds_run_in_this_venv(tmp_path: Path) -> None:
    src, served = project(tmp_path / "src"), tmp_path / "served"
    check = f"import sys; assert sys.prefix == {sys.prefix!r}, sys.prefix"
    publish(request(f"file://{src}", served, build=f"python -c {shlex.quote(check)}"))
