"""Fixtures shared by every suite, and the CI rule: under CI=true a skip is a failure."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.support import NO_GPU
from tests.support import sshd as sshd_kit

CI_HINT = "CI=true: install it from the project (scripts/system-deps or pyproject extras)"
# NO_GPU starts the one skip reason CI allows, and only in a `gpu` test: a gpu test missing its
# sshd, venv or torch still fails there.


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _skip_reason(report: pytest.BaseReport) -> str:
    longrepr = report.longrepr
    # A skip's longrepr is (path, line, "Skipped: reason").
    return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)


def _excused(node: pytest.Item | pytest.Collector, report: pytest.BaseReport) -> bool:
    """A `gpu` test or module skipped for want of a GPU, the one skip CI lets through."""
    return node.get_closest_marker("gpu") is not None and _skip_reason(report).startswith(
        (NO_GPU, f"Skipped: {NO_GPU}")
    )


def _fail_the_skip(report: pytest.BaseReport) -> None:
    report.outcome = "failed"
    report.longrepr = f"{_skip_reason(report)}\n{CI_HINT}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A missing tool or install step must not turn CI green by skipping: only a `gpu` test may
    skip there, and only for want of a GPU (no CI box is promised one). xfail reports as a skip
    too; it is left alone."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and not _excused(item, report) and _on_ci():
        _fail_the_skip(report)
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """The same rule for a whole module skipped at import (importorskip, allow_module_level)."""
    report = yield
    if report.skipped and not _excused(collector, report) and _on_ci():
        _fail_the_skip(report)
    return report


@pytest.fixture
def two_workers() -> str:
    return textwrap.dedent(
        """\
        cluster:
          controller:
            host: 10.0.0.1
          workers:
            - host: node-a
              local_devices: [0, 1]
              nccl_socket_ifname: eth0
            - host: node-b
              local_devices: cpu:2
              nccl_socket_ifname: eth0
        """
    )


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[sshd_kit.Sshd]:
    """A private OpenSSH server on loopback, its host key pinned on the client side."""
    if why := sshd_kit.missing():
        pytest.skip(why)
    with sshd_kit.serve(tmp_path / "sshd") as server:
        yield server
