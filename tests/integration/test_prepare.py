"""Preparing a box before every dial: fetch the published run, check it, build it —
and every failure classed and worded as the troubleshooting guide has it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.agent.prepare import PERMANENT, TRANSIENT, PrepareFailure, missing_package, prepare
from flodl_agent.config.models import Source, Ssh
from flodl_agent.controller.controller import Controller
from flodl_agent.fleet.publish import PublishRequest, publish
from flodl_agent.sources.manifest import MANIFEST, read_manifest
from flodl_agent.sources.spec import parse_source
from tests.support.control_plane import agent, run, settings, until, walk_in
from tests.support.sshd import Sshd, door_fetch

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")

TRAIN = """
import json, os, sys
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "rank": os.environ.get("RANK")},
          open(os.path.join(os.environ["OUT"], os.environ.get("RANK", "x")), "w"))
"""


def published(tmp_path: Path, *, build: str | None = None, args: tuple[str, ...] = ("--lr", "1")) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True, exist_ok=True)
    (src / "pkg" / "train.py").write_text(TRAIN)
    served = tmp_path / "served"
    publish(
        PublishRequest(
            parse_source(f"file://{src}"), served, bin="train.py", cwd="pkg", build=build, args=list(args)
        )
    )
    return served


def source(served: Path, **kw: str) -> Source:
    return Source.model_validate({"from": f"file://{served}/tree", **kw})


def failure(call: object) -> PrepareFailure:
    with pytest.raises(PrepareFailure) as caught:
        call()  # type: ignore[operator]
    return caught.value


def test_a_published_run_is_fetched_built_once_per_digest_and_the_manifest_wins(tmp_path: Path) -> None:
    count = tmp_path / "builds"
    served = published(tmp_path, build=f"echo built >> {count}")
    logs: list[str] = []
    stage = tmp_path / "stage"
    local = source(served, cwd=".", bin="other.py")
    ready = prepare(local, stage, local_args=["--lr", "9"], log=logs.append)
    manifest = read_manifest(served / "tree")
    assert manifest is not None and ready.run == manifest.run
    assert ready.command == [sys.executable, str(stage / "build" / "pkg" / "train.py"), "--lr", "1"]
    assert ready.cwd == stage / "build" / "pkg"
    assert any("manifest's args (['--lr', '1']) replaces this box's (['--lr', '9'])" in line for line in logs)
    assert any("manifest's bin ('train.py') replaces this box's ('other.py')" in line for line in logs)
    # A re-dial into the same run costs a fetch and a checksum, not a build.
    prepare(local, stage)
    assert count.read_text() == "built\n" * 2  # the publish gate's build, then this box's one
    # A new publish is picked up on the next dial, with nothing edited here.
    (tmp_path / "src" / "pkg" / "train.py").write_text(TRAIN + "\n# v2\n")
    publish(
        PublishRequest(
            parse_source(f"file://{tmp_path / 'src'}"),
            served,
            bin="train.py",
            cwd="pkg",
            build=f"echo built >> {count}",
            args=["--lr", "2"],
        )
    )
    again = prepare(local, stage)
    assert again.command[-1] == "2" and again.run != ready.run and count.read_text() == "built\n" * 4


def test_no_manifest_is_a_quiet_wait_unless_the_box_names_its_own_artifact(tmp_path: Path) -> None:
    served = published(tmp_path)
    (served / "tree" / MANIFEST).unlink()  # a publish in flight: its gate is still building
    wait = failure(lambda: prepare(source(served), tmp_path / "stage"))
    assert wait.code == TRANSIENT
    assert wait.message == "the fetched source carries no run manifest and this box declares no artifact"
    own = prepare(source(served, cwd="pkg", bin="train.py"), tmp_path / "stage", local_args=["--own"])
    assert own.run == "" and own.command[-2:] == [
        str(tmp_path / "stage" / "build" / "pkg" / "train.py"),
        "--own",
    ]


def test_a_node_build_learns_the_variant_it_builds_for_and_rebuilds_for_another(tmp_path: Path) -> None:
    served = published(tmp_path)
    (served / "tree" / MANIFEST).unlink()  # this box's own build line, as join.source.build names it
    line = 'echo "$FDL_TORCH_VARIANT/$FDL_GPU_FEATURE" >> variants'
    spec = source(served, cwd="pkg", build=line, bin="train.py")
    built = tmp_path / "stage" / "build" / "pkg"
    prepare(spec, tmp_path / "stage", variant="rocm6.4")
    prepare(spec, tmp_path / "stage", variant="rocm6.4")  # the same digest, line and variant: no build
    assert (built / "variants").read_text().split() == ["rocm6.4/rocm"]
    prepare(spec, tmp_path / "stage", variant="cu128")  # the box's offer changed: built afresh for it
    assert (built / "variants").read_text().split() == ["cu128/cuda"]
    prepare(spec, tmp_path / "stage")  # cpu: the feature list is empty, the default build
    assert (built / "variants").read_text().split() == ["cpu/"]


def test_a_tree_fetched_across_a_publish_boundary_is_refused_until_it_matches(tmp_path: Path) -> None:
    served = published(tmp_path)
    (served / "tree" / "pkg" / "train.py").write_text("half of the next publish\n")
    torn = failure(lambda: prepare(source(served), tmp_path / "stage"))
    assert torn.code == TRANSIENT and "differs from the published digest (./pkg/train.py)" in torn.message


@pytest.mark.parametrize(
    ("build", "code", "words", "fix"),
    [
        (
            "echo oops >&2; exit 4",
            TRANSIENT,
            "the source does not build: `echo oops >&2; exit 4` exited 4",
            "publish again",
        ),
        ("PATH=/nowhere cmake -S .", PERMANENT, "the source does not build", "apt-get install cmake"),
    ],
)
def test_a_build_that_fails_is_transient_unless_a_system_package_is_missing(
    tmp_path: Path, build: str, code: int, words: str, fix: str
) -> None:
    served = published(tmp_path)
    # The manifest's build (none here) is the authority: the local build line does not run.
    prepare(source(served, build=build, bin="train.py"), tmp_path / "stage")
    (served / "tree" / MANIFEST).unlink()  # without one, this box's own settings build
    failed = failure(
        lambda: prepare(source(served, cwd="pkg", build=build, bin="train.py"), tmp_path / "stage")
    )
    assert failed.code == code and words in failed.message and fix in failed.fix


def test_paths_that_cannot_exist_are_permanent(tmp_path: Path) -> None:
    served = published(tmp_path)
    (served / "tree" / MANIFEST).unlink()
    stage = tmp_path / "stage"
    cwd = failure(lambda: prepare(source(served, cwd="nowhere", bin="x"), stage))
    assert cwd.code == PERMANENT and cwd.message == "cwd: nowhere names no directory in the fetched source"
    entry = failure(lambda: prepare(source(served, cwd="pkg", build="true", bin="target/train"), stage))
    assert entry.code == PERMANENT
    assert entry.message == "the build succeeded but bin: target/train is not there (looked in pkg/)"


def test_a_manifest_whose_entry_point_leaves_the_tree_is_refused(tmp_path: Path) -> None:
    served = published(tmp_path)
    written = served / "tree" / MANIFEST
    manifest = yaml.safe_load(written.read_text())
    for entry, why in (
        ("/bin/true", "is an absolute path"),
        ("../../../../bin/true", "leads out of the tree"),
    ):
        written.write_text(yaml.safe_dump(manifest | {"bin": entry}))  # the manifest is not in the digest
        refused = failure(lambda: prepare(source(served), tmp_path / "stage"))
        # The published run's own failure: transient, so a publish that fixes it is picked up.
        assert refused.code == TRANSIENT and refused.message.startswith(f"bin: {entry} {why} (cwd pkg)")
    (served / "tree" / MANIFEST).unlink()  # this box's own join.source.bin: what is wrong is the box's
    local = failure(lambda: prepare(source(served, cwd="pkg", bin="/bin/true"), tmp_path / "stage"))
    assert local.code == PERMANENT and local.fix.endswith("fix join.source.bin")


def test_a_published_run_without_an_entry_point_is_that_runs_failure_not_the_boxs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("a tree-only publish")
    served = tmp_path / "served"
    publish(PublishRequest(parse_source(f"file://{src}"), served))  # no --bin
    missing = failure(lambda: prepare(source(served), tmp_path / "stage"))
    # A publish with --bin fixes it: a --persist walk-in re-dials rather than stopping.
    assert missing.code == TRANSIENT and missing.message == "the run names no entry point (bin)"
    assert "publish with --bin" in missing.fix


def test_missing_packages_are_named_from_the_shells_words() -> None:
    assert missing_package("sh: 1: nvcc: not found") == ("nvcc", "nvidia-cuda-toolkit")
    assert missing_package("zsh: command not found: cmake") == ("cmake", "cmake")
    assert missing_package("error: could not compile") is None
    assert missing_package("sh: 1: my-own-script: not found") is None  # not a system package: a push fixes it


def door(sshd: Sshd, command: str) -> Ssh:
    sshd.authorize(f'restrict,command="{command}"')
    return Ssh(identity_file=str(sshd.client_key), options=sshd.options)


def test_door_b_serves_the_tree_at_its_root_and_names_the_spelling(tmp_path: Path, sshd: Sshd) -> None:
    served = published(tmp_path)
    ssh = door(sshd, str(door_fetch(served, tmp_path / "door-fetch")))
    guarded = Source.model_validate({"from": f"rsync://root@127.0.0.1:{sshd.port}:/"})
    ready = prepare(guarded, tmp_path / "stage", ssh)
    assert ready.run == read_manifest(served / "tree").run  # type: ignore[union-attr]
    for path in (f"{served}/tree", "/tree"):  # a key without a forced command's path; the old spelling
        wrong = Source.model_validate({"from": f"rsync://root@127.0.0.1:{sshd.port}:{path}"})
        refused = failure(lambda spec=wrong: prepare(spec, tmp_path / "stage2", ssh))
        assert (
            "no such directory" in refused.message and "fetch rsync://<user>@<controller>:/ " in refused.fix
        )


def test_a_tunnel_only_key_refuses_the_fetch_naming_the_door_b_recipe(tmp_path: Path, sshd: Sshd) -> None:
    served = published(tmp_path)
    ssh = door(sshd, "/usr/sbin/nologin")
    spec = Source.model_validate({"from": f"rsync://root@127.0.0.1:{sshd.port}:/"})
    refused = failure(lambda: prepare(spec, tmp_path / "stage", ssh))
    assert refused.code == PERMANENT and "tunnel only" in refused.message
    assert "flodl_controller_door_mode: rrsync" in refused.fix and "<controller>:/" in refused.fix
    assert served.exists()


def test_walk_ins_run_the_published_entry_with_its_args_and_carry_its_run_identity(tmp_path: Path) -> None:
    served = published(tmp_path, args=("--epochs", "3"))
    out = tmp_path / "out"
    out.mkdir()
    manifest = read_manifest(served / "tree")
    assert manifest is not None
    logs: list[str] = []

    async def scenario() -> None:
        # The launch command is a placeholder: the manifest says what runs.
        ctl = Controller(settings([sys.executable, "-c", "raise SystemExit(3)"], env={"OUT": str(out)}))
        await ctl.start()
        boxes = [
            replace(agent(ctl, name), source=source(served), stage=str(tmp_path / name)) for name in "ab"
        ]
        assert await asyncio.gather(*(walk_in(box, logs) for box in boxes)) == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    ranks = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(ranks) == ["0", "1"]
    assert all(r["argv"] == ["--epochs", "3"] for r in ranks.values())
    assert {Path(r["cwd"]).name for r in ranks.values()} == {"pkg"}
    assert sum(f"prepared run {manifest.run}" in line for line in logs) == 2


def test_a_published_run_wins_over_a_walk_ins_own_command_and_the_controller_names_it(
    tmp_path: Path,
) -> None:
    served = published(tmp_path, args=("--epochs", "3"))
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "own.py").write_text("raise SystemExit(4)")  # what the box would run on its own
    manifest = read_manifest(served / "tree")
    assert manifest is not None
    said: list[str] = []

    async def scenario() -> None:
        ctl = Controller(
            settings(
                [sys.executable, "-c", "raise SystemExit(3)"], quorum=1, target=1, env={"OUT": str(out)}
            ),
            log=said.append,
        )
        await ctl.start()
        box = replace(
            agent(ctl, "pub"),
            source=source(served),
            stage=str(tmp_path / "stage"),
            bin=str(tmp_path / "own.py"),
            args=["--flag", "v"],
        )
        assert await walk_in(box) == 0
        await ctl.finished.wait()
        assert ctl.exit_code == 0
        await ctl.close()

    run(scenario)
    (rank,) = (json.loads(p.read_text()) for p in out.iterdir())
    assert rank["argv"] == ["--epochs", "3"]  # the manifest's entry and arguments, not the box's
    admitted = next(line for line in said if line.startswith("admitted pub"))
    assert f"runs published run {manifest.run}: " in admitted and admitted.endswith("train.py --epochs 3")


def test_boxes_that_fetched_across_a_publish_boundary_never_form_one_world(tmp_path: Path) -> None:
    served = published(tmp_path)

    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        early = replace(agent(ctl, "early"), source=source(served), stage=str(tmp_path / "early"))
        late = replace(agent(ctl, "late"), source=source(served), stage=str(tmp_path / "late"))

        async def after_a_publish() -> int | AgentFailure:
            await asyncio.to_thread(published, tmp_path)  # the operator publishes the next run
            return await walk_in(late)

        refused = await second_refused(ctl, walk_in(early), after_a_publish)
        assert "run identity mismatch" in refused.message and ctl.refused.get("run_mismatch") == 1
        await ctl.close()

    run(scenario)


async def second_refused(
    ctl: Controller,
    first: Coroutine[Any, Any, int | AgentFailure],
    second: Callable[[], Coroutine[Any, Any, int | AgentFailure]],
) -> AgentFailure:
    """The first box walks in and waits in the window; the second, dialled then, is refused."""
    waiting = asyncio.ensure_future(first)
    await until(lambda: ctl.admitted == 1, timeout=60)
    refused = await second()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert isinstance(refused, AgentFailure), refused
    return refused


def test_a_box_dialling_while_the_gate_builds_runs_the_old_run_whole_then_the_new_one(tmp_path: Path) -> None:
    import os
    import threading

    served = published(tmp_path)
    stage = tmp_path / "stage"
    before = prepare(source(served), stage)
    gate = tmp_path / "gate.fifo"
    os.mkfifo(gate)
    src = tmp_path / "src"
    (src / "pkg" / "train.py").write_text(TRAIN + "# the next version\n")
    request = PublishRequest(
        parse_source(f"file://{src}"),
        served,
        bin="train.py",
        cwd="pkg",
        build=f"if [ -p {gate} ]; then cat {gate}; fi",
    )
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(publish(request)))
    worker.start()
    with gate.open("w") as held:  # opening returns once the gate's build is reading: mid-publish
        mid = prepare(source(served), stage)  # the served tree is untouched until the swap
        assert mid.run == before.run and (mid.cwd / "train.py").read_text() == TRAIN
        held.write("go\n")
    gate.unlink()  # this box's own build of the run must not wait on it
    worker.join(timeout=60)
    assert done, "the publish did not finish"
    after = prepare(source(served), stage)
    assert after.run != before.run and after.run == read_manifest(served / "tree").run  # type: ignore[union-attr]
    assert (after.cwd / "train.py").read_text().endswith("# the next version\n")


def fuse_usable() -> bool:
    return Path("/dev/fuse").exists() and shutil.which("sshfs") is not None


@pytest.mark.skipif(not fuse_usable(), reason="sshfs or /dev/fuse missing")
def test_a_walk_in_mounts_its_data_read_only_reuses_it_and_replaces_a_dead_one(
    tmp_path: Path, sshd: Sshd
) -> None:
    import subprocess

    from flodl_agent.agent.prepare import mount_data

    root = tmp_path / "data"
    root.mkdir()
    (root / "labels.csv").write_text("0,1\n")
    ssh = Ssh(identity_file=str(sshd.client_key), options=sshd.options)
    spec = f"sshfs://root@127.0.0.1:{sshd.port}:{root}"
    where = tmp_path / "mnt"
    logs: list[str] = []
    try:
        mount_data(spec, where, ssh, logs.append)
        assert (where / "labels.csv").read_text() == "0,1\n"
        with pytest.raises(OSError):
            (where / "new").write_text("x")  # read-only
        mount_data(spec, where, ssh, logs.append)  # alive: reused, not mounted twice
        assert sum("mounted" in line for line in logs) == 1
        subprocess.run(["pkill", "-9", "-f", f"sshfs .*{where}"], check=False)
        mount_data(spec, where, ssh, logs.append)  # dead: replaced
        assert (where / "labels.csv").read_text() == "0,1\n" and any("not connected" in line for line in logs)
    finally:
        subprocess.run(["fusermount", "-uz", str(where)], check=False, capture_output=True)
    sshd.authorized_keys.write_text("")  # this box's key is not in door A
    denied = failure(lambda: mount_data(spec, tmp_path / "mnt2", ssh))
    assert denied.code == PERMANENT and "permission denied" in denied.message
    assert 'command="internal-sftp -R"' in denied.fix


# An entry built on the Trainer: under a model probe it answers and exits; as a rank it
# records itself. WIDTH (a box's env: entry) changes the model it builds; COUNT counts runs.
PROBED = """
import json, os, sys
import torch
from flodl_agent.train import Trainer

with open(os.environ["COUNT"], "a") as count:
    count.write("run\\n")
width = int(os.environ.get("WIDTH", "2"))
Trainer(lambda: torch.nn.Linear(4, width), list(range(8)), lambda p: torch.optim.SGD(p, lr=0.1),
        torch.nn.functional.mse_loss)
json.dump({"rank": os.environ.get("RANK")}, open(os.path.join(os.environ["OUT"], os.environ["RANK"]), "w"))
"""


def probed(tmp_path: Path, entry: str = PROBED, **kw: object) -> tuple[Path, PublishRequest]:
    src = tmp_path / "probed"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text(entry)
    request = PublishRequest(parse_source(f"file://{src}"), tmp_path / "served", bin="train.py", **kw)  # type: ignore[arg-type]
    return src, request


def runs(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def test_a_model_probe_answers_once_per_command_and_entry_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from flodl_agent.train.signature import ProbeFailed, model_signature, probe_model

    count = tmp_path / "count"
    monkeypatch.setenv("COUNT", str(count))
    src, _ = probed(tmp_path)
    command, cache, env = [sys.executable, str(src / "train.py")], tmp_path / "cache.json", dict(os.environ)
    expected = model_signature(torch.nn.Linear(4, 2))
    assert probe_model(command, src, env, cache) == expected
    assert probe_model(command, src, env, cache) == expected and runs(count) == 1  # a re-dial is free
    assert probe_model(command, src, env | {"WIDTH": "3"}) != expected  # no cache: probed afresh
    assert probe_model([*command, "--epochs", "2"], src, env, cache) == expected and runs(count) == 3
    os.utime(src / "train.py", ns=(0, 0))  # the entry changed: its answer may have too
    assert probe_model([*command, "--epochs", "2"], src, env, cache) == expected and runs(count) == 4

    (src / "plain.py").write_text("print('training without a Trainer')\n")
    with pytest.raises(ProbeFailed, match=r"exited 0 without answering the model probe \(training without"):
        probe_model([sys.executable, str(src / "plain.py")], src, env)
    (src / "hang.py").write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(ProbeFailed, match=r"did not answer the model probe within 1s"):
        probe_model([sys.executable, str(src / "hang.py")], src, env, timeout=1)


def test_publish_probes_the_model_and_refuses_an_entry_that_cannot_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from flodl_agent.sources.manifest import PublishError
    from flodl_agent.train.signature import model_signature

    monkeypatch.setenv("COUNT", str(tmp_path / "count"))
    _, request = probed(tmp_path, model_probe=True)
    report = publish(request)
    assert report.manifest.model_probe and report.manifest.model_sig == model_signature(torch.nn.Linear(4, 2))
    _, plain = probed(tmp_path, "print('no Trainer here')\n", model_probe=True)
    with pytest.raises(PublishError, match="without answering the model probe") as refused:
        publish(plain)
    assert "answer_probe" in refused.value.fix
    assert read_manifest(request.served / "tree") == report.manifest  # nothing published: the run stands
    _, nameless = probed(tmp_path, model_probe=True)
    with pytest.raises(PublishError, match="--model-probe needs the entry point"):
        publish(replace(nameless, bin=None))


def test_a_box_that_builds_another_model_is_refused_at_the_window_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    count = tmp_path / "count"
    monkeypatch.setenv("COUNT", str(count))
    _, request = probed(tmp_path, model_probe=True)
    publish(request)
    logs: list[str] = []

    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()

        def box(name: str, **env: str) -> Coroutine[Any, Any, int | AgentFailure]:
            opts = replace(agent(ctl, name), source=source(request.served), stage=str(tmp_path / name))
            return walk_in(replace(opts, env=env), logs)

        refused = await second_refused(ctl, box("same"), lambda: box("odd", WIDTH="3"))
        assert "model mismatch" in refused.message and ctl.refused.get("model_mismatch") == 1
        await ctl.close()

    run(scenario)
    assert runs(count) == 3  # the gate's probe and one per box: no rank ever started
    assert sum("model probe: this box builds" in line for line in logs) == 2


def test_the_stage_must_be_writable_and_tmpfs_is_said_not_refused(tmp_path: Path) -> None:
    served = published(tmp_path)
    (tmp_path / "a-file").write_text("")
    blocked = failure(lambda: prepare(source(served), tmp_path / "a-file" / "stage"))
    assert blocked.code == PERMANENT and "a-file/stage is not writable" in blocked.message
    assert "HOME" in blocked.fix
    if Path("/dev/shm").is_dir():
        logs: list[str] = []
        stage = Path(tempfile.mkdtemp(dir="/dev/shm")) / "stage"
        try:
            prepare(source(served), stage, log=logs.append)
        finally:
            shutil.rmtree(stage.parent)
        assert any(line.startswith("note: ") and "is on tmpfs" in line for line in logs)


def _mismatched(sshd: Sshd) -> None:
    """known_hosts pins another key for the door: what a man in the middle looks like."""
    other = sshd.home / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    sshd.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {other.with_suffix('.pub').read_text().strip()}\n")


@pytest.mark.parametrize("how", ["rsync", "git+ssh", "sshfs"])
def test_a_host_key_that_does_not_match_its_pin_stops_fetch_and_mount_for_good(
    tmp_path: Path, sshd: Sshd, how: str
) -> None:
    """The same words and exit 2 as the tunnel's (test_tunnel): one classifier for all three."""
    from flodl_agent.agent.prepare import mount_data

    served = published(tmp_path)
    ssh = Ssh(identity_file=str(sshd.client_key), options=sshd.options)
    door = f"root@127.0.0.1:{sshd.port}"
    url = f"rsync://{door}:{served}/tree"
    if how == "git+ssh":
        repo = tmp_path / "repo"
        subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
        (repo / "train.py").write_text("print('x')\n")
        subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
        subprocess.run(
            ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
            check=True,
        )
        url = f"git+ssh://{door}{repo}#main"
        ok = Source.model_validate({"from": url, "bin": "train.py"})
        assert prepare(ok, tmp_path / "ok", ssh).command  # the pinned key lets it through
    _mismatched(sshd)
    if how == "sshfs":
        data = f"sshfs://{door}:{served}"
        where, doing = tmp_path / "mnt", f"mounting {data}"
        try:
            refused = failure(lambda: mount_data(data, where, ssh))
        finally:
            subprocess.run(["fusermount", "-uz", str(where)], check=False, capture_output=True)
    else:
        doing = f"fetching {parse_source(url)}"
        refused = failure(lambda: prepare(Source.model_validate({"from": url}), tmp_path / "stage", ssh))
    assert refused.code == PERMANENT
    assert refused.message == (
        f"{doing}: the host key does not match the one pinned in known_hosts "
        "(ssh: Host key verification failed)"
    )
    assert "Never turn StrictHostKeyChecking off" in refused.fix
