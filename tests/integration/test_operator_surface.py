"""What operators look at, over real sockets: the ranks' progress in /state.json,
/metrics in Prometheus' text format, and the status page served without assets."""

from __future__ import annotations

import asyncio
import http.client
import sys
from dataclasses import replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from flodl_agent.agent.agent import AgentFailure
from flodl_agent.controller.controller import Controller
from tests.support.control_plane import REPORTING, agent, get_json, run, settings, until, walk_in


def get(ctl: Controller, path: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", ctl.port, timeout=5)
    conn.request("GET", path)
    reply = conn.getresponse()
    body = reply.read()
    conn.close()
    return reply.status, reply.getheader("content-type") or "", body


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        family.name: [(s.labels, s.value) for s in family.samples if not s.name.endswith("_created")]
        for family in text_string_to_metric_families(text)
    }


def test_ranks_progress_reaches_state_json_and_metrics(tmp_path: Path) -> None:
    beat = 0.2  # the agents' heartbeat period, shortened for the test
    go = tmp_path / "go"

    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", REPORTING], env={"GO": str(go)}))
        await ctl.start()
        boxes = [
            asyncio.ensure_future(walk_in(replace(agent(ctl, name), heartbeat_every=beat)))
            for name in ("box-a", "box-b")
        ]
        await until(lambda: ctl.window.phase == "training", timeout=30)
        twin = await walk_in(agent(ctl, "box-a"))  # the window is closed: refused, counted
        assert isinstance(twin, AgentFailure)
        # Two reports apart per rank: a step rate exists.
        await until(
            lambda: len(ctl.board.ranks) == 2 and all(s.step_rate for s in ctl.board.ranks.values()), 30
        )
        status, state = await asyncio.to_thread(get_json, ctl, "GET", "/state.json")
        assert status == 200
        assert set(state["ranks"]) == {"0", "1"}
        for rank in state["ranks"].values():
            assert rank["host"] in ("box-a", "box-b") and rank["step"] > 0 and rank["step_rate"] > 0
            assert 0 < rank["loss"] <= 1
        assert set(state["heartbeats"]) == {"box-a", "box-b"}

        status, kind, body = await asyncio.to_thread(get, ctl, "/metrics")
        assert status == 200 and kind.startswith("text/plain; version=0.0.4")
        m = samples(body.decode())
        assert ({"phase": "training"}, 1.0) in m["flodl_window_phase"]
        assert ({"phase": "waiting"}, 0.0) in m["flodl_window_phase"]
        assert m["flodl_joined_ranks"] == [({}, 2.0)] and m["flodl_joined_hosts"] == [({}, 2.0)]
        assert m["flodl_admissions"] == [({}, 2.0)]
        assert sum(v for _, v in m["flodl_refusals"]) == 1
        assert sorted(labels["rank"] for labels, _ in m["flodl_rank_step_rate"]) == ["0", "1"]
        assert all(v > 0 for _, v in m["flodl_rank_steps"])
        assert sorted(labels["host"] for labels, _ in m["flodl_heartbeat_age_seconds"]) == ["box-a", "box-b"]

        status, history = await asyncio.to_thread(get_json, ctl, "GET", "/history.json")
        assert status == 200 and set(history["ranks"]) == {"0", "1"}
        for line in history["ranks"].values():
            t, loss, rate = line["points"][-1]
            assert abs(t - state["now"]) < 60 and 0 < loss <= 1 and rate > 0  # wall-clock times
        kinds = [(e["kind"], e["text"]) for e in history["timeline"]["events"]]
        assert kinds[0][0] == "open" and ("formed", "world formed: 2 ranks on 2 hosts; training") in kinds
        assert sorted(text.split()[1] for kind, text in kinds if kind == "join") == ["box-a", "box-b"]
        assert [kind for kind, text in kinds if "box-a" in text].count("refusal") == 1  # the twin

        go.write_text("")
        assert await asyncio.gather(*boxes) == [0, 0]
        await ctl.finished.wait()
        _, history = await asyncio.to_thread(get_json, ctl, "GET", "/history.json")
        assert history["timeline"]["events"][-1]["text"] == "run complete: every host link closed"
        await ctl.close()

    run(scenario)


def test_the_status_page_is_one_self_contained_file() -> None:
    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        status, kind, page = await asyncio.to_thread(get, ctl, "/")
        assert status == 200 and kind == "text/html; charset=utf-8"
        text = page.decode()
        assert "state.json" in text and "<script>" in text
        # An air-gapped fleet: no script, style or font from anywhere else.
        assert "src=" not in text and "@import" not in text and "//" not in text.replace("// ", "")
        _, _, head = await asyncio.to_thread(get, ctl, "/metrics")
        assert b"flodl_window_phase" in head
        await ctl.close()

    run(scenario)


# A rank that reports as it goes and ends within a second.
SHORT = """
import time
from flodl_agent.observe.metrics import report
for step in range(1, 41):
    report(step, loss=1.0 / step)
    time.sleep(0.01)
"""


def test_a_run_shorter_than_a_heartbeat_still_shows_its_final_progress_and_rate() -> None:
    async def scenario() -> None:
        ctl = Controller(settings([sys.executable, "-c", SHORT], quorum=1, target=1))
        await ctl.start()
        # No periodic beat during the run: what arrives comes with the first or the last beat.
        assert await walk_in(replace(agent(ctl, "box-a"), heartbeat_every=3600.0)) == 0
        await ctl.finished.wait()
        final = ctl.board.ranks[0]
        assert final.step == 40 and final.loss == 1.0 / 40
        assert final.step_rate is not None and final.step_rate > 0  # the rank's own rate: one report suffices
        assert ctl.board.history[0].points[-1][1:] == (1.0 / 40, final.step_rate)
        await ctl.close()

    run(scenario)
