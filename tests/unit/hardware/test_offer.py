"""The GPU gate over facts: what a box offers, or the permanent failure that says why not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flodl_agent.config import DeviceOffer
from flodl_agent.errors import PERMANENT
from flodl_agent.hardware.gpus import AmdAccess, Card, Torch
from flodl_agent.hardware.offer import (
    CONTAINER_DEVICES,
    ROCM_INSTALL,
    Gap,
    Offer,
    amd_gaps,
    covers,
    kernel_gap,
    resolve_offer,
    variant,
)
from flodl_agent.retry import Permanent

CUDA = Torch(
    version="2.13.0+cu126", cuda="12.6", usable_gpus=2, nccl="2.27.3", archs=["sm_50", "sm_80", "sm_90"]
)
A40_AND_PRO = [Card(0, "NVIDIA A40", "sm_86"), Card(1, "NVIDIA RTX PRO 6000", "sm_120")]
ROCM = Torch(version="2.13.0+rocm6.4", hip="6.4.43482-0f2d60242", usable_gpus=1, archs=["gfx90a", "gfx942"])


@pytest.mark.parametrize(
    ("flags", "arch", "covered"),
    [
        (["sm_80", "sm_90"], "sm_86", True),  # an 8.0 cubin runs on a later minor
        (["sm_86"], "sm_80", False),  # never on an earlier one
        (["sm_80", "sm_90"], "sm_120", False),  # nor across majors
        (["sm_80", "compute_90"], "sm_120", True),  # PTX is compiled for any later card
        (["compute_90"], "sm_86", False),
        (["sm_90a"], "sm_90", True),
        (["sm_90a"], "sm_91", False),  # an arch-specific cubin runs on its own arch only
        (["gfx90a", "gfx942"], "gfx942", True),
        (["gfx90a:xnack-"], "gfx90a", True),
        (["gfx90a", "gfx942"], "gfx1100", False),
        (["sm_80"], "?", True),  # an arch nobody could read is not called uncovered
    ],
)
def test_kernel_coverage(flags: list[str], arch: str, covered: bool) -> None:
    assert covers(flags, arch) is covered


def test_a_build_that_does_not_say_what_it_covers_has_no_gap() -> None:
    assert kernel_gap("torch 2.13.0 (cu126)", [], A40_AND_PRO) is None
    assert kernel_gap("torch 2.13.0 (cu126)", ["sm_80"], A40_AND_PRO[:1]) is None


@pytest.mark.parametrize(
    ("torch", "expected"),
    [(CUDA, "cu126"), (ROCM, "rocm6.4"), (Torch(version="2.13.0", cuda="12.8"), "cu128")],
)
def test_the_variant_is_named_from_the_build(torch: Torch, expected: str) -> None:
    assert variant(torch) == expected


@pytest.mark.parametrize(
    ("offer", "torch", "cards", "message", "fix"),
    [
        (
            DeviceOffer("all"),
            None,
            [],
            "no usable GPU: torch is not installed on this box",
            "install a torch variant, or offer CPU ranks with --devices cpu:N",
        ),
        (
            DeviceOffer("all"),
            Torch(error="ModuleNotFoundError: No module named 'torch'"),
            [],
            "no usable GPU: torch is not installed on this box",
            "install a torch variant, or offer CPU ranks with --devices cpu:N",
        ),
        (
            DeviceOffer("all"),
            Torch(version="2.13.0+cpu"),
            [],
            "no usable GPU on this box",
            "check the driver and device permissions (fdl probe), or offer CPU ranks with --devices cpu:N",
        ),
        (
            DeviceOffer("gpus", gpus=(0, 3)),
            CUDA,
            A40_AND_PRO,
            "GPU 3 is not on this box (2 visible)",
            "offer devices 0..1 with --devices",
        ),
        (
            DeviceOffer("all"),
            CUDA,
            A40_AND_PRO,
            "torch 2.13.0+cu126 (cu126) ships no kernel for part of what this box offers: "
            "GPU 1 (NVIDIA RTX PRO 6000, sm_120); it covers sm_50 sm_80 sm_90",
            "libtorch: auto picks a covering variant when one exists; --devices (join.devices) scopes the "
            "offer to covered cards",
        ),
        (
            DeviceOffer("all"),
            ROCM,
            [Card(0, "AMD Instinct MI100", "gfx908")],
            "torch 2.13.0+rocm6.4 (rocm6.4) ships no kernel for part of what this box offers: "
            "GPU 0 (AMD Instinct MI100, gfx908); it covers gfx90a gfx942",
            "libtorch: auto picks a covering variant when one exists; --devices (join.devices) scopes the "
            "offer to covered cards",
        ),
    ],
)
def test_nothing_usable_is_a_permanent_failure_naming_the_fix(
    offer: DeviceOffer, torch: Torch | None, cards: list[Card], message: str, fix: str
) -> None:
    with pytest.raises(Permanent) as caught:
        resolve_offer(offer, torch, cards)
    assert (caught.value.message, caught.value.fix, caught.value.code) == (message, fix, PERMANENT)


@pytest.mark.parametrize(
    ("offer", "torch", "cards", "expected"),
    [
        (DeviceOffer("cpu", cpus=3), None, [], Offer(["cpu:0", "cpu:1", "cpu:2"], ["cpu"] * 3, "cpu")),
        (  # scoped to the covered card
            DeviceOffer("gpus", gpus=(0,)),
            CUDA,
            A40_AND_PRO,
            Offer(["cuda:0"], ["NVIDIA A40"], "cu126", "2.27.3"),
        ),
        (
            DeviceOffer("all"),
            CUDA,
            [Card(0, "A100", "sm_80"), Card(1, "H100", "sm_90")],
            Offer(["cuda:0", "cuda:1"], ["A100", "H100"], "cu126", "2.27.3"),
        ),
        (
            DeviceOffer("all"),
            ROCM,
            [Card(0, "AMD Instinct MI300X", "gfx942")],
            Offer(["cuda:0"], ["AMD Instinct MI300X"], "rocm6.4"),
        ),
        (  # a build that does not list its archs is trusted
            DeviceOffer("gpus", gpus=(1,)),
            Torch(version="2.13.0", cuda="12.8", usable_gpus=2),
            A40_AND_PRO,
            Offer(["cuda:1"], ["NVIDIA RTX PRO 6000"], "cu128"),
        ),
    ],
)
def test_what_a_box_offers(
    offer: DeviceOffer, torch: Torch | None, cards: list[Card], expected: Offer
) -> None:
    assert resolve_offer(offer, torch, cards) == expected


# A fresh AMD box's facts: two MI300X in the KFD topology, everything reachable, ROCm installed.
AMD_BOX = AmdAccess(
    gpus=["gfx942", "gfx942"],
    kfd="ok",
    render={"renderD128": "ok", "renderD129": "ok"},
    owners={"/dev/kfd": "render", "/dev/dri/renderD128": "render", "/dev/dri/renderD129": "render"},
    user="flodl",
    groups=["flodl"],
    runtime=["/opt/rocm-6.4.0/lib/libamdhip64.so.6"],
)
USERMOD = (
    "sudo usermod -aG render,video flodl, then log in again "
    "(a service user: restart its unit, e.g. flodl-join.service)"
)
DENIED = "the GPU devices are not openable by flodl (groups flodl): "


@pytest.mark.parametrize(
    ("facts", "hip", "gaps"),
    [
        (AmdAccess(), False, []),  # no AMD GPU: nothing AMD explains it
        (AMD_BOX, False, []),  # reachable, with a runtime: not an AMD access problem
        (
            replace(AMD_BOX, runtime=[]),
            False,
            [
                Gap(
                    "this box has 2 AMD GPU(s) (gfx942, gfx942) but no ROCm userspace runtime (no "
                    "libamdhip64, no rocminfo, and torch is not a ROCm build)",
                    ROCM_INSTALL,
                )
            ],
        ),
        (replace(AMD_BOX, runtime=[]), True, []),  # a torch ROCm build bundles the runtime
        (
            replace(
                AMD_BOX,
                kfd="Permission denied",
                render={"renderD128": "Permission denied", "renderD129": "ok"},
            ),
            False,
            [Gap(DENIED + "/dev/kfd (Permission denied), /dev/dri/renderD128 (Permission denied)", USERMOD)],
        ),
        (  # added to the group, but this session predates it: the re-login is the fix
            replace(AMD_BOX, kfd="Permission denied", listed=["render"]),
            False,
            [
                Gap(
                    DENIED + "/dev/kfd (Permission denied); flodl is in render, but this session started "
                    "before that",
                    USERMOD,
                )
            ],
        ),
        (
            replace(AMD_BOX, kfd="missing", render={}, container="podman"),
            False,
            [
                Gap(
                    DENIED + "/dev/kfd (missing), /dev/dri/renderD* (missing)",
                    f"this runs in a podman container: pass the devices and groups ({CONTAINER_DEVICES})",
                )
            ],
        ),
        (
            replace(AMD_BOX, kfd="missing"),
            False,
            [
                Gap(
                    DENIED + "/dev/kfd (missing)",
                    "the device nodes are missing: check that the amdgpu driver is loaded "
                    "(dmesg | grep -i amdgpu)",
                )
            ],
        ),
    ],
)
def test_amd_gpus_out_of_reach_are_named_with_the_fix(facts: AmdAccess, hip: bool, gaps: list[Gap]) -> None:
    assert amd_gaps(facts, hip) == gaps


def test_no_usable_gpu_on_an_amd_box_says_every_cause_at_once() -> None:
    fresh = replace(AMD_BOX, runtime=[], kfd="Permission denied", container="docker")
    with pytest.raises(Permanent) as caught:
        resolve_offer(DeviceOffer("all"), Torch(version="2.13.0+cpu"), [], fresh)
    assert caught.value.message.startswith(
        "no usable GPU: this box has 2 AMD GPU(s) (gfx942, gfx942) but no ROCm"
    )
    assert "; and the GPU devices are not openable by flodl" in caught.value.message
    container = f"this runs in a docker container: pass the devices and groups ({CONTAINER_DEVICES})"
    assert caught.value.fix == f"{ROCM_INSTALL}; {container}"
    # Torch seeing the cards settles it, whatever the facts say.
    assert resolve_offer(DeviceOffer("all"), ROCM, [Card(0, "MI210", "gfx90a")], fresh).devices == ["cuda:0"]
