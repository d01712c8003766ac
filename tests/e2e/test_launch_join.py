"""End to end through the real command line: fdl launch, two walk-ins, fdl status,
fdl start, training and done — every exit code checked."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import free_port

pytestmark = pytest.mark.skipif(shutil.which("fdl") is None, reason="the fdl console script is not on PATH")


def fdl(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["fdl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def loopback_cluster(cwd: Path, port: int, **join: object) -> None:
    """A discovery cluster on loopback: whoever walks in is the world."""
    (cwd / "fdl.cluster.yml").write_text(
        json.dumps(
            {
                "cluster": {
                    "controller": {"host": "127.0.0.1", "port": port, "join": {"discovery": True, **join}}
                }
            }
        )
    )


def launch_json(cwd: Path, env: dict[str, str], command: list[str]) -> subprocess.Popen[str]:
    """`fdl launch --json -- COMMAND` in ``cwd``: the report on stdout, the log on stderr."""
    return subprocess.Popen(
        ["fdl", "launch", "--json", "--", *command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def state(cwd: Path, env: dict[str, str] | None = None) -> dict[str, object]:
    proc = fdl("status", "--json", cwd=cwd, env=env)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)  # polling the controller's status, the operator's own view


def test_manual_launch_two_walk_ins_start_train_done(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=2, start="manual", join_timeout=60, max_join_timeout=120)
    out = tmp_path / "out"
    out.mkdir()
    rank_cmd = [
        sys.executable,
        "-c",
        f"import os; open(os.path.join(r'{out}', os.environ['RANK']), 'w').write(os.environ['WORLD_SIZE'])",
    ]
    env = {**os.environ, "NO_COLOR": "1"}
    launch = launch_json(tmp_path, env, rank_cmd)
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        refused = fdl("start", cwd=tmp_path)
        assert refused.returncode == 1 and "quorum not met: 0 of 2" in refused.stderr

        walkers = [
            subprocess.Popen(
                ["fdl", "join", f"127.0.0.1:{port}", "--host", name, "--devices", "cpu:1"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in ("box-a", "box-b")
        ]
        wait_for(lambda: state(tmp_path).get("joined_ranks") == 2)
        staged = state(tmp_path)
        assert staged["phase"] == "staging"
        shown = fdl("status", cwd=tmp_path)
        assert shown.returncode == 0 and "staging" in shown.stdout and "box-a" in shown.stdout

        started = fdl("start", cwd=tmp_path)
        assert started.returncode == 0 and "armed" in started.stdout

        codes = [w.wait(timeout=60) for w in walkers]
        assert codes == [0, 0], [w.stderr.read() for w in walkers if w.stderr]
        assert launch.wait(timeout=30) == 0
        assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
        assert {p.read_text() for p in out.iterdir()} == {"2"}
        assert launch.stderr is not None
        log = launch.stderr.read()
        assert "operator start accepted" in log and "run complete" in log
        assert launch.stdout is not None
        report = json.loads(launch.stdout.read())
        assert report["ok"] and report["phase"] == "done" and report["world_size"] == 2
        assert [(h["host"], h["ranks"], h["exits"]) for h in report["hosts"]] == [
            ("box-a", [0, 1], {"0": 0}),
            ("box-b", [1, 2], {"1": 0}),
        ] or [(h["host"], h["ranks"], h["exits"]) for h in report["hosts"]] == [
            ("box-b", [0, 1], {"0": 0}),
            ("box-a", [1, 2], {"1": 0}),
        ]
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()

    gone = fdl("status", cwd=tmp_path)
    assert gone.returncode == 1 and "no controller answers" in gone.stderr


def test_after_a_run_fdl_status_says_how_it_ended_live_then_from_the_kept_verdict(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1"}  # the user running both
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    launch = subprocess.Popen(
        ["fdl", "launch", "--", *failing], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, text=True
    )
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")
        watch = subprocess.Popen(
            ["fdl", "status", "--watch"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
        )
        join = ("join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", "solo")
        joined = fdl(*join, cwd=tmp_path, env=env, timeout=90)  # rank 0's host starts torch's store
        assert joined.returncode == 1, joined.stderr  # its rank failed
        # The live final phase: someone was watching, so the controller served the verdict a
        # few seconds more, and the watch's last refresh shows it (exit 0: a controller answered).
        watched, _ = watch.communicate(timeout=30)
        assert watch.returncode == 0
        assert "failed" in watched and "failure: rank 0 on solo exited with code 3" in watched
        assert launch.wait(timeout=30) == 1
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()

    # After the exit: nobody answers (exit 1), and the verdict the launch kept says how it ended.
    gone = fdl("status", cwd=tmp_path, env=env)
    assert gone.returncode == 1 and "no controller answers" in gone.stderr
    assert f"failed  the last launch on port {port} (launch " in gone.stdout
    assert "failure: rank 0 on solo exited with code 3" in gone.stdout and "rank 0: exit 3" in gone.stdout
    kept = fdl("status", "--json", cwd=tmp_path, env=env)
    assert kept.returncode == 1
    verdict = json.loads(kept.stdout)
    assert verdict["live"] is False and verdict["phase"] == "failed" and not verdict["ok"]
    assert verdict["port"] == port and [h["host"] for h in verdict["hosts"]] == ["solo"]
    # Another user's status (another home) holds no verdict of this launch: only "nobody answers".
    other = fdl("status", cwd=tmp_path, env={**env, "HOME": str(tmp_path / "other")})
    assert other.returncode == 1 and other.stdout == "" and "no controller answers" in other.stderr


def test_a_launch_whose_entry_is_missing_fails_that_run_and_a_persist_walk_in_trains_in_the_next(
    tmp_path: Path,
) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=2, target_ranks=2, join_timeout=60, max_join_timeout=120)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    walker = subprocess.Popen(
        ["fdl", "join", f"127.0.0.1:{port}", "--persist", "--backoff", "0.2", "--devices", "cpu:2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        bad = fdl("launch", "--", "/nonexistent/entry", "--epochs", "1", cwd=tmp_path, env=env, timeout=90)
        assert bad.returncode == 1, bad.stderr
        # The controller names the rank and why it never started, not a host that vanished.
        cause = "could not start: /nonexistent/entry: No such file or directory"
        assert f"run failed: rank 0 on {socket.gethostname()} {cause}" in bad.stderr, bad.stderr
        assert "still running" not in bad.stderr
        assert walker.poll() is None, "the walk-in stopped: a run's failure must not stop the box"

        out = tmp_path / "trained"
        good = [sys.executable, "-c", f"import os; open(r'{out}' + os.environ['RANK'], 'w').close()"]
        again = fdl("launch", "--", *good, cwd=tmp_path, env=env, timeout=90)
        assert again.returncode == 0, again.stderr
        assert sorted(p.name for p in tmp_path.glob("trained*")) == ["trained0", "trained1"]
        assert walker.poll() is None  # still standing, for the run after that
    finally:
        walker.terminate()
        _, said = walker.communicate(timeout=30)
    assert "cannot start the entry point /nonexistent/entry: No such file or directory" in said
    assert "re-dialling in" in said and f"run finished cleanly on {socket.gethostname()}" in said


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux script for a terminal")
def test_launch_on_a_terminal_shows_a_live_roster_and_fails_at_the_cap(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=2)
    proc = subprocess.run(
        ["script", "-qec", "fdl launch -- true", "/dev/null"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert "waiting: 0 ranks (quorum 1) from nobody yet" in proc.stdout
    assert "quorum not met: 0 of 1 ranks joined before the hard cap" in proc.stdout


def test_at_cluster_runs_a_named_command_of_fdl_yml(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "ran"
    (tmp_path / "fdl.yml").write_text(
        "commands:\n"
        f"  train: [{json.dumps(sys.executable)}, -c,\n"
        "          \"import sys; open(sys.argv[1], 'w').write(sys.argv[2])\"]\n"
    )
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    launch = subprocess.Popen(
        ["fdl", "@cluster", "train", str(out), "epoch-3"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        joined = fdl("join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--host", "solo", cwd=tmp_path)
        assert joined.returncode == 0, joined.stderr
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
    assert out.read_text() == "epoch-3"
    unknown = fdl("@cluster", "trian", cwd=tmp_path)
    assert unknown.returncode == 2 and "did you mean `train`?" in unknown.stderr
    missing = fdl("@nowhere", "train", cwd=tmp_path)
    assert missing.returncode == 2 and "no fdl.nowhere.yml here" in missing.stderr


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux script for a terminal")
def test_a_waiting_agent_on_a_terminal_shows_a_spinner(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    launch = subprocess.Popen(
        ["fdl", "launch", "--", "true"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        proc = subprocess.run(
            ["script", "-qec", f"fdl join 127.0.0.1:{port} --devices cpu:1 --host spun", "/dev/null"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout
        assert "admitted as spun; waiting for the world to form" in proc.stdout
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()


def test_sigterm_on_an_agent_ends_its_ranks(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, join_timeout=1, max_join_timeout=30)
    pidfile = tmp_path / "rank.pid"
    rank = [
        sys.executable,
        "-c",
        f"import os, time; open(r'{pidfile}', 'w').write(str(os.getpid())); time.sleep(120)",
    ]
    launch = subprocess.Popen(
        ["fdl", "launch", "--json", "--", *rank],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        agent = subprocess.Popen(
            ["fdl", "join", f"127.0.0.1:{port}", "--devices", "cpu:1"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: pidfile.exists() and pidfile.read_text() != "")
        rank_pid = int(pidfile.read_text())
        agent.terminate()
        assert agent.wait(timeout=30) == 1
        wait_for(lambda: not Path(f"/proc/{rank_pid}").exists() or "zombie" in _proc_state(rank_pid))
        assert launch.wait(timeout=30) == 1  # the host vanished mid-run: the run failed
        assert launch.stdout is not None
        report = json.loads(launch.stdout.read())
        assert not report["ok"] and report["phase"] == "failed"
        assert "closed its link" in report["reason"] or "exited with code" in report["reason"]
        assert len(report["hosts"]) == 1 and report["world_size"] == 1
    finally:
        for proc in (launch,):
            if proc.poll() is None:
                proc.kill()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


# A walk-in's own entry: it says what it ran, with which arguments, under which python.
OWN_ENTRY = """
import json, os, sys
json.dump({"argv": sys.argv[1:], "python": sys.executable, "entry": __file__},
          open(os.path.join(os.environ["OUT"], os.environ["RANK"]), "w"))
"""


def test_a_walk_in_brings_its_own_command_and_the_controller_names_it(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=2, target_ranks=2, join_timeout=60, max_join_timeout=120)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "x.py").write_text(OWN_ENTRY)  # not executable: it runs under the agent's python
    launch_cmd = [
        sys.executable,
        "-c",
        "import os; open(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').write('launch')",
    ]
    env = {**os.environ, "NO_COLOR": "1", "OUT": str(out)}
    launch = launch_json(tmp_path, env, launch_cmd)
    try:
        wait_for(lambda: state(tmp_path).get("phase") == "waiting")
        # the address from fdl.yml: what follows `--` is the entry's, never the ADDRESS
        (tmp_path / "fdl.yml").write_text(json.dumps({"join": {"controller": f"127.0.0.1:{port}"}}))
        base = ["fdl", "join", "--devices", "cpu:1", "--host"]
        walkers = {
            "own": subprocess.Popen(
                [*base, "own", "--bin", "x.py", "--", "--flag", "v"], cwd=tmp_path, env=env, text=True
            ),
            "plain": subprocess.Popen([*base, "plain"], cwd=tmp_path, env=env, text=True),
        }
        assert {name: w.wait(timeout=60) for name, w in walkers.items()} == {"own": 0, "plain": 0}
        assert launch.wait(timeout=30) == 0
        assert launch.stderr is not None and launch.stdout is not None
        log, report = launch.stderr.read(), json.loads(launch.stdout.read())
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()
    by_host = {h["host"]: h for h in report["hosts"]}
    own_rank, plain_rank = (str(by_host[h]["ranks"][0]) for h in ("own", "plain"))
    ran = json.loads((out / own_rank).read_text())
    # --bin PATH -- ARGS is its ranks' whole command: the arguments verbatim, under the agent's python
    assert ran["argv"] == ["--flag", "v"] and ran["entry"].endswith("x.py")
    fdl_bin = Path(shutil.which("fdl") or "").parent
    assert Path(ran["python"]).parent == fdl_bin
    assert (out / plain_rank).read_text() == "launch"  # no command of its own: the launch's
    # the controller's log and its report name what each host runs
    own_line = next(line for line in log.splitlines() if "admitted own" in line)
    assert "runs its own command:" in own_line and own_line.endswith("x.py --flag v")
    assert "runs the launch command" in next(line for line in log.splitlines() if "admitted plain" in line)
    assert by_host["own"]["command"].endswith("x.py --flag v") and by_host["plain"]["command"] == ""

    # arguments with no entry point to give them to are refused before any dial
    refused = fdl("join", "--devices", "cpu:1", "--", "--flag", "v", cwd=tmp_path)
    assert refused.returncode == 2
    assert "none is named" in refused.stderr and "--bin PATH" in refused.stderr


TRAINER_ENTRY = """
import sys, torch
from flodl_agent.train import ElCheConfig, Trainer

width = int(sys.argv[1])  # the model this box builds: its arguments reach the model factory
Trainer(lambda: torch.nn.Linear(width, 1), [(torch.zeros(width), torch.zeros(1))] * 8,
        lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.functional.mse_loss, ElCheConfig.cpu_sync()).fit(1)
"""


def test_a_walk_in_whose_own_entry_builds_another_model_is_refused_at_the_window(tmp_path: Path) -> None:
    """--bin boxes probe their model before the dial: the odd one is refused by name, before
    the world forms, and the world forms from the boxes that agree."""
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=2, target_ranks=2, join_timeout=90, max_join_timeout=120)
    (tmp_path / "train.py").write_text(TRAINER_ENTRY)
    env = {**os.environ, "NO_COLOR": "1", "HOME": str(tmp_path)}  # its own probe cache
    launch = launch_json(tmp_path, env, [sys.executable, "-c", "raise SystemExit(3)"])
    join = ["fdl", "join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--bin", "train.py", "--host"]
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")
        first = subprocess.Popen([*join, "a", "--", "2"], cwd=tmp_path, env=env, text=True)
        wait_for(lambda: len(state(tmp_path, env).get("hosts") or []) == 1, timeout=60)
        odd = fdl("join", f"127.0.0.1:{port}", "--devices", "cpu:1", "--bin", "train.py", "--host", "b",
                  "--", "3", cwd=tmp_path, env=env, timeout=90)  # fmt: skip
        assert odd.returncode == 1, odd.stderr  # refused, transient: --persist would re-dial
        assert "model probe: this box builds" in odd.stderr
        assert "model mismatch: the model this box builds differs from the cohort's (first signed by a)" in (
            odd.stderr
        )
        assert state(tmp_path, env).get("phase") == "waiting"  # nothing formed with it
        second = subprocess.Popen([*join, "c", "--", "2"], cwd=tmp_path, env=env, text=True)
        assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0
        assert launch.wait(timeout=30) == 0
        assert launch.stdout is not None and launch.stderr is not None
        report, log = json.loads(launch.stdout.read()), launch.stderr.read()
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()
    assert sorted(h["host"] for h in report["hosts"]) == ["a", "c"]
    assert "refused b" in log and "model mismatch" in log


def test_the_quick_starts_one_machine_walkthrough_with_the_shipped_local_example(tmp_path: Path) -> None:
    """docs/quickstart.md "On one machine", command for command (a free port instead of 1337)."""
    example = fdl("config", "example", "local", cwd=tmp_path)
    assert example.returncode == 0
    (tmp_path / "fdl.cluster.yml").write_text(example.stdout)
    port = free_port()
    addr = f"127.0.0.1:{port}"
    env = {**os.environ, "NO_COLOR": "1"}
    rank = [sys.executable, "-m", "flodl_agent.demo_rank", "--trainer", "3"]
    launch = subprocess.Popen(
        ["fdl", "launch", "--port", str(port), "--", *rank],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: state_at(tmp_path, addr).get("phase") == "waiting")
        walkers = [
            subprocess.Popen(
                ["fdl", "join", addr, "--host", name, "--devices", "cpu:1"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in ("box-1", "box-2")
        ]
        wait_for(lambda: state_at(tmp_path, addr).get("phase") == "staging")  # quorum 2, held (hybrid)
        started = fdl("start", "--addr", addr, cwd=tmp_path)
        assert started.returncode == 0 and "armed" in started.stdout
        outputs = [w.communicate(timeout=120)[0] for w in walkers]
        assert [w.returncode for w in walkers] == [0, 0], outputs
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()
    # The ranks trained one model together: the same weights on both.
    weights = {line.split("done, ")[1] for out in outputs for line in out.splitlines() if "done, w=" in line}
    assert len(weights) == 1, outputs


def state_at(cwd: Path, addr: str) -> dict[str, object]:
    proc = fdl("status", "--addr", addr, "--json", cwd=cwd)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


# --- exit codes at the edges: help, and readers that leave early ----------------------


def test_plain_fdl_and_fdl_help_show_the_help_and_succeed(tmp_path: Path) -> None:
    plain = fdl(cwd=tmp_path)
    assert plain.returncode == 0 and plain.stdout == fdl("--help", cwd=tmp_path).stdout
    assert plain.stdout.startswith("Usage: fdl ") and "fdl help COMMAND" in plain.stdout
    for words in (["launch"], ["config", "check"]):
        shown = fdl("help", *words, cwd=tmp_path)
        assert shown.returncode == 0 and shown.stdout == fdl(*words, "--help", cwd=tmp_path).stdout
        assert shown.stdout.startswith(f"Usage: fdl {' '.join(words)} ")
    assert fdl("help", cwd=tmp_path).stdout == plain.stdout
    typo = fdl("help", "lanch", cwd=tmp_path)
    assert typo.returncode == 2 and "no such command `fdl lanch` (did you mean `launch`?)" in typo.stderr
    leaf = fdl("help", "launch", "now", cwd=tmp_path)
    assert leaf.returncode == 2 and "`fdl launch` has no subcommands" in leaf.stderr


def closed_stdout(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`fdl ARGS | true`: the reader is gone before the first byte, so every write meets a
    closed pipe (`| head -1` when the output outgrows what head reads)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            ["fdl", *args], cwd=cwd, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=30
        )
    finally:
        os.close(write)


def clean(proc: subprocess.CompletedProcess[str]) -> bool:
    return "Traceback" not in proc.stderr and "internal error" not in proc.stderr


def test_a_reader_that_leaves_early_is_no_failure_and_a_piped_watch_refreshes(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, target_ranks=1, join_timeout=60, max_join_timeout=120)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    launch = subprocess.Popen(
        ["fdl", "launch", "--", sys.executable, "-c", "pass"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: state(tmp_path, env).get("phase") == "waiting")
        for args in (["status"], ["status", "--json"], ["--help"], ["help", "launch"]):
            gone = closed_stdout(*args, cwd=tmp_path, env=env)
            assert gone.returncode == 0 and clean(gone), (args, gone.stderr)

        # Piped, a watch prints every refresh as it comes (not once at the end), and stops
        # at the next one after its reader leaves.
        watch = subprocess.Popen(
            ["fdl", "status", "--watch"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert watch.stdout is not None and watch.stderr is not None
        heads = [line for line in (watch.stdout.readline() for _ in range(40)) if line.startswith("waiting ")]
        assert len(heads) >= 2 and all("quorum 1" in h for h in heads), heads  # a rendering a refresh
        watch.stdout.close()
        assert watch.wait(timeout=30) == 0 and "Traceback" not in watch.stderr.read()

        lines = subprocess.Popen(
            ["fdl", "status", "--watch", "--json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
        )
        assert lines.stdout is not None
        first, second = json.loads(lines.stdout.readline()), json.loads(lines.stdout.readline())
        assert first["phase"] == second["phase"] == "waiting" and first["launch"] == second["launch"]
        joined = fdl("join", f"127.0.0.1:{port}", "--devices", "cpu:1", cwd=tmp_path, env=env, timeout=90)
        assert joined.returncode == 0, joined.stderr
        rest = [json.loads(line) for line in lines.stdout]  # one document a line, to the run's end
        assert lines.wait(timeout=30) == 0
        assert rest and rest[-1]["phase"] == "done" and all(d["phase"] != "done" for d in rest[:-1])
        assert launch.wait(timeout=30) == 0
    finally:
        if launch.poll() is None:
            launch.kill()
        launch.wait()

    # Nobody answers now: the command's own exit (1) stands, however early its reader left.
    after = closed_stdout("status", cwd=tmp_path, env=env)
    assert after.returncode == 1 and clean(after) and "no controller answers" in after.stderr


def test_a_watch_started_before_the_launch_waits_for_the_window_then_follows_the_run(tmp_path: Path) -> None:
    port = free_port()
    loopback_cluster(tmp_path, port, min_rank_start=1, target_ranks=1, join_timeout=60, max_join_timeout=120)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "NO_COLOR": "1"}
    watch = subprocess.Popen(
        ["fdl", "status", "--watch", "--json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    launch = None
    try:
        assert watch.stderr is not None and watch.stdout is not None
        said = watch.stderr.readline()  # said once it found nobody there: only then the launch
        assert f"no controller at 127.0.0.1:{port} yet: waiting for a launch to open its window" in said
        launch = subprocess.Popen(
            ["fdl", "launch", "--", sys.executable, "-c", "pass"], cwd=tmp_path, env=env,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        first = json.loads(watch.stdout.readline())
        assert first["phase"] == "waiting"
        joined = fdl("join", f"127.0.0.1:{port}", "--devices", "cpu:1", cwd=tmp_path, env=env, timeout=90)
        assert joined.returncode == 0, joined.stderr
        rest = [json.loads(line) for line in watch.stdout]
        assert watch.wait(timeout=30) == 0 and rest[-1]["phase"] == "done"
        assert launch.wait(timeout=30) == 0
    finally:
        for proc in (watch, launch):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    # Without --watch, nobody there is the answer at once, as ever.
    plain = fdl("status", "--addr", f"127.0.0.1:{free_port()}", cwd=tmp_path, env=env)
    assert plain.returncode == 1 and "no controller answers" in plain.stderr and "waiting" not in plain.stderr
