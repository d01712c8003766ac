"""The status page in a real headless Chromium (Debian's, driven by Selenium with its
own chromedriver: nothing is downloaded). A controller and two walk-ins run in a
background event loop; the browser watches the window fill, fires the start from
the page, sees the ranks train (their charts, the CPU plane's rounds and each host's
share) and the timeline end with the verdict, all under the page's Content-Security-Policy
with nothing refused in the browser's console. A page from another origin that frames the
status page gets Chromium's error page in the frame, not the start button. The screenshot is
kept in build/test-artifacts/."""

from __future__ import annotations

import asyncio
import http.server
import shutil
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from tests.support.control_plane import agent, settings, walk_in

webdriver = pytest.importorskip("selenium.webdriver")
pytest.importorskip("torch")  # the ranks average through the CPU plane
pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None or shutil.which("chromedriver") is None,
    reason="needs Debian's chromium and chromium-driver (scripts/system-deps installs them)",
)
ARTIFACTS = Path(__file__).parents[2] / "build" / "test-artifacts"

# A rank that reports and averages until the test lets it finish: rank 1 brings twice
# rank 0's weight to every round, so its host's share is two thirds.
AVERAGING = """
import os, time
from pathlib import Path
import torch
from flodl_agent.train import Averager
from flodl_agent.observe.metrics import report
rank = int(os.environ["RANK"])
plane = Averager()
weights = torch.zeros(8)
step = 0
while not Path(os.environ["GO"]).exists():
    step += 1 + rank
    report(step, loss=1.0 / step)
    plane.average([weights], float(1 + rank))
    time.sleep(0.05)
"""


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


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager reach for a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: CSP refusals land there
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def refusals(log: list[dict[str, Any]]) -> list[str]:
    """What the console said went wrong: a policy violation (source ``security``), a failed
    load, a script error."""
    return [
        str(entry["message"]) for entry in log if entry["level"] == "SEVERE" or entry["source"] == "security"
    ]


@pytest.fixture
def framer() -> Iterator[tuple[http.server.ThreadingHTTPServer, list[bytes]]]:
    """Another origin (another port): it serves whatever page the test puts in the list."""
    page: list[bytes] = [b""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(page[0])))
            self.end_headers()
            self.wfile.write(page[0])

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, page
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_page_on_another_origin_cannot_frame_the_status_page(
    loop: asyncio.AbstractEventLoop, browser: Any, framer: tuple[http.server.ThreadingHTTPServer, list[bytes]]
) -> None:
    """Clickjacking: a page that frames the status page under a decoy to trick a click on
    its start button. The browser refuses to render the page in the frame at all."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ctl = Controller(settings(start="manual", quorum=1, target=None))
    on(loop, ctl.start())
    server, page = framer
    victim = f"http://127.0.0.1:{ctl.port}/"
    page[0] = (
        f'<!doctype html><title>win a prize</title><iframe id="victim" src="{victim}"></iframe>'.encode()
    )
    log: list[dict[str, Any]] = []

    def refused(_: Any) -> bool:
        log.extend(browser.get_log("browser"))  # each read drains the console
        return any("frame-ancestors 'none'" in m and victim in m for m in refusals(log))

    try:
        browser.get(f"http://127.0.0.1:{server.server_port}/")  # returns once the frame has loaded (or not)
        WebDriverWait(browser, 10, poll_frequency=0.1).until(refused)
        browser.switch_to.frame("victim")
        # Chromium's error page stands in the frame: no status page, no start button to click.
        assert browser.execute_script("return location.href") == "chrome-error://chromewebdata/"
        assert (
            browser.find_elements(By.ID, "start-form") == [] and browser.find_elements(By.ID, "phase") == []
        )
        browser.switch_to.default_content()
        # The same page opened directly (not framed) works: the refusal is the frame's alone.
        browser.get(victim)
        WebDriverWait(browser, 10, poll_frequency=0.1).until(
            lambda _: browser.find_element(By.ID, "phase").text == "waiting"
        )
    finally:
        on(loop, ctl.close())


def test_an_operator_watches_the_window_fill_starts_the_run_and_sees_ranks_train(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    beat = 0.2  # the agents' heartbeat period, shortened for the test
    go = tmp_path / "go"
    ctl = Controller(
        settings(
            [sys.executable, "-c", AVERAGING],
            env={"GO": str(go)},
            start="manual",
            join_timeout=120.0,
            max_join_timeout=300.0,
        )
    )
    on(loop, ctl.start())
    wait = WebDriverWait(browser, 30, poll_frequency=0.1)

    def text(element_id: str) -> str:
        return str(browser.find_element(By.ID, element_id).text)

    def rows(table: str) -> list[list[str]]:
        # One script reads the whole table: the page re-renders it on each poll, so cells read
        # one by one over WebDriver can go stale in between (StaleElementReferenceException).
        script = (
            "return [...document.querySelectorAll(arguments[0])].map(r => [...r.cells].map(c => c.innerText))"
        )
        table_rows = browser.execute_script(script, f"#{table} tbody tr")
        return [[str(cell).strip() for cell in row] for row in table_rows]

    def steps() -> tuple[str, list[str]]:
        # The phase line: the step marked current, and those marked past.
        script = (
            "const li = [...document.querySelectorAll('#phases li')];"
            "return [li.filter(l => l.getAttribute('aria-current') === 'step').map(l => l.textContent),"
            " li.filter(l => l.classList.contains('past')).map(l => l.textContent)]"
        )
        (current,), past = browser.execute_script(script)
        return str(current), [str(p) for p in past]

    try:
        browser.get(f"http://127.0.0.1:{ctl.port}/")
        wait.until(lambda _: text("phase") == "waiting")
        assert steps() == ("waiting", [])
        assert "Nobody has walked in yet." in browser.page_source
        assert not browser.find_element(By.ID, "start").is_displayed()  # nothing to start yet
        assert "window closes in" in text("countdown")

        boxes = [
            asyncio.run_coroutine_threadsafe(walk_in(replace(agent(ctl, n), heartbeat_every=beat)), loop)
            for n in ("box-a", "box-b")
        ]
        wait.until(lambda _: text("phase") == "staging")
        assert steps() == ("staging", ["waiting"])
        roster = rows("roster")
        assert sorted(r[0] for r in roster) == ["box-a", "box-b"]
        assert all(r[3] == "cpu" for r in roster)  # the torch variant each box offers
        assert not browser.find_element(By.ID, "refusals").find_elements(By.CSS_SELECTOR, "tbody tr")
        twin = on(loop, walk_in(agent(ctl, "box-a")))  # a second box-a: refused by name, and counted
        assert isinstance(twin, AgentFailure) and "already joined" in twin.message
        wait.until(lambda _: ["refused", "host_joined", "1"] in rows("refusals"))
        assert not browser.find_element(By.ID, "refusals-empty").is_displayed()
        start = browser.find_element(By.ID, "start")
        assert start.is_displayed()  # manual start, quorum met: POST /start would be accepted

        start.click()  # the page posts /start from the controller box: no token needed
        wait.until(lambda _: text("phase") == "training")
        assert steps() == ("training", ["waiting", "staging", "forming"])
        assert text("message").startswith("start accepted")
        wait.until(lambda _: len(rows("ranks")) == 2 and all(r[3] for r in rows("ranks")))
        ranks = rows("ranks")
        assert [r[0] for r in ranks] == ["0", "1"]
        assert all(int(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in ranks)
        assert not browser.find_element(By.ID, "start-form").is_displayed()  # the window is closed
        host_of = {r[0]: r[1] for r in ranks}

        # The charts: a line per rank once each has reported a few times.
        def drawn(chart: str) -> int:
            return int(browser.find_element(By.ID, chart).get_attribute("data-points") or 0)

        wait.until(lambda _: drawn("loss-chart") >= 6 and drawn("rate-chart") >= 6)
        lines = browser.execute_script(
            "return [...document.querySelectorAll('#loss-chart g')].map(g => "
            "[g.dataset.key, g.querySelectorAll('polyline').length, g.querySelector('title').textContent])"
        )
        assert [(key, title) for key, _, title in lines] == [
            ("0", f"rank 0 on {host_of['0']}"),
            ("1", f"rank 1 on {host_of['1']}"),
        ]
        assert all(polylines >= 1 for _, polylines, _ in lines)
        legend = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#legend li")]
        assert legend == [f"rank 0 \u00b7 {host_of['0']}", f"rank 1 \u00b7 {host_of['1']}"]

        # The CPU plane: its rounds' seconds, and each host's share of a round.
        wait.until(
            lambda _: browser.find_element(By.ID, "averaging").is_displayed() and drawn("round-chart") > 1
        )
        assert "rounds \u00b7 the last (round" in text("rounds-summary")
        shares = {r[0]: r[1] for r in rows("shares")}
        assert shares == {host_of["0"]: "33.3%", host_of["1"]: "66.7%"}

        # The timeline: the window opened, both joins, the operator's start, the formation.
        def timeline() -> list[tuple[str, str]]:
            script = (
                "return [...document.querySelectorAll('#timeline li')]"
                ".map(li => [...li.children].map(c => c.textContent))"
            )
            return [(kind, what) for _, kind, what in browser.execute_script(script)]  # time, kind, text

        events = timeline()[::-1]  # the page lists the newest first
        assert events[0] == ("open", "join window opened (quorum 2, target 2, start manual)")
        assert sorted(what.split()[1] for kind, what in events if kind == "join") == ["box-a", "box-b"]
        assert ("start", "operator start accepted") in events
        assert ("refusal", "refused box-a: host box-a already joined this run") in events
        assert ("formed", "world formed: 2 ranks on 2 hosts; training") in events

        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1100, int(height) + 120)  # the whole page in the screenshot
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "status-page-training.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

        go.write_text("")
        assert [b.result(60) for b in boxes] == [0, 0]
        wait.until(lambda _: text("phase") == "done")
        assert steps() == ("done", ["waiting", "staging", "forming", "training"])
        wait.until(lambda _: timeline()[0] == ("verdict", "run complete: every host link closed"))
        # All of it ran under the page's policy (hashed inline script and style, fetches to its
        # own origin, Trusted Types): a blocked script, style or fetch would be logged here.
        assert refusals(browser.get_log("browser")) == []
    finally:
        on(loop, ctl.close())
