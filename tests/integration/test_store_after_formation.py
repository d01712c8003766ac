"""What torch's rendezvous store is still needed for once a gloo world has formed (issue 37,
deliverable 3: "the store relay reconnects after the resume, or the store is not needed
after formation: prove which"). Two real gloo ranks and a real TCPStore in a process of its
own; the store is killed (SIGKILL) after `init_process_group`:

- collectives and barriers go on without it: the process group's own mesh carries them;
- a new process group (`new_group`) needs it and fails: it rendezvouses through the store.

So a world whose ranks only train on their group keeps training while its controller (the
road to the store for every host but rank 0's) is away, and a script that makes groups
later needs the store's relay back after a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port

pytest.importorskip("torch")
# Alone, after the parallel pass: under it its gloo ranks have aborted (SIGABRT) on the 2-core CI box.
pytestmark = pytest.mark.serial

STORE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
print("up", flush=True)
sys.stdin.read()  # until the test kills it
"""

RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
rank, port, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
print("formed", flush=True)
while not os.path.exists(go):  # the test's cue: the store is gone
    time.sleep(0.02)
for _ in range(20):
    x = torch.full((1024,), float(rank + 1))
    dist.all_reduce(x)
    assert x[0].item() == 3.0
dist.barrier()
print("trained without the store", flush=True)
if sys.argv[4] == "new_group":
    try:
        dist.new_group([0, 1])
    except Exception as exc:
        print(f"new_group failed: {type(exc).__name__}", flush=True)
        sys.exit(3)
    print("new_group formed", flush=True)
"""


def _world(tmp_path: Path, after: str) -> list[tuple[int, str]]:
    port, go = free_port(), tmp_path / "go"
    store = subprocess.Popen(
        [sys.executable, "-c", STORE, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout is not None and store.stdout.readline().strip() == "up"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), str(port), str(go), after],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for r in (0, 1)
        ]
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "formed"
        store.send_signal(signal.SIGKILL)
        store.wait(timeout=10)
        go.write_text("")
        return [(rank.wait(timeout=60), rank.stdout.read() if rank.stdout else "") for rank in ranks]
    finally:
        for proc in (store, *ranks):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_formed_gloo_world_trains_on_without_its_store(tmp_path: Path) -> None:
    for code, said in _world(tmp_path, "nothing"):
        assert code == 0 and "trained without the store" in said


def test_a_new_process_group_needs_the_store(tmp_path: Path) -> None:
    for code, said in _world(tmp_path, "new_group"):
        assert code == 3 and "trained without the store" in said and "new_group failed" in said
