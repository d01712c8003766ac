"""TLS on the controller port with a pinned certificate: walk-ins, the operator's client,
and every way a pin can be wrong."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509

from flodl_agent.agent.agent import PERMANENT, AgentFailure
from flodl_agent.controller.controller import Controller
from flodl_agent.observe.status import Unreachable, request
from flodl_agent.pin import cleartext_warning, normalize
from flodl_agent.protocol.tls import cert_fingerprint, generate
from tests.support.control_plane import agent, run, settings, walk_in

FDL = Path(sys.executable).with_name("fdl")


@pytest.fixture
def cert(tmp_path: Path) -> tuple[Path, Path, str]:
    c, k = tmp_path / "controller.pem", tmp_path / "controller.key"
    pin = generate(c, k, ["127.0.0.1", "ctrl.example"])
    return c, k, pin


def test_walk_ins_pin_the_certificate_and_train_over_tls(cert: tuple[Path, Path, str]) -> None:
    c, k, pin = cert
    assert (k.stat().st_mode & 0o777) == 0o600 and cert_fingerprint(c) == pin

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(c), str(k))))
        await ctl.start()
        addr = f"127.0.0.1:{ctl.port}"
        state = (await asyncio.to_thread(request, addr, "GET", "/state.json", pin=pin)).body
        assert state["phase"] == "waiting"
        with pytest.raises(Unreachable, match=r"presented TLS certificate sha256:.*not the pinned"):
            await asyncio.to_thread(request, addr, "GET", "/state.json", pin="sha256:" + "0" * 64)
        with pytest.raises(Unreachable, match="speaks TLS: pin its certificate"):  # plain HTTP is told why
            await asyncio.to_thread(request, addr, "GET", "/state.json")

        wrong = await walk_in(replace(agent(ctl, "wrong"), tls_fingerprint="sha256:" + "1" * 64))
        assert isinstance(wrong, AgentFailure) and wrong.code == PERMANENT
        assert "not the pinned sha256:1111" in wrong.message and "never drop the pin" in wrong.fix
        plain = await walk_in(agent(ctl, "plain"))  # no pin: a cleartext dial to a TLS port
        assert isinstance(plain, AgentFailure) and plain.code == PERMANENT  # no re-dial fixes it
        assert plain.message == "this controller speaks TLS: pin its certificate"
        assert "FDL_TLS_FINGERPRINT" in plain.fix and "permitopen" not in plain.fix
        assert ctl.admitted == 0 and ctl.dropped["cleartext"] == 2  # the HTTP request and the dial

        boxes = [replace(agent(ctl, name), tls_fingerprint=pin) for name in ("box-a", "box-b")]
        assert await asyncio.gather(*(walk_in(b) for b in boxes)) == [0, 0]
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and ctl.admitted == 2
        await ctl.close()

    run(scenario)


def test_a_pinned_client_refuses_a_controller_without_tls() -> None:
    async def scenario() -> None:
        ctl = Controller(settings())
        await ctl.start()
        refused = await walk_in(replace(agent(ctl, "a"), tls_fingerprint="sha256:" + "2" * 64))
        assert isinstance(refused, AgentFailure)
        assert "TLS handshake" in refused.message and "cluster.controller.tls" in refused.fix
        await ctl.close()

    run(scenario)


def test_the_cli_generates_prints_and_pins(tmp_path: Path) -> None:
    c, k = tmp_path / "c.pem", tmp_path / "c.key"
    made = subprocess.run(
        [str(FDL), "tls", "generate", "--cert", str(c), "--key", str(k), "--name", "127.0.0.1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0 and made.stdout.strip() == cert_fingerprint(c)
    again = subprocess.run(
        [str(FDL), "tls", "generate", "--cert", str(c), "--key", str(k)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert again.returncode == 2 and "--force" in again.stderr  # never silently re-key a fleet
    printed = subprocess.run(
        [str(FDL), "tls", "fingerprint", str(c)], capture_output=True, text=True, check=False
    )
    assert printed.stdout.strip() == made.stdout.strip()

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(c), str(k))))
        await ctl.start()
        env = {**os.environ, "NO_COLOR": "1", "FDL_TLS_FINGERPRINT": made.stdout.strip()}
        status = await asyncio.to_thread(
            subprocess.run,
            [str(FDL), "status", "--json", "--addr", f"127.0.0.1:{ctl.port}"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["phase"] == "waiting"
        # fdl join honours FDL_TLS_FINGERPRINT as status does; without a pin it stops (exit 2).
        joins = [
            asyncio.create_subprocess_exec(
                str(FDL),
                "join",
                f"127.0.0.1:{ctl.port}",
                "--host",
                name,
                "--devices",
                "cpu:1",
                env=env if pinned else {k: v for k, v in env.items() if k != "FDL_TLS_FINGERPRINT"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmp_path,
            )
            for name, pinned in (("box-a", True), ("box-b", True), ("box-c", False))
        ]
        procs = [await j for j in joins]
        done = [await asyncio.wait_for(p.communicate(), 60) for p in procs]
        codes = [p.returncode for p in procs]
        assert codes == [0, 0, 2], [e.decode()[-2000:] for _, e in done]
        assert "this controller speaks TLS: pin its certificate" in done[2][1].decode()
        await ctl.finished.wait()
        assert ctl.exit_code == 0 and ctl.admitted == 2
        await ctl.close()

    run(scenario)


def fdl_tls_generate(c: Path, k: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [str(FDL), "tls", "generate", "--cert", str(c), "--key", str(k), "--name", "127.0.0.1", *extra]
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def lifetime(c: Path) -> timedelta:
    made = x509.load_pem_x509_certificate(c.read_bytes())
    return made.not_valid_after_utc - made.not_valid_before_utc


def test_a_certificate_lives_a_year_and_never_past_the_profiles_cap(tmp_path: Path) -> None:
    c, k = tmp_path / "c.pem", tmp_path / "c.key"
    assert fdl_tls_generate(c, k).returncode == 0 and lifetime(c) == timedelta(days=365)
    assert fdl_tls_generate(c, k, "--days", "366", "--force").returncode == 0
    assert lifetime(c) == timedelta(days=366)
    for days, told in (
        ("367", "a certificate lives 1 to 366 days"),
        ("0", "1 to 366"),
        ("1y", "not a valid integer"),
    ):
        refused = fdl_tls_generate(tmp_path / "x.pem", tmp_path / "x.key", "--days", days)
        assert refused.returncode == 2 and "--days" in refused.stderr, refused.stderr
        assert told in refused.stderr, refused.stderr
        assert not (tmp_path / "x.pem").exists() and not (tmp_path / "x.key").exists()
    with pytest.raises(ValueError, match="renew it before it ends"):
        generate(tmp_path / "y.pem", tmp_path / "y.key", ["127.0.0.1"], days=3650)


def test_renewal_is_a_new_certificate_a_restart_and_a_re_pin(tmp_path: Path) -> None:
    """By hand what site.yml does for the fleet: a new certificate (--force), the controller
    restarted on it, the new pin on every worker. A worker still holding the old pin is told so
    by name and goes no further."""
    c, k = tmp_path / "c.pem", tmp_path / "c.key"
    old = fdl_tls_generate(c, k).stdout.strip()
    renewed = fdl_tls_generate(c, k, "--force")
    new = renewed.stdout.strip()
    assert renewed.returncode == 0 and new == cert_fingerprint(c) and new != old

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(c), str(k))))  # the restart: the port reads the files anew
        await ctl.start()
        addr = f"127.0.0.1:{ctl.port}"
        with pytest.raises(Unreachable, match=f"not the pinned {old}"):
            await asyncio.to_thread(request, addr, "GET", "/state.json", pin=old)
        state = (await asyncio.to_thread(request, addr, "GET", "/state.json", pin=new)).body
        assert state["phase"] == "waiting"
        await ctl.close()

    run(scenario)


def test_fingerprints_are_normalized_and_bad_ones_named() -> None:
    colons = ":".join(["AB"] * 32)
    assert normalize(colons) == "sha256:" + "ab" * 32 == normalize("SHA256:" + "AB" * 32)
    with pytest.raises(ValueError, match="not a SHA-256 fingerprint"):
        normalize("sha256:abc")


@pytest.mark.parametrize(
    ("peer", "warn"),
    [
        ("8.8.8.8", True),
        ("::ffff:8.8.4.4", True),
        ("2001:4860::8888", True),
        ("10.1.2.3", False),
        ("192.168.1.5", False),
        ("127.0.0.1", False),
        ("fe80::1", False),
        ("not-an-address", False),
    ],
)
def test_cleartext_is_called_out_only_outside_private_ranges(peer: str, warn: bool) -> None:
    assert cleartext_warning(peer) is warn


def test_the_controller_says_it_once_per_peer() -> None:
    lines: list[str] = []
    ctl = Controller(settings(), log=lines.append)
    for _ in range(3):
        ctl.listener.cleartext("8.8.8.8")
    ctl.listener.cleartext("10.0.0.1")
    assert len(lines) == 1 and "8.8.8.8 reaches the controller port in cleartext" in lines[0]
    assert "cluster.controller.tls" in lines[0]


def test_http_client_without_pin_on_tls_port_is_refused_by_the_server(cert: tuple[Path, Path, str]) -> None:
    c, k, _ = cert

    async def scenario() -> None:
        ctl = Controller(settings(tls=(str(c), str(k))))
        await ctl.start()

        def plain() -> tuple[int, dict[str, object], http.client.HTTPMessage]:
            conn = http.client.HTTPConnection("127.0.0.1", ctl.port, timeout=10)
            conn.request("GET", "/state.json")
            response = conn.getresponse()
            return response.status, json.loads(response.read()), response.headers

        # Told in cleartext what to do, and nothing of the state: no phase, no roster.
        status, body, headers = await asyncio.to_thread(plain)
        assert status == 400 and body["tls"] is True and "phase" not in body
        # under the same headers as every other answer of the port: no frame, no sniffing
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert "speaks TLS: pin its certificate" in str(body["error"])
        await ctl.close()

    run(scenario)
