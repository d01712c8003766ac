"""bench.gpu_check on a box with no GPU: the clean skip, the report, the runner, and the
verdicts that read what the checks run (`fdl probe --json`, the gpu_facts module, pytest's
JUnit XML), against those tools' real output here. bench.gpu_wheels: what the GPU image lacks."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench import gpu_check, gpu_report, gpu_wheels
from bench.gpu_report import NO_CUDA, CheckFailed
from flodl_agent.cli import main as cli

ROOT = Path(__file__).parents[2]


def test_without_a_gpu_every_check_is_skipped_and_the_command_exits_0(tmp_path: Path) -> None:
    # An empty CUDA_VISIBLE_DEVICES hides every GPU from torch, so this holds on a GPU box too.
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["cuda"] is False and doc["ok"] is True
    assert [c["name"] for c in doc["checks"]] == [c.name for c in gpu_check.CHECKS]
    assert {(c["status"], c["reason"]) for c in doc["checks"]} == {("skip", NO_CUDA)}
    assert doc["counts"] == {"pass": 0, "fail": 0, "skip": len(gpu_check.CHECKS)}
    assert sum(c.budget for c in gpu_check.CHECKS) <= gpu_check.TOTAL < 8 * 60
    text = (out / "summary.txt").read_text()
    assert f"0 passed, 0 failed, {len(gpu_check.CHECKS)} skipped" in text and "no CUDA device (" in text
    assert all(f"skip  {c.name}" in text for c in gpu_check.CHECKS) and text == done.stdout
    assert not (out / "work").exists()  # a skipped check ran nothing


def _raises(work: Path, budget: float) -> dict[str, object]:
    raise ValueError("a bug in a check")


def _exits(work: Path, budget: float) -> dict[str, object]:
    sys.exit("a helper that exits")


def _fails(work: Path, budget: float) -> dict[str, object]:
    raise CheckFailed("the GPU rank took 40% of the batches", {"share": 0.4})


def _passes(work: Path, budget: float) -> dict[str, object]:
    (work / "ran").write_text(str(budget))
    return {"rate": 12.5}


def test_a_check_that_raises_is_a_recorded_failure_and_the_exit_code_is_1(tmp_path: Path) -> None:
    checks = [
        gpu_check.Check("raises", 5, _raises),
        gpu_check.Check("exits", 5, _exits),
        gpu_check.Check("fails", 5, _fails),
        gpu_check.Check("passes", 7, _passes),
    ]
    results = gpu_check.run_all(checks, tmp_path, cuda=True)
    assert [(r.status, r.reason) for r in results] == [
        ("fail", "ValueError: a bug in a check"),
        ("fail", "SystemExit: a helper that exits"),
        ("fail", "the GPU rank took 40% of the batches"),
        ("pass", ""),
    ]
    assert results[2].figures == {"share": 0.4} and results[3].figures == {"rate": 12.5}
    assert (tmp_path / "work" / "passes" / "ran").read_text() == "7"  # its own dir and its budget
    doc = gpu_report.report(results, {"device": "NVIDIA H200", "torch": "torch 2.8"}, "cmd", "now")
    assert gpu_report.exit_code(doc) == 1 and doc["counts"] == {"pass": 1, "fail": 3, "skip": 0}
    gpu_report.write(tmp_path / "out", doc)
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == doc
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "1 passed, 3 failed, 0 skipped" in text and "machine: NVIDIA H200; torch 2.8" in text
    assert "fail  fails" in text and "      share: 0.4" in text and "pass  passes" in text


def test_a_check_that_would_overrun_the_run_is_skipped_with_the_reason(tmp_path: Path) -> None:
    results = gpu_check.run_all([gpu_check.Check("passes", 60, _passes)], tmp_path, cuda=True, total=30)
    assert [(r.status, r.reason) for r in results] == [("skip", "the run's time is spent")]
    doc = gpu_report.report(results, {"device": "NVIDIA H200"}, "cmd", "now")
    assert gpu_report.exit_code(doc) == 0


def test_the_gpu_tests_are_found_by_their_marks_not_by_a_quoted_one() -> None:
    files = gpu_check.gpu_test_files()
    assert "tests/integration/test_gpu.py" in files and "tests/integration/test_dispatch.py" in files
    assert "tests/unit/test_ci_skips.py" not in files  # its gpu mark is inside a pytester source
    assert all((ROOT / f).read_text().count("mark.gpu") for f in files)


def test_the_probe_verdict_reads_fdl_probe_json_and_names_every_false_finding() -> None:
    result = CliRunner().invoke(cli.cli, ["probe", "--json", "--no-dial"], catch_exceptions=False)
    payload = json.loads(result.output)
    torch = pytest.importorskip("torch")
    figures, problems = gpu_report.probe_verdict(payload, driver="")
    assert figures["torch"] == torch.__version__ and figures["gpus"] == []
    assert "the probe lists no NVIDIA GPU" in problems  # this box has none: the check would fail
    # The same payload as a sound H200 box gives it: no problem; then one warning more is one.
    payload["facts"]["gpus"], payload["facts"]["archs"] = {"nvidia": ["NVIDIA H200"]}, {"nvidia": ["sm_90"]}
    payload["facts"]["torch"] |= {"cuda": "12.8", "nccl": "2.27.5", "archs": ["sm_80", "sm_90"]}
    payload["findings"] = [f for f in payload["findings"] if f["level"] == "ok"] + [
        {"check": "variant", "level": "ok", "message": "torch has kernels for sm_90", "fix": ""}
    ]
    figures, problems = gpu_report.probe_verdict(payload, driver="570.86")
    assert problems == [] and figures["archs"] == ["sm_90"] and figures["driver"] == "570.86"
    payload["findings"].append({"check": "variant", "level": "warn", "message": "a GPU torch", "fix": ""})
    assert gpu_report.probe_verdict(payload)[1] == ["warn variant: a GPU torch"]


def test_the_gpu_facts_module_run_directly_parses_and_is_held_to_the_probes_spelling(tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {}}))
    done = subprocess.run(
        [sys.executable, str(gpu_check.MODULE), str(args)], capture_output=True, text=True, check=True
    )
    assert gpu_report.module_archs(done.stdout) == []  # this box: no vendor tool lists a GPU
    assert gpu_report.arch_disagreement(["sm_90"], ["sm_90"]) is None
    assert "the probe says ['sm_90'], the gpu_facts module ['9.0']" in str(
        gpu_report.arch_disagreement(["sm_90"], ["9.0"])
    )
    assert "not torch's spelling" in str(gpu_report.arch_disagreement(["90"], ["90"]))
    with pytest.raises(CheckFailed, match="gpu_facts failed: boom"):
        gpu_report.module_archs(json.dumps({"failed": True, "msg": "boom"}))


def test_junit_outcome_counts_and_names_what_did_not_pass() -> None:
    xml = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
    <testcase classname="tests.integration.test_gpu" name="test_a"/>
    <testcase classname="tests.integration.test_gpu" name="test_b">
      <failure message="assert 1 == 2"/></testcase>
    <testcase classname="tests.integration.test_dispatch" name="test_c">
      <skipped type="pytest.skip" message="needs the repository's .venv"/></testcase>
    </testsuite></testsuites>"""
    got = gpu_report.junit_outcome(xml)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["notes"] == [
        "failed tests.integration.test_gpu::test_b: assert 1 == 2",
        "skipped tests.integration.test_dispatch::test_c: needs the repository's .venv",
    ]


def test_the_walk_in_verdict_names_each_wrong_fact() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0"}
    rank = {
        "env": env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "FLODL_DEVICE": "cuda:0"},
        "backend": "nccl",
        "device": "cuda:0",
        "visible": 1,
        "all_reduce": [1.0] * 4,
        "losses": [3.0, 1.0],
    }
    assert gpu_report.walk_in_problems(rank) == []
    rank["env"] |= {"CUDA_VISIBLE_DEVICES": None, "FLODL_DEVICE": "cpu:0"}
    rank |= {"visible": 8, "backend": "gloo"}
    assert gpu_report.walk_in_problems(rank) == [
        "CUDA_VISIBLE_DEVICES=None, expected '0'",
        "FLODL_DEVICE='cpu:0', expected 'cuda:0'",
        "backend gloo, expected nccl",
        "the rank sees 8 device(s) and trains on cuda:0",
    ]


def _rank(rank: int, device: str, batches: int, digest: str = "ab" * 32) -> dict[str, object]:
    return {
        "rank": rank,
        "device": device,
        "digest": digest,
        "batches": batches,
        "samples": batches * 128,
        "rounds": 5,
        "seconds": 2.0,
        "loss": 0.1,
    }


def test_the_world_verdict_wants_one_set_of_weights_and_the_gpu_rank_the_larger_share() -> None:
    figures, problems = gpu_report.world_verdict([_rank(1, "cpu", 30), _rank(0, "cuda:0", 90)], cadence=True)
    assert problems == [] and figures["share"] == {"0": 0.75, "1": 0.25}
    assert figures["ranks"] == {"0": "cuda:0", "1": "cpu"} and figures["samples_per_s"] == 7680.0
    _, problems = gpu_report.world_verdict([_rank(0, "cuda:0", 30), _rank(1, "cpu", 30, "cd" * 32)], True)
    assert problems == [
        "the ranks end with different weights: ['abababababab', 'cdcdcdcdcdcd']",
        "the GPU rank took 50% of the batches, not the larger share",
    ]
    assert gpu_report.world_verdict([_rank(0, "cuda:0", 30), _rank(1, "cpu", 30)], cadence=False)[1] == []


def test_the_carried_wheels_are_what_the_gpu_image_lacks_at_the_venvs_versions() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {gpu_wheels.normalize(d) for d in project["dependencies"]} | {"ansible-core"}
    assert needed - gpu_wheels.IMAGE_HAS - set(gpu_wheels.CARRIED) == set()
    assert gpu_wheels.pinned() == {n: importlib.metadata.version(n) for n in gpu_wheels.CARRIED}
    argv = gpu_wheels.download_command(Path("/x/.whl"))
    assert argv[argv.index("-d") + 1] == "/x/.whl" and "--no-deps" in argv and "--only-binary=:all:" in argv
    assert argv[argv.index("--python-version") + 1] == "3.12"
    assert {a for a in argv if "==" in a} == {f"{n}=={v}" for n, v in gpu_wheels.pinned().items()}
    assert ".whl/" in (ROOT / ".gitignore").read_text().splitlines()
