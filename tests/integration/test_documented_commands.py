"""Every documented one-machine command runs as written (issue 36).

Each page of README.md and docs/*.md runs its ``sh`` and ``console`` blocks in order in a
scratch copy of the checkout (every top-level entry linked, so the docs' relative paths
resolve and what they write lands in the scratch), with the virtualenv's ``fdl`` first on
PATH. An ``sh`` block must exit 0; each ``$ command`` of a ``console`` block must print
what the page shows. Blocks marked ``skip:`` say why and where they run instead
(tests/support/doc_blocks.py has the markers; ``python -m tests.support.doc_blocks`` lists
them); a skipped block is no pytest skip, which CI would fail, but is checked to give a
reason. The walk-throughs use the default port 1337 and the box's loopback, so the module
runs in the serial pass.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import doc_blocks
from tests.support.doc_blocks import Block

pytestmark = pytest.mark.serial

BLOCK_TIMEOUT = 180.0  # the quick start's status --watch follows a whole run
READY_TIMEOUT = 60.0
PAGES = [str(p.relative_to(doc_blocks.ROOT)) for p in doc_blocks.pages()]


class Page:
    """One page's scratch checkout, its environment and what it left running."""

    def __init__(self, scratch: Path) -> None:
        self.cwd = scratch / "checkout"
        self.cwd.mkdir()
        for entry in doc_blocks.ROOT.iterdir():
            if entry.name != ".git" and not entry.name.startswith("fdl."):
                (self.cwd / entry.name).symlink_to(entry)
        home = scratch / "home"
        home.mkdir()
        venv_bin = str(Path(sys.executable).parent)
        path = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FDL_", "DOCKYARD_"))}
        self.env = {**env, "HOME": str(home), "PATH": path}
        self.background: list[tuple[Block, subprocess.Popen[bytes], Path]] = []
        self.ready = ""

    def shell(self, script: str, timeout: float = BLOCK_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", script],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self, block: Block) -> None:
        for n, script in enumerate(block.terminals()):
            log = self.cwd.parent / f"background-{block.line}-{n}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    ["bash", "-c", script],
                    cwd=self.cwd,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.background.append((block, proc, log))
        self.ready = block.arg

    def wait_ready(self) -> None:
        """Until the last background block's readiness command exits 0 (it polls what the
        started commands make true); a background block that ended meanwhile fails it."""
        if not self.ready:
            return
        deadline = time.monotonic() + READY_TIMEOUT
        while self.shell(self.ready, timeout=READY_TIMEOUT).returncode != 0:
            for block, proc, log in self.background:
                if proc.poll() is not None:
                    pytest.fail(f"{block.where}: ended with {proc.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not ready in {READY_TIMEOUT:.0f} s: {self.ready}\n{self.logs()}")
            time.sleep(0.2)
        self.ready = ""

    def logs(self) -> str:
        return "\n".join(f"--- {b.where}\n{log.read_text()}" for b, _, log in self.background)

    def stop(self) -> None:
        for _, proc, _ in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.background:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def page_runner(tmp_path: Path) -> Iterator[Page]:
    page = Page(tmp_path)
    yield page
    page.stop()


def _run(page: Page, block: Block) -> None:
    if block.action == "file":
        (page.cwd / block.arg).write_text(block.text)
        return
    page.wait_ready()
    if block.action in ("background", "terminals"):
        page.start(block)
    elif block.action == "run":
        done = page.shell(block.text)
        assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{block.text}\n{done.stdout}"
    elif block.action == "console":
        for exchange in doc_blocks.exchanges(block):
            done = page.shell(exchange.command)
            said = doc_blocks._tidy(done.stdout.splitlines())
            assert said == exchange.expected, (
                f"{block.where}: `{exchange.command}` printed (exit {done.returncode}):\n{said}"
                f"--- the page shows:\n{exchange.expected}"
            )


@pytest.mark.parametrize("name", PAGES)
def test_a_pages_commands_run_as_written(name: str, page_runner: Page) -> None:
    text = (doc_blocks.ROOT / name).read_text()
    ran = [b for b in doc_blocks.blocks_of(text, name) if b.action not in ("prose", "skip")]
    for block in ran:
        _run(page_runner, block)
    page_runner.wait_ready()  # a page that ends on a background block: it came up at least


def test_every_block_that_does_not_run_here_says_why_and_the_markers_read() -> None:
    blocks = doc_blocks.all_blocks()  # a marker the test cannot read raises, naming its line
    skipped = [b for b in blocks if b.action == "skip"]
    assert all(len(b.arg.split()) >= 3 for b in skipped), [b.where for b in skipped]
    assert any(b.action == "terminals" for b in blocks), "the quick start's walk-through runs"


def test_a_command_that_fails_or_prints_otherwise_fails_the_page(page_runner: Page) -> None:
    page = "\n".join(
        [
            "<!-- doc-test: file greeting.txt -->",
            "```text",
            "hello",
            "```",
            "```console",
            "$ cat greeting.txt",
            "hello",
            "$ cat greeting.txt; echo \\",
            "    bye",
            "hello",
            "bye",
            "```",
            "```sh",
            "false  # as written, it fails",
            "```",
            "```console",
            "$ cat greeting.txt",
            "goodbye",
            "```",
        ]
    )
    written, passes, fails, differs = doc_blocks.blocks_of(page, "t.md")
    for block in (written, passes):
        _run(page_runner, block)  # a file, then what it holds, printed as shown
    with pytest.raises(AssertionError, match=r"t\.md:13: exit 1"):
        _run(page_runner, fails)
    shown = r"t\.md:16: `cat greeting.txt` printed \(exit 0\):\n\s*hello\n\s*--- the page shows:\n\s*goodbye"
    with pytest.raises(AssertionError, match=shown):
        _run(page_runner, differs)
