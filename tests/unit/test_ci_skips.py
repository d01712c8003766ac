"""The CI rule of tests/conftest.py, run on small suites of its own: under CI=true a skip fails
with its reason (a missing install step must not turn CI green), except in `gpu` tests."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest

def test_skips_in_its_body():
    pytest.skip("rsync is not installed")

@pytest.mark.skipif(True, reason="sshfs or /dev/fuse missing")
def test_skipped_by_a_marker():
    pass

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no GPU: needs a CUDA device")

@pytest.mark.gpu
def test_gpu_wants_sshd():
    pytest.skip("sshd is not installed")

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    assert False

@pytest.mark.lab
def test_in_the_lab():
    pytest.skip("the lab needs root")

def test_passes():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    # The hooks under test, as the project's conftest defines them.
    pytester.makeconftest("from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport")
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n    lab: needs the lab\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_under_ci_a_skip_fails_naming_its_reason_and_the_install_step(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-m", "not lab", "-rA")
    # A skip in the body fails the test; one at set-up (a skipif marker) errors it.
    result.assert_outcomes(passed=1, failed=2, errors=1, skipped=1, xfailed=1, deselected=1)
    result.stdout.fnmatch_lines(["*rsync is not installed*", "*sshfs or /dev/fuse missing*"])
    result.stdout.fnmatch_lines(["*sshd is not installed*"])  # a gpu test, but not for want of a GPU
    result.stdout.fnmatch_lines(["*CI=true: install it from the project (scripts/system-deps*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_under_ci_a_gpu_test_may_still_skip(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-k", "needs_a_gpu or known_bug or passes")
    result.assert_outcomes(passed=1, skipped=1, xfailed=1, deselected=4)
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_off_ci_a_skip_stays_a_skip(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = suite.runpytest("-m", "not lab")
    result.assert_outcomes(passed=1, skipped=4, xfailed=1, deselected=1)
    assert result.ret == pytest.ExitCode.OK


def test_under_ci_a_module_skipped_at_import_is_a_collection_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest("from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport")
    pytester.makepyfile(
        test_ray='import pytest\nray = pytest.importorskip("no_such_module_ray")\n\ndef test_x():\n    pass\n'
    )
    monkeypatch.delenv("CI", raising=False)
    assert pytester.runpytest().ret == pytest.ExitCode.NO_TESTS_COLLECTED
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*ERROR collecting test_ray.py*", "*no_such_module_ray*", "*CI=true*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED
