"""The status page's phase line on a failed run, in a real headless Chromium (Debian's,
driven by Selenium with its own chromedriver): "failed" is the current step, and only the
steps the run went through before the one it failed in are marked past. A run that failed
while waiting went through none. The page opened afresh after the failure shows the same,
from the state alone (its `failed_in`)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, settings, walk_in

webdriver = pytest.importorskip("selenium.webdriver")
pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None or shutil.which("chromedriver") is None,
    reason="needs Debian's chromium and chromium-driver (scripts/system-deps installs them)",
)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on its own thread: the controller and agents run there, the browser here."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module's runs (each opens its own controller's page)."""
    from selenium.webdriver.chrome.service import Service

    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # never let Selenium Manager reach for a driver
        options = webdriver.ChromeOptions()
        options.binary_location = str(shutil.which("chromium"))
        for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
        try:
            yield driver
        finally:
            driver.quit()


class Page:
    """The status page of ``ctl`` in the browser: its phase line and its timeline."""

    def __init__(self, browser: Any, ctl: Controller) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.browser, self.url = browser, f"http://127.0.0.1:{ctl.port}/"
        self.wait = WebDriverWait(browser, 30, poll_frequency=0.1)

    def open(self, phase: str) -> None:
        self.browser.get(self.url)
        self.wait.until(lambda _: self.phase() == phase)

    def phase(self) -> str:
        return str(self.browser.execute_script("return document.getElementById('phase').textContent"))

    def steps(self) -> tuple[str, list[str]]:
        """The step marked current, and those marked past."""
        script = (
            "const li = [...document.querySelectorAll('#phases li')];"
            "return [li.filter(l => l.getAttribute('aria-current') === 'step').map(l => l.textContent),"
            " li.filter(l => l.classList.contains('past')).map(l => l.textContent)]"
        )
        (current,), past = self.browser.execute_script(script)
        return str(current), [str(p) for p in past]

    def failed(self) -> tuple[str, list[str]]:
        """The steps once the page shows the failure and has read the timeline's verdict (its
        last read of the history, which re-marks the line)."""
        newest = "const li = document.querySelector('#timeline li'); return li ? li.textContent : ''"
        self.wait.until(
            lambda _: self.phase() == "failed" and "run failed" in str(self.browser.execute_script(newest))
        )
        return self.steps()

    def reopened(self) -> tuple[str, list[str]]:
        """The steps on the page opened afresh: nothing seen live, the state and timeline alone."""
        self.open("failed")
        return self.failed()

    def refused(self) -> list[str]:
        """What the console said the page's policy blocked or the script threw."""
        log = self.browser.get_log("browser")
        return [str(e["message"]) for e in log if e["level"] == "SEVERE" or e["source"] == "security"]


async def _fail(ctl: Controller, reason: str) -> None:
    ctl.fail(reason)  # on the controller's loop, as the launcher does


def test_a_run_that_failed_while_waiting_went_through_no_step(
    loop: asyncio.AbstractEventLoop, browser: Any
) -> None:
    ctl = Controller(settings(start="manual", quorum=1, target=None))
    on(loop, ctl.start())
    try:
        page = Page(browser, ctl)
        page.open("waiting")
        assert page.steps() == ("waiting", [])
        on(loop, _fail(ctl, "stopped by the test while nobody had walked in"))
        assert page.failed() == ("failed", [])
        assert page.reopened() == ("failed", [])
        assert page.refused() == []
    finally:
        on(loop, ctl.close())


def test_a_run_that_failed_while_staging_went_through_waiting(
    loop: asyncio.AbstractEventLoop, browser: Any
) -> None:
    ctl = Controller(settings(start="manual", quorum=1, target=None))
    on(loop, ctl.start())
    try:
        page = Page(browser, ctl)
        page.open("waiting")
        box = asyncio.run_coroutine_threadsafe(walk_in(agent(ctl, "box-a")), loop)
        page.wait.until(lambda _: page.phase() == "staging")
        on(loop, _fail(ctl, "stopped by the test before the operator's start"))
        assert isinstance(box.result(60), AgentFailure)  # aborted
        assert page.failed() == ("failed", ["waiting"])
        # Opened afresh: the roster met the quorum and waited for a start, so it was staged.
        assert page.reopened() == ("failed", ["waiting"])
        assert page.refused() == []
    finally:
        on(loop, ctl.close())


def test_a_run_that_failed_while_training_went_through_the_steps_before_it(
    loop: asyncio.AbstractEventLoop, browser: Any
) -> None:
    # auto: the world forms on the walk-in, and its one rank fails the run
    ctl = Controller(settings([sys.executable, "-c", "raise SystemExit(3)"], quorum=1, target=1))
    on(loop, ctl.start())
    try:
        page = Page(browser, ctl)
        page.open("waiting")
        on(loop, walk_in(agent(ctl, "box-a")))
        # Staging is struck out (an auto window never holds), and training is where it failed.
        assert page.failed() == ("failed", ["waiting", "forming"])
        # Opened afresh: the timeline's "formed" event says the world trained.
        assert page.reopened() == ("failed", ["waiting", "forming"])
        assert page.refused() == []
    finally:
        on(loop, ctl.close())
