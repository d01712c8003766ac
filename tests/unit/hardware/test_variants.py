"""join.libtorch over facts: which venv runs the join, what to acquire, how pip is called."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flodl_agent.cli.options import OptionError, resolve_libtorch
from flodl_agent.config import ConfigError, Join, load_config
from flodl_agent.errors import PERMANENT, TRANSIENT
from flodl_agent.hardware.gpus import Gpu, Torch
from flodl_agent.hardware.variants import (
    BoxGpus,
    Choice,
    Venv,
    build_variant,
    choose,
    coverage,
    covering,
    cpu_box,
    cuda_to_acquire,
    default_source,
    explicit,
    fleet_argv,
    index_args,
    libtorch_root,
    listing,
    parse_driver_cuda,
    parse_facts,
    pip_failure,
    rocm_to_acquire,
    rocm_variant,
    source_for,
    torch_argv,
)
from flodl_agent.retry import Permanent

ROOT = Path("/opt/flodl/libtorch")
CPU = Torch(version="2.13.0+cpu")
CU118 = Torch(version="2.13.0+cu118", cuda="11.8", archs=["sm_50", "sm_60", "sm_70", "sm_80", "sm_86"])
CU126 = Torch(version="2.13.0+cu126", cuda="12.6", archs=["sm_50", "sm_80", "sm_90"])
CU128 = Torch(version="2.13.0+cu128", cuda="12.8", archs=["sm_80", "sm_90", "sm_100", "sm_120"])
ROCM64 = Torch(version="2.13.0+rocm6.4", hip="6.4.43482-0f2d60242", archs=["gfx90a", "gfx942"])
BROKEN = Torch(error="ImportError: libcudart.so.12: cannot open shared object file")


def venv(name: str, torch: Torch, fdl: bool = True) -> Venv:
    return Venv(name, ROOT / name, torch, fdl)


DEV = Venv(".venv", Path("/work/main/.venv"), CPU)  # a running venv outside the root
A40 = Gpu(0, "nvidia", "NVIDIA A40", "sm_86")
PRO6000 = Gpu(1, "nvidia", "NVIDIA RTX PRO 6000", "sm_120")
MI300 = Gpu(0, "amd", "AMD gfx942", "gfx942")
W7900 = Gpu(0, "amd", "AMD gfx1100", "gfx1100")


# --- explicit variants ---------------------------------------------------------------


def test_an_explicit_variant_that_is_installed_runs_there() -> None:
    choice = choose("cu126", [venv("cpu", CPU), venv("cu126", CU126)], BoxGpus(), DEV)
    assert (choice.variant, choice.venv, choice.acquire) == ("cu126", ROOT / "cu126", False)


def test_an_explicit_variant_that_is_missing_is_acquired() -> None:
    choice = choose("cu128", [venv("cu126", CU126)], BoxGpus(), DEV, root=ROOT)
    assert (choice.variant, choice.venv, choice.acquire) == ("cu128", None, True)
    assert "not installed" in choice.reason


def test_an_explicit_variant_the_running_venv_is_stays() -> None:
    assert choose("cpu", [], BoxGpus(), DEV).venv == DEV.path


def test_an_explicit_variant_whose_venv_is_broken_is_permanent_with_the_fix() -> None:
    with pytest.raises(Permanent) as caught:
        choose("cu126", [venv("cu126", BROKEN)], BoxGpus(), DEV)
    assert "libcudart" in caught.value.message
    assert f"remove {ROOT / 'cu126'}" in caught.value.fix
    with pytest.raises(Permanent, match="no bin/fdl"):
        choose("cpu", [venv("cpu", CPU, fdl=False)], BoxGpus(), DEV)


# --- auto ----------------------------------------------------------------------------


def test_auto_on_a_cpu_box_prefers_the_cpu_variant() -> None:
    running = venv("cu126", CU126)
    choice = choose("auto", [venv("cpu", CPU), running], BoxGpus(), running)
    assert (choice.variant, choice.venv) == ("cpu", ROOT / "cpu")
    assert choice.reason == "a CPU box"


def test_auto_on_a_cpu_box_without_a_cpu_variant_stays_in_the_running_venv() -> None:
    running = venv("cu126", CU126)
    choice = choose("auto", [running, venv("cu128", CU128)], BoxGpus(), running)
    assert choice.venv == running.path
    assert "runs CPU ranks" in choice.reason


def test_auto_on_a_cpu_box_with_no_working_torch_acquires_cpu() -> None:
    running = Venv("venv", Path("/opt/flodl/venv"), Torch(error="ModuleNotFoundError: torch"))
    assert choose("auto", [venv("cu126", BROKEN)], BoxGpus(), running).variant == "cpu"


@pytest.mark.parametrize(
    ("gpus", "installed", "expected", "reason"),
    [
        # both cover an A40: the newest wins
        ([A40], ["cpu", "cu118", "cu126"], "cu126", "cu126 covers GPU 0 (sm_86)"),
        # an sm_120 card: only cu128 ships its kernels
        ([A40, PRO6000], ["cu126", "cu128"], "cu128", "cu128 covers GPU 0 (sm_86), GPU 1 (sm_120)"),
        # a CPU variant never serves GPUs
        ([A40], ["cpu", "cu126"], "cu126", "cu126 covers GPU 0 (sm_86)"),
        # AMD: exact gfx; a ROCm build is picked for AMD cards, never a CUDA one
        ([MI300], ["cu128", "rocm6.4"], "rocm6.4", "rocm6.4 covers GPU 0 (gfx942)"),
    ],
)
def test_auto_with_cards_picks_the_newest_covering_variant(
    gpus: list[Gpu], installed: list[str], expected: str, reason: str
) -> None:
    facts = {"cpu": CPU, "cu118": CU118, "cu126": CU126, "cu128": CU128, "rocm6.4": ROCM64}
    venvs = [venv(name, facts[name]) for name in installed]
    choice = choose("auto", venvs, BoxGpus(gpus, "12.8"), DEV)
    assert (choice.variant, choice.venv, choice.reason) == (expected, ROOT / expected, reason)


def test_auto_with_uncovered_nvidia_cards_acquires_the_newest_the_driver_runs() -> None:
    choice = choose("auto", [venv("cu126", CU126)], BoxGpus([PRO6000], "12.8"), DEV)
    assert (choice.variant, choice.acquire) == ("cu128", True)
    assert choice.reason.startswith("no installed variant covers GPU 1 (sm_120)")
    # the configured sources' keys bound the pick, the driver caps it
    sources = {"cu124": "/srv/wheels", "cu126": "https://mirror.example/whl/cu126", "cu130": "/srv/w"}
    assert choose("auto", [], BoxGpus([A40], "12.6"), DEV, sources).variant == "cu126"
    assert choose("auto", [], BoxGpus([A40], "13.1"), DEV, sources).variant == "cu130"


def test_auto_with_an_amd_card_no_variant_covers_acquires_the_installed_rocm() -> None:
    choice = choose("auto", [venv("rocm6.4", ROCM64)], BoxGpus([W7900], rocm="6.2.4-120\n"), DEV)
    assert (choice.variant, choice.acquire) == ("rocm6.2", True)
    assert "(gfx1100)" in choice.reason
    assert choose("auto", [], BoxGpus([W7900]), DEV, {"rocm6.3": "/w", "rocm6.4": "/w"}).variant == "rocm6.4"


@pytest.mark.parametrize(
    ("box", "why"),
    [
        (BoxGpus([A40]), "driver's CUDA version is unknown"),
        (BoxGpus([A40], "11.4"), "older than every known variant"),
        (BoxGpus([W7900]), "no ROCm version is known"),
    ],
)
def test_auto_with_nothing_determinable_is_permanent_and_names_the_fix(box: BoxGpus, why: str) -> None:
    with pytest.raises(Permanent) as caught:
        choose("auto", [venv("cpu", CPU)], box, DEV, root=ROOT)
    assert why in caught.value.message
    assert caught.value.code == PERMANENT
    assert "libtorch: cu126" in caught.value.fix and str(ROOT) in caught.value.fix


def test_a_venv_whose_torch_does_not_import_is_skipped_by_auto() -> None:
    choice = choose("auto", [venv("cu128", BROKEN), venv("cu126", CU126)], BoxGpus([A40], "12.8"), DEV)
    assert choice.venv == ROOT / "cu126"


# --- choose's rules, one at a time ----------------------------------------------------

FIX = f"set libtorch: cu126 (or rocm6.4, --libtorch) explicitly, or install a covering variant in {ROOT}"
RUNNING = venv("cu126", CU126)
DEV_CU126 = Venv(".venv", Path("/work/main/.venv"), CU126)


@pytest.mark.parametrize(
    ("step", "args", "expected"),
    [
        # explicit: installed, the running venv's own, missing, broken
        (
            explicit,
            ("cu126", [venv("cpu", CPU), RUNNING], DEV, ROOT),
            Choice("cu126", ROOT / "cu126", f"cu126 as asked, installed at {ROOT / 'cu126'}"),
        ),
        (
            explicit,
            ("cpu", [venv("cu126", CU126)], DEV, ROOT),
            Choice("cpu", DEV.path, "cpu as asked: the running venv is cpu"),
        ),
        (
            explicit,
            ("cu128", [], DEV, ROOT),
            Choice("cu128", None, f"cu128 as asked, not installed under {ROOT}"),
        ),
        (
            explicit,
            ("cpu", [venv("cpu", CPU, fdl=False)], DEV, ROOT),
            Permanent(
                f"libtorch cpu: the venv at {ROOT / 'cpu'} cannot run the agent: "
                "flodl-fleet is not installed in it (no bin/fdl)",
                f"remove {ROOT / 'cpu'} so join acquires it again, or reinstall it",
            ),
        ),
        # a CPU box: cpu first, then the running venv over another installed one, else acquire cpu
        (cpu_box, ([RUNNING, venv("cpu", CPU)], RUNNING), Choice("cpu", ROOT / "cpu", "a CPU box")),
        (
            cpu_box,
            ([venv("cu128", CU128), RUNNING], RUNNING),
            Choice("cu126", RUNNING.path, "a CPU box; cu126 runs CPU ranks"),
        ),
        (cpu_box, ([], DEV), Choice("cpu", None, "a CPU box with no working torch venv")),
        # covering: the newest build of the cards' vendor, the running venv of equals; none for an sm_120
        (
            covering,
            ([venv("cu118", CU118), venv("cu126", CU126), venv("rocm6.4", ROCM64)], "nvidia", [A40], DEV),
            Choice("cu126", ROOT / "cu126", "cu126 covers GPU 0 (sm_86)"),
        ),
        (
            covering,
            ([RUNNING, venv("cu118", CU118), DEV_CU126], "nvidia", [A40], DEV_CU126),
            Choice("cu126", DEV_CU126.path, "cu126 covers GPU 0 (sm_86)"),
        ),
        (covering, ([venv("cu126", CU126), venv("rocm6.4", ROCM64)], "nvidia", [PRO6000], DEV), None),
        # the CUDA to acquire: the newest the driver runs; no driver version or too old a one is permanent
        (
            cuda_to_acquire,
            ([PRO6000], "12.8", {}, ROOT),
            Choice(
                "cu128",
                None,
                "no installed variant covers GPU 1 (sm_120); the driver runs CUDA 12.8: acquiring cu128",
            ),
        ),
        (
            cuda_to_acquire,
            ([A40], "12.9", {"cu124": "/w", "cu126": "/w", "rocm6.4": "/w"}, ROOT),
            Choice(
                "cu126",
                None,
                "no installed variant covers GPU 0 (sm_86); the driver runs CUDA 12.9: acquiring cu126",
            ),
        ),
        (
            cuda_to_acquire,
            ([A40], "", {}, ROOT),
            Permanent(
                "libtorch auto: no installed variant covers GPU 0 (sm_86), "
                "and the driver's CUDA version is unknown",
                FIX,
            ),
        ),
        (
            cuda_to_acquire,
            ([A40], "12.2", {"cu124": "/w", "cu126": "/w"}, ROOT),
            Permanent(
                "libtorch auto: no installed variant covers GPU 0 (sm_86), "
                "and the driver's CUDA 12.2 is older than every known variant (cu124, cu126)",
                "upgrade the NVIDIA driver, or " + FIX,
            ),
        ),
        # the ROCm to acquire: the installed one's, else the newest source; neither is permanent
        (
            rocm_to_acquire,
            ([W7900], "6.2.4-120\n", {"rocm6.4": "/w"}, ROOT),
            Choice(
                "rocm6.2",
                None,
                "no installed variant covers GPU 0 (gfx1100); ROCm 6.2 on this box: acquiring rocm6.2",
            ),
        ),
        (
            rocm_to_acquire,
            ([W7900], "", {"rocm6.3": "/w", "rocm6.4": "/w", "cu130": "/w"}, ROOT),
            Choice(
                "rocm6.4",
                None,
                "no installed variant covers GPU 0 (gfx1100); ROCm 6.4 on this box: acquiring rocm6.4",
            ),
        ),
        (
            rocm_to_acquire,
            ([W7900], "", {"cu126": "/w"}, ROOT),
            Permanent(
                "libtorch auto: no installed variant covers GPU 0 (gfx1100), and no ROCm version is known "
                "(no /opt/rocm/.info/version, no rocm key in join.torch_sources)",
                FIX,
            ),
        ),
    ],
)
def test_each_rule_of_choose_gives_its_choice_or_refusal(
    step: Callable[..., Choice | None], args: tuple[Any, ...], expected: Choice | Permanent | None
) -> None:
    if isinstance(expected, Permanent):
        with pytest.raises(Permanent) as caught:
            step(*args)
        assert (caught.value.message, caught.value.fix) == (expected.message, expected.fix)
    else:
        assert step(*args) == expected


# --- facts ---------------------------------------------------------------------------


def test_facts_parse_and_a_garbled_answer_is_an_error_not_a_crash() -> None:
    text = '{"version": "2.13.0+cu126", "cuda": "12.6", "hip": "", "archs": ["sm_80"], "error": ""}\n'
    assert parse_facts("a warning\n" + text) == Torch(version="2.13.0+cu126", cuda="12.6", archs=["sm_80"])
    with_nccl = text.replace('"error"', '"nccl": "2.27.3", "error"')
    assert parse_facts(with_nccl).nccl == "2.27.3"
    assert "printed no torch facts" in parse_facts("Segmentation fault").error
    assert [build_variant(t) for t in (CPU, CU126, CU128, ROCM64)] == ["cpu", "cu126", "cu128", "rocm6.4"]


def test_the_driver_and_rocm_versions() -> None:
    header = "| NVIDIA-SMI 560.35.03    Driver Version: 560.35.03    CUDA Version: 12.6     |"
    assert parse_driver_cuda(header) == "12.6"
    assert parse_driver_cuda("NVIDIA-SMI has failed") == ""
    assert rocm_variant("6.4.1-120\n") == "rocm6.4"
    assert rocm_variant("") == ""


def test_the_root_is_the_roles_layout_else_home() -> None:
    home = Path("/home/u")
    assert libtorch_root(Path("/opt/flodl/libtorch/cu126"), {}, home) == Path("/opt/flodl/libtorch")
    assert libtorch_root(Path("/work/main/.venv"), {}, home) == Path("/home/u/.flodl/libtorch")
    env = {"FLODL_LIBTORCH_ROOT": "/srv/lt"}
    assert libtorch_root(Path("/opt/flodl/libtorch/cu126"), env, home) == Path("/srv/lt")


# --- sources and pip -----------------------------------------------------------------


def test_source_defaults_live_in_one_place() -> None:
    assert default_source("cu126") == "https://download.pytorch.org/whl/cu126"
    assert default_source("cpu") == "https://download.pytorch.org/whl/cpu"
    assert source_for("cu126", {"cu126": "/srv/wheels"}) == "/srv/wheels"
    assert source_for("rocm6.4", {"cu126": "/srv/wheels"}) == "https://download.pytorch.org/whl/rocm6.4"


def test_pip_arguments_per_source() -> None:
    py = Path("/x/bin/python")
    head = ["/x/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    assert torch_argv(py, "https://download.pytorch.org/whl/cu126") == [
        *head,
        "--index-url",
        "https://download.pytorch.org/whl/cu126",
        "torch",
    ]
    assert index_args("http://mirror.lan:8080/whl/cu126") == [
        "--index-url",
        "http://mirror.lan:8080/whl/cu126",
        "--trusted-host",
        "mirror.lan",
    ]
    assert torch_argv(py, "/srv/wheels") == [*head, "--no-index", "--find-links", "/srv/wheels", "torch"]
    wheels = ["--no-index", "--find-links", "/srv/wheels", "flodl-fleet==0.1.0"]
    assert fleet_argv(py, "0.1.0", "/srv/wheels", True, "/work/main") == [*head, *wheels]
    assert fleet_argv(py, "0.1.0", "/srv/wheels", False, "/work/main") == [*head, "/work/main"]
    assert fleet_argv(py, "0.1.0", "https://x/whl", False, "") == [*head, "flodl-fleet==0.1.0"]


def test_pip_failures_are_permanent_when_nothing_is_there_and_transient_otherwise() -> None:
    missing = "ERROR: Could not find a version that satisfies the requirement torch\nERROR: No matching"
    gone = pip_failure("torch", "cu999", "https://download.pytorch.org/whl/cu999", missing)
    assert gone.code == PERMANENT and "https://download.pytorch.org/whl/cu999" in gone.message
    assert "join.torch_sources.cu999" in gone.fix
    net = pip_failure(
        "torch", "cu126", "https://x/whl", "Max retries exceeded ... Temporary failure in name resolution"
    )
    assert net.code == TRANSIENT and "https://x/whl" in net.message and "mirror" in net.fix
    # pip, having reached no index, also ends with "no matching distribution": its retries say why
    refused = (
        "WARNING: Retrying (Retry(total=0, connect=None)) after connection broken by 'NewConnectionError"
        "(... Failed to establish a new connection: [Errno 111] Connection refused)': /simple/torch/\n"
        + missing
    )
    unreached = pip_failure("torch", "cu126", "http://10.0.0.9/simple", refused)
    assert unreached.code == TRANSIENT and "Connection refused" in unreached.message


# --- the join block and the flag -----------------------------------------------------


def test_torch_sources_validate_keys_and_values(tmp_path: Path) -> None:
    good = Join.model_validate({"torch_sources": {"cu126": "https://m.example/whl/cu126", "cpu": "/srv/w"}})
    assert good.torch_sources["cpu"] == "/srv/w"
    f = tmp_path / "fdl.yml"
    f.write_text("join:\n  torch_sources:\n    auto: /srv/w\n    cu126: wheels/cu126\n")
    with pytest.raises(ConfigError) as caught:
        load_config(f)
    problems = {p.path: p for p in caught.value.problems}
    assert "is not a torch variant" in problems["join.torch_sources.auto"].message
    assert "absolute path" in problems["join.torch_sources.cu126"].message
    assert problems["join.torch_sources.cu126"].line == 4


def test_the_libtorch_flag_beats_the_block_and_is_validated() -> None:
    assert resolve_libtorch(None, Join()) is None
    assert resolve_libtorch(None, Join(libtorch="auto")) == "auto"
    assert resolve_libtorch("cpu", Join(libtorch="auto")) == "cpu"
    with pytest.raises(OptionError) as caught:
        resolve_libtorch("cuda12", Join())
    assert caught.value.param == "--libtorch" and "is not a torch variant" in caught.value.message


# --- the listing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("torch", "box", "expected"),
    [
        (CU126, BoxGpus([A40]), (True, "covers GPU 0 (sm_86)")),
        (CU126, BoxGpus([A40, PRO6000]), (False, "no kernel for GPU 1 (sm_120)")),
        (CPU, BoxGpus([A40]), (False, "a cpu build: no kernels for GPU 0 (sm_86)")),
        (ROCM64, BoxGpus([A40]), (False, "a rocm6.4 build: no kernels for GPU 0 (sm_86)")),
        (ROCM64, BoxGpus([MI300]), (True, "covers GPU 0 (gfx942)")),
        (ROCM64, BoxGpus([W7900]), (False, "no kernel for GPU 0 (gfx1100)")),
        (CU126, BoxGpus(), (None, "CPU ranks (no GPU on this box)")),
        (
            BROKEN,
            BoxGpus([A40]),
            (False, "torch does not import (ImportError: libcudart.so.12: cannot open shared object file)"),
        ),
    ],
)
def test_coverage_judges_a_venv_against_the_cards_as_auto_does(
    torch: Torch, box: BoxGpus, expected: tuple[bool | None, str]
) -> None:
    assert coverage(venv("v", torch), box) == expected


def test_the_listing_marks_the_running_venv_a_misnamed_one_and_what_auto_picks() -> None:
    box = BoxGpus([A40], "12.6", "6.4.1\n")
    venvs = [venv("cu126", CU126), venv("cu128", CPU), venv("rocm6.4", BROKEN)]
    auto = choose("auto", venvs, box, DEV)
    out = listing(venvs, DEV, box, ROOT, auto)
    assert out["root"] == str(ROOT)
    assert out["box"] == {
        "gpus": [{"index": 0, "vendor": "nvidia", "name": "NVIDIA A40", "arch": "sm_86"}],
        "driver_cuda": "12.6",
        "rocm": "6.4.1",
    }
    rows = {row["name"]: row for row in out["variants"]}
    assert list(rows) == ["cu126", "cu128", "rocm6.4", ".venv"]  # the running venv lives outside the root
    assert rows["cu126"]["archs"] == ["sm_50", "sm_80", "sm_90"] and rows["cu126"]["covers"] is True
    assert rows["cu128"]["note"] == "named cu128, holds a cpu build" and rows["cu128"]["covers"] is False
    assert "libcudart" in rows["rocm6.4"]["problem"] and rows["rocm6.4"]["note"] == ""
    assert [r["running"] for r in out["variants"]] == [False, False, False, True]
    assert out["auto"] == {
        "variant": "cu126",
        "venv": str(ROOT / "cu126"),
        "acquire": False,
        "reason": "cu126 covers GPU 0 (sm_86)",
    }
    # the running venv under the root is listed once; a choice that failed is shown with its fix
    inside = venv("cu126", CU126)
    failed = Permanent("libtorch auto: no ROCm version is known", "set libtorch: rocm6.4")
    again = listing([inside], inside, BoxGpus([W7900]), ROOT, failed)
    assert [r["running"] for r in again["variants"]] == [True]
    assert again["auto"] == {
        "error": "libtorch auto: no ROCm version is known",
        "fix": "set libtorch: rocm6.4",
    }
    acquire = listing([], DEV, BoxGpus(), ROOT, Choice("cpu", None, "a CPU box with no working torch venv"))
    assert acquire["auto"]["acquire"] is True and acquire["auto"]["venv"] is None
