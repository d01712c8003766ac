"""The fleet, for real: `ansible-playbook site.yml` against podman hosts booting
systemd, idempotence, the door's guardrails, and a run whose workers walk in
through the door's ssh tunnel.

Marked `lab` (minutes, needs root and podman): `make test-lab` runs it, and
`make test` runs that.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from flodl_agent.pin import normalize
from flodl_agent.protocol import wire
from tests.support.lab import CONTROLLER, DOOR, ROOT, WORKERS, bare_check, booted, in_lab, journals, on, play

pytestmark = pytest.mark.lab

ARTIFACTS = ROOT / "build" / "test-artifacts" / "deploy"


def recap(output: str) -> dict[str, dict[str, int]]:
    rows = re.findall(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", output, re.M)
    return {host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)} for host, counts in rows}


def test_site_converges_then_changes_nothing(lab: dict[str, str]) -> None:
    # --check on the bare boxes (run by the lab fixture before anything else) ran through
    # and said what it would change
    dry = bare_check()
    assert dry.returncode == 0, dry.stdout[-4000:]
    assert all(c["changed"] > 0 and c["failed"] == 0 for c in recap(dry.stdout).values()), dry.stdout[-2000:]
    first = play(lab, "site.yml")
    assert first.returncode == 0, first.stdout[-4000:]
    # The second pass goes through `fdl deploy` (ansible-runner): the operator's road.
    fdl = str(ROOT / ".venv" / "bin" / "fdl")
    second = in_lab(lab, fdl, "deploy", "site.yml", "--json", "--artifacts", str(ARTIFACTS))
    assert second.returncode == 0, second.stderr[-4000:]
    report = json.loads(second.stdout)
    counts = report["recap"]
    assert set(counts) == {CONTROLLER, *WORKERS}
    assert {host: c["changed"] for host, c in counts.items()} == dict.fromkeys(counts, 0), report
    assert list(Path(report["artifacts"], "job_events").glob("*.json"))  # the event stream is kept
    # and --check on the converged fleet finds nothing to change
    dry = play(lab, "site.yml", "--check")
    assert dry.returncode == 0, dry.stdout[-4000:]
    assert {h: c["changed"] for h, c in recap(dry.stdout).items()} == dict.fromkeys(counts, 0), dry.stdout[
        -3000:
    ]


def test_the_installed_collection_converges_the_lab_by_name_away_from_the_checkout(
    lab: dict[str, str], tmp_path: Path
) -> None:
    # The tarball as Galaxy takes it, installed into an empty collections path; run from a
    # directory that is no checkout, with none of its roles_path or collections_path.
    tree = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "collection.py"), "assemble",
         str(tmp_path / "src")], capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    galaxy = str(ROOT / ".venv" / "bin" / "ansible-galaxy")
    subprocess.run([galaxy, "collection", "build", tree, "--output-path", str(tmp_path)], check=True,
                   capture_output=True)  # fmt: skip
    tarball = next(tmp_path.glob("flodl-cluster-*.tar.gz"))
    installed = tmp_path / "collections"
    settings = [line for line in (ROOT / "ansible.cfg").read_text().splitlines()
                if not line.startswith(("roles_path", "collections_path", "inventory"))]  # fmt: skip
    (tmp_path / "ansible.cfg").write_text("\n".join(settings) + "\n")
    env = {**lab, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_COLLECTIONS_PATH": str(installed),
           "ANSIBLE_ROLES_PATH": str(tmp_path / "no-roles")}  # fmt: skip
    # From here, not the checkout: its ./collections holds the collection's own sources.
    offline = [galaxy, "collection", "install", "--offline", "-p", str(installed), str(tarball)]
    subprocess.run(offline, cwd=tmp_path, env=env, check=True, capture_output=True)
    assert (installed / "ansible_collections" / "flodl" / "cluster" / "roles" / "worker").is_dir()
    away = subprocess.run(
        ["ansible-playbook", "flodl.cluster.site", "-i", lab["LAB_INVENTORY"]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    assert away.returncode == 0, away.stdout[-4000:]
    assert "flodl.cluster.controller : " in away.stdout and "flodl.cluster.worker : " in away.stdout
    # The same roles as the checkout's: on the fleet they converged, every task ok, none changed.
    counts = recap(away.stdout)
    assert set(counts) == {CONTROLLER, *WORKERS}
    assert {h: c["changed"] for h, c in counts.items()} == dict.fromkeys(counts, 0), away.stdout[-3000:]
    checkout = recap(play(lab, "site.yml").stdout)
    assert {h: c["ok"] for h, c in counts.items()} == {h: c["ok"] for h, c in checkout.items()}


def test_each_worker_holds_its_own_names_key_and_never_the_token(lab: dict[str, str]) -> None:
    token = on(CONTROLLER, "cat", "/etc/flodl/join.token").stdout.strip()
    assert len(token) == 32  # generated once on the controller: the lab inventory sets none
    mode = on(CONTROLLER, "stat", "-c", "%a %U", "/etc/flodl/join.token").stdout.split()
    assert mode == ["600", "root"]
    cluster = yaml.safe_load(on(CONTROLLER, "cat", "/etc/flodl/fdl.cluster.yml").stdout)
    assert cluster["cluster"]["controller"]["join"]["token"] == token
    keys = set()
    for worker in WORKERS:
        join = yaml.safe_load(on(worker, "cat", "/etc/flodl/fdl.yml").stdout)["join"]
        assert join["host"] == worker and "token" not in join
        assert bytes.fromhex(join["host_key"]) == wire.host_key(bytes.fromhex(token), worker)
        keys.add(join["host_key"])
        # the token is nowhere on the box
        assert on(worker, "grep", "-rq", token, "/etc/flodl", "/opt/flodl/.ssh").returncode == 1
    assert len(keys) == len(WORKERS)


def test_the_door_effective_config(lab: dict[str, str]) -> None:
    effective = on(
        CONTROLLER,
        "/usr/sbin/sshd",
        "-T",
        "-f",
        "/etc/flodl-door/sshd_config",
        "-C",
        "lport=2222,user=flodl-join,host=w,addr=10.89.3.11",
    )
    assert effective.returncode == 0, effective.stderr
    config = effective.stdout.lower()
    for line in (
        "allowtcpforwarding local",
        "permitopen 127.0.0.1:1337",
        "permittty no",
        "x11forwarding no",
        "allowagentforwarding no",
        "passwordauthentication no",
    ):
        assert line in config, line


def test_the_door_gives_no_shell_and_forwards_only_to_the_controller_port(lab: dict[str, str]) -> None:
    worker, door = WORKERS[0], "flodl-join@10.89.3.10"
    shell = on(worker, *DOOR, door, "echo", "pwned", user="flodl")
    assert "pwned" not in shell.stdout and shell.returncode != 0
    elsewhere = on(worker, *DOOR, "-W", "127.0.0.1:22", door, user="flodl")
    assert elsewhere.returncode != 0 and "SSH-2.0" not in elsewhere.stdout
    # host keys stay pinned: an unknown door is refused, never trusted on first use
    unpinned = on(
        worker,
        *[a.replace("/opt/flodl/.ssh/known_hosts", "/dev/null") for a in DOOR],
        door,
        "true",
        user="flodl",
    )
    assert unpinned.returncode != 0 and "Host key verification failed" in unpinned.stderr


def test_door_b_serves_the_tree_read_only(lab: dict[str, str]) -> None:
    on(CONTROLLER, "sh", "-c", "echo published > /opt/flodl/run/tree/marker")
    rsh = " ".join(DOOR)
    listed = on(WORKERS[0], "rsync", "-e", rsh, "flodl-join@10.89.3.10:/", user="flodl")
    assert listed.returncode == 0 and "marker" in listed.stdout, listed.stderr
    assert " gate" not in listed.stdout and " checkout" not in listed.stdout  # the tree alone
    write = on(
        WORKERS[0],
        "sh",
        "-c",
        f"echo x > /tmp/w && rsync -e '{rsh}' /tmp/w flodl-join@10.89.3.10:/w",
        user="flodl",
    )
    assert write.returncode != 0
    assert on(CONTROLLER, "test", "-e", "/opt/flodl/run/tree/w").returncode != 0


def test_door_a_mounts_the_data_root_read_only_and_it_comes_back(lab: dict[str, str]) -> None:
    on(CONTROLLER, "sh", "-c", "echo sample > /flodl/data/sample.txt")
    for worker in WORKERS:
        seen = on(worker, "cat", "/flodl/data/sample.txt", user="flodl")
        assert seen.stdout == "sample\n", seen.stderr
        write = on(worker, "sh", "-c", "echo x > /flodl/data/w")
        assert write.returncode != 0 and "Read-only file system" in write.stderr
    assert on(CONTROLLER, "test", "-e", "/flodl/data/w").returncode != 0
    # door A carries no forward and no shell, only the chrooted sftp
    data_door = "flodl-data@10.89.3.10"
    forward = on(WORKERS[0], *DOOR, "-W", "127.0.0.1:1337", data_door, user="flodl")
    assert forward.returncode != 0
    shell = on(WORKERS[0], *DOOR, data_door, "cat", "/etc/hostname", user="flodl")
    assert shell.returncode != 0 and "controller" not in shell.stdout
    # the controller restarts: sshfs reconnects on the next read
    assert on(CONTROLLER, "systemctl", "restart", "flodl-door.service").returncode == 0
    assert on(WORKERS[0], "cat", "/flodl/data/sample.txt").stdout == "sample\n"
    # its sshfs dies: the join unit's next start remounts it
    on(WORKERS[1], "pkill", "-9", "-f", "^/sbin/mount.fuse.sshfs")
    assert "not connected" in on(WORKERS[1], "cat", "/flodl/data/sample.txt").stderr
    assert on(WORKERS[1], "systemctl", "restart", "flodl-join.service").returncode == 0
    assert on(WORKERS[1], "cat", "/flodl/data/sample.txt").stdout == "sample\n"
    # the worker reboots: the mount unit brings the root back at boot
    subprocess.run(["podman", "restart", WORKERS[0]], check=True, capture_output=True, timeout=120)
    assert booted(WORKERS[0]) in {"running", "degraded"}
    assert on(WORKERS[0], "systemctl", "is-active", "flodl-data.mount").stdout.strip() == "active"
    assert on(WORKERS[0], "cat", "/flodl/data/sample.txt").stdout == "sample\n"


def test_probe_yml_finds_every_box_ready_then_names_a_dead_data_mount(lab: dict[str, str]) -> None:
    ready = play(lab, "playbooks/probe.yml")
    assert ready.returncode == 0, ready.stdout[-4000:]
    assert {h: c["failed"] for h, c in recap(ready.stdout).items()} == dict.fromkeys(
        [CONTROLLER, *WORKERS], 0
    )
    on(WORKERS[1], "pkill", "-9", "-f", "^/sbin/mount.fuse.sshfs")
    try:
        broken = play(lab, "playbooks/probe.yml")
        assert broken.returncode != 0
        assert (
            recap(broken.stdout)[WORKERS[1]]["failed"] == 1
            and recap(broken.stdout)[WORKERS[0]]["failed"] == 0
        )
        assert f"{WORKERS[1]} is not ready: the data mount at /flodl/data is not connected" in broken.stdout
    finally:
        assert on(WORKERS[1], "systemctl", "restart", "flodl-join.service").returncode == 0


def test_a_run_walks_both_workers_in_through_the_door(lab: dict[str, str]) -> None:
    run = play(lab, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
    assert run.returncode == 0, run.stdout[-3000:] + journals()
    assert "run complete: every host link closed" in run.stdout
    for worker in WORKERS:
        assert f"admitted {worker}" in run.stdout
    # the ranks trained one model across the containers (gloo, rendezvous through the door)
    weights = set(
        re.findall(r"\[rank \d\] rank \d/2 on cpu:0: loss [\d.]+, (w=[-\d.]+ b=[-\d.]+)", run.stdout)
    )
    assert len(weights) == 1, run.stdout[-3000:]
    units = [on(w, "systemctl", "is-enabled", "flodl-join.service").stdout.strip() for w in WORKERS]
    assert units == ["enabled", "enabled"]


def test_a_run_goes_through_tls_end_to_end(lab: dict[str, str]) -> None:
    # `-e flodl_controller_tls=true` is a string, the way an operator types it: every role takes it
    # as a bool, and the workers' pins and the controller's cluster file agree.
    tls = play(lab, "site.yml", "-e", "flodl_controller_tls=true")
    try:
        assert tls.returncode == 0, tls.stdout[-4000:]
        pin = on(CONTROLLER, "fdl", "tls", "fingerprint", "/etc/flodl/tls/controller.pem").stdout.strip()
        assert pin.startswith("sha256:")
        for worker in WORKERS:
            join = yaml.safe_load(on(worker, "cat", "/etc/flodl/fdl.yml").stdout)["join"]
            assert normalize(join["tls_fingerprint"]) == pin
        # run.yml's wait pins the certificate the cluster file serves; the walk-ins pin it
        # through the door's tunnel; the controller's log is the run unit's journal.
        run = play(lab, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
        assert run.returncode == 0, run.stdout[-3000:] + journals()
        assert "run complete: every host link closed" in run.stdout
        for worker in WORKERS:
            assert f"admitted {worker}" in run.stdout
        # The run left no log file: its log is the unit's journal. (A cleartext `fdl status`
        # against a live TLS port is told what the port speaks: tests/integration/test_tls.py.)
        assert on(CONTROLLER, "test", "-e", "/var/log/flodl-run.log").returncode == 1
        # The certificate lives a year; one nearing its end (here: a window longer than its
        # life) is renewed by site.yml, and every worker re-pinned to it in the same pass.
        cert = "/etc/flodl/tls/controller.pem"
        life = on(CONTROLLER, "openssl", "x509", "-in", cert, "-noout", "-startdate", "-enddate").stdout
        assert (
            on(CONTROLLER, "openssl", "x509", "-in", cert, "-noout", "-checkend", str(366 * 86400)).returncode
            == 1
        )
        renewed = play(
            lab, "site.yml", "-e", "flodl_controller_tls=true", "-e", "flodl_controller_tls_renew_days=400"
        )
        assert renewed.returncode == 0, renewed.stdout[-4000:]
        fresh = on(CONTROLLER, "fdl", "tls", "fingerprint", cert).stdout.strip()
        assert fresh.startswith("sha256:") and fresh != pin, life
        text = on(CONTROLLER, "openssl", "x509", "-in", cert, "-noout", "-text").stdout
        assert (
            "Authority Key Identifier" in text
            and "CA:FALSE" in text
            and "TLS Web Server Authentication" in text
        )
        for worker in WORKERS:
            join = yaml.safe_load(on(worker, "cat", "/etc/flodl/fdl.yml").stdout)["join"]
            assert normalize(join["tls_fingerprint"]) == fresh
        again = play(lab, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
        assert again.returncode == 0, again.stdout[-3000:] + journals()
    finally:
        restored = play(lab, "site.yml")  # cleartext again, for the suites after this one
        assert restored.returncode == 0, restored.stdout[-4000:]


PUBLISHED = """import sys
print("published args:", " ".join(sys.argv[1:]), flush=True)
from flodl_agent.demo_rank import main
main()
"""


def test_a_standing_fleet_picks_up_each_publish_on_its_next_dial(lab: dict[str, str]) -> None:
    # The operator's project on the controller, published as the service user.
    made = on(
        CONTROLLER, "sh", "-c", "mkdir -p /opt/flodl/src && cat > /opt/flodl/src/train.py", user="flodl"
    )
    assert made.returncode == 0, made.stderr
    subprocess.run(
        ["podman", "exec", "-i", "--user", "flodl", CONTROLLER, "sh", "-c", "cat > /opt/flodl/src/train.py"],
        input=PUBLISHED,
        text=True,
        check=True,
        timeout=60,
    )

    def publish(*args: str) -> None:
        done = on(
            CONTROLLER,
            "fdl",
            "publish",
            "file:///opt/flodl/src",
            "--to",
            "/opt/flodl/run",
            "--bin",
            "train.py",
            "--json",
            "--",
            *args,
            user="flodl",
        )
        assert done.returncode == 0 and json.loads(done.stdout)["published"], done.stdout + done.stderr

    # The workers fetch through door B (rrsync, the join key) on every dial.
    source = json.dumps({"flodl_worker_source": {"from": "rsync://flodl-join@10.89.3.10:2222:/"}})
    try:
        publish("--first")
        converged = play(lab, "site.yml", "-e", source)
        assert converged.returncode == 0, converged.stdout[-4000:]
        for expected in ("--first", "--second"):
            if expected == "--second":
                publish(expected)  # nothing is edited on the workers
            run = play(lab, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
            assert run.returncode == 0, run.stdout[-3000:] + journals()
            assert run.stdout.count(f"published args: {expected}") == 2, run.stdout[-3000:] + journals()
    finally:
        restored = play(lab, "site.yml")
        assert restored.returncode == 0, restored.stdout[-4000:]


def test_a_mistyped_variable_stops_the_play_naming_it(lab: dict[str, str]) -> None:
    bad = play(lab, "site.yml", "-e", "flodl_worker_door_port=abc", "--check")
    assert bad.returncode != 0
    assert "flodl_worker_door_port" in bad.stdout and "convert to int" in bad.stdout
    impossible = play(lab, "site.yml", "-e", json.dumps({"flodl_controller_door_port": 1337}), "--check")
    assert impossible.returncode != 0 and "must be distinct ports" in impossible.stdout


WHEELHOUSE = ROOT / "build" / "lab" / "wheels"
VARIANTS = {WORKERS[0]: "cu126", WORKERS[1]: "rocm6.4"}


def serve_variant_indexes(
    root: Path, variants: list[str]
) -> tuple[ThreadingHTTPServer, list[tuple[str, str]]]:
    """A PEP 503 simple index per variant on the lab's gateway, each holding the lab's
    wheels (a CPU torch in every one is enough: what is proved is the routing); the
    requests (client address, path) are kept."""
    for variant in variants:
        for wheel in WHEELHOUSE.glob("*.whl"):
            project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
            folder = root / variant / "simple" / project
            folder.mkdir(parents=True, exist_ok=True)
            (folder / wheel.name).symlink_to(wheel)
    seen: list[tuple[str, str]] = []

    class Index(SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            seen.append((self.client_address[0], self.path))

    server = ThreadingHTTPServer(("10.89.3.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def variant_indexes(lab: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    server, seen = serve_variant_indexes(tmp_path, sorted(set(VARIANTS.values())))
    try:
        yield f"http://10.89.3.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()


RANK_PREFIX = (
    "import sys; print('rank python', sys.prefix, flush=True); from flodl_agent.demo_rank import main; main()"
)


def test_each_variant_comes_from_its_own_index_and_its_ranks_run_it(
    lab: dict[str, str], variant_indexes: tuple[str, list[tuple[str, str]]]
) -> None:
    base, seen = variant_indexes
    host_vars = Path(lab["ANSIBLE_INVENTORY"]).parent / "host_vars"
    host_vars.mkdir(exist_ok=True)
    for worker, variant in VARIANTS.items():
        (host_vars / f"{worker}.yml").write_text(f"flodl_worker_libtorch: {variant}\n")
    sources = {v: f"{base}/{v}/simple" for v in VARIANTS.values()}
    try:
        converged = play(lab, "site.yml", "-e", json.dumps({"flodl_worker_torch_sources": sources}))
        assert converged.returncode == 0, converged.stdout[-4000:]
        addresses = {WORKERS[0]: "10.89.3.11", WORKERS[1]: "10.89.3.12"}
        for worker, variant in VARIANTS.items():
            asked = {path.split("/")[1] for client, path in seen if client == addresses[worker]}
            assert asked == {variant}, (worker, seen)  # torch and its kin from its own index, nothing else
            assert any(p.startswith(f"/{variant}/simple/torch/") for c, p in seen if c == addresses[worker])
            venv_torch = on(worker, f"/opt/flodl/libtorch/{variant}/bin/python", "-c", "import torch")
            assert venv_torch.returncode == 0, venv_torch.stderr
        run = play(
            lab,
            "playbooks/run.yml",
            "-e",
            "flodl_run_timeout=300",
            "-e",
            json.dumps({"flodl_run_command": ["python", "-c", RANK_PREFIX]}),
        )
        assert run.returncode == 0, run.stdout[-3000:] + journals()
        for worker, variant in VARIANTS.items():
            said = on(worker, "journalctl", "-u", "flodl-join.service", "-o", "cat", "--grep", "rank python")
            last = said.stdout.splitlines()[-1] if said.stdout else ""
            assert last.endswith(f"rank python /opt/flodl/libtorch/{variant}"), said.stdout
    finally:
        for worker in VARIANTS:
            (host_vars / f"{worker}.yml").unlink()
        restored = play(lab, "site.yml")
        assert restored.returncode == 0, restored.stdout[-4000:]


def test_a_golden_image_worker_walks_in_under_its_own_hostname_with_the_images_key(
    lab: dict[str, str],
) -> None:
    # The lab declares flodl_controller_images: [lab-image] on the controller (tests/lab/lab).
    golden = play(lab, "playbooks/golden_image.yml", "-e", f"flodl_golden_hosts={WORKERS[1]}")
    assert golden.returncode == 0, golden.stdout[-4000:]
    join = yaml.safe_load(on(WORKERS[1], "cat", "/etc/flodl/fdl.yml").stdout)["join"]
    # no roster name baked in (the box's own at run time), and the variant picked at join
    assert "host" not in join and join["persist"] and join["libtorch"] == "auto"
    image_key = on(
        CONTROLLER, "ssh-keygen", "-lf", "/etc/flodl-door/images/lab-image_ed25519.pub"
    ).stdout.split()[1]
    baked = on(WORKERS[1], "ssh-keygen", "-lf", "/opt/flodl/.ssh/join_ed25519").stdout.split()[1]
    assert baked == image_key  # the worker's own key is gone from the box: only the image's can get it in
    started = on(CONTROLLER, "date", "+%Y-%m-%d %H:%M:%S").stdout.strip()
    run = play(lab, "playbooks/run.yml", "-e", "flodl_run_timeout=300")
    assert run.returncode == 0, run.stdout[-4000:]
    assert f"admitted {WORKERS[1]}" in run.stdout  # the container's hostname, read at run time
    door = on(CONTROLLER, "journalctl", "-u", "flodl-door.service", "--since", started, "-o", "cat")
    accepted = re.findall(
        r"^Accepted publickey for flodl-join from 10\.89\.3\.12 port \d+ ssh2: ED25519 (\S+)$",
        door.stdout,
        re.M,
    )
    assert accepted and set(accepted) == {image_key}, door.stdout[-2000:]
    # undeclared, the image's key is deleted and its clones stay out
    # (with the role's image tasks alone: site.yml would authorize the key the clone holds as
    # an inventory worker's own)
    retired = play(lab, "tests/ansible/door_images.yml", "-e", json.dumps({"flodl_controller_images": []}))
    assert retired.returncode == 0, retired.stdout[-4000:]
    assert on(CONTROLLER, "test", "-e", "/etc/flodl-door/images/lab-image_ed25519").returncode != 0
    refused = on(WORKERS[1], *DOOR, "-W", "127.0.0.1:1337", "flodl-join@10.89.3.10", user="flodl")
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
