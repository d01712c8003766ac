"""The device budget the Trainer keeps its data to: an APU's share of RAM, a discrete GPU's own
memory, none on a CPU rank; the knob from code over the rank environment. GPUs here are faked
(torch's device properties as a namespace): tests/integration/test_gpu.py has the real one."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from flodl_agent.train.device_memory import SHARE_ENV, Budget, Device, device_budget, resolve_share
from flodl_agent.train.trainer import nbytes, read_device, resident_batches, stream_batches

GIB = 1024**3


def test_code_beats_the_rank_environment_which_beats_unset() -> None:
    assert resolve_share(0.6, {SHARE_ENV: "0.9"}) == 0.6  # an explicit gpu_ram_share in code wins
    assert resolve_share(None, {SHARE_ENV: "0.9"}) == 0.9
    assert resolve_share(None, {SHARE_ENV: "1.25"}) == 1.25  # above 1: the platform under-states it
    assert resolve_share(None, {}) is None


@pytest.mark.parametrize("bad", ["half", "0", "-0.5", "nan", "inf"])
def test_a_share_that_is_no_fraction_of_ram_names_the_variable_and_the_fix(bad: str) -> None:
    with pytest.raises(ValueError, match=f"{SHARE_ENV}=.*gpu_ram_share"):
        resolve_share(None, {SHARE_ENV: bad})
    with pytest.raises(ValueError, match="gpu_ram_share must be"):
        resolve_share(float(bad) if bad != "half" else 0.0, {})


def test_an_apu_holds_its_share_of_the_hosts_ram_and_a_discrete_gpu_its_own_memory() -> None:
    apu = Device("cuda", total_memory=GIB // 2, integrated=True, host_ram=64 * GIB)
    assert device_budget(apu, 0.5).bytes == 32 * GIB
    assert "gpu_ram_share 0.5 of 64.0 GiB RAM" in device_budget(apu, 0.5).why
    unset = device_budget(apu, None)  # torch's carve-out, said to be one
    assert unset.bytes == GIB // 2 and "gpu_ram_share gives the aperture" in unset.why
    discrete = Device("cuda", total_memory=80 * GIB, host_ram=64 * GIB)
    assert device_budget(discrete, 0.5).bytes == 80 * GIB
    assert "ignored" in device_budget(discrete, 0.5).why
    assert device_budget(Device("cpu"), 0.5).bytes is None


def test_data_goes_resident_when_it_fits_half_the_budget() -> None:
    budget = Budget(8 * GIB, "")
    assert budget.fits(4 * GIB) and not budget.fits(4 * GIB + 1)
    assert not Budget(None, "cpu").fits(1)
    # The same 6 GiB shard: resident on the APU given its share, streamed on torch's carve-out.
    apu = Device("cuda", total_memory=GIB // 2, integrated=True, host_ram=32 * GIB)
    assert device_budget(apu, 0.5).fits(6 * GIB) and not device_budget(apu, None).fits(6 * GIB)


def _torch(**props: object) -> SimpleNamespace:
    seen: list[object] = []

    def get_device_properties(device: object) -> SimpleNamespace:
        seen.append(device)
        return SimpleNamespace(**props)

    return SimpleNamespace(cuda=SimpleNamespace(get_device_properties=get_device_properties), seen=seen)


def test_the_device_is_read_from_torchs_properties_and_the_hosts_ram() -> None:
    fake = _torch(total_memory=GIB // 2, is_integrated=1)
    device = read_device(fake, SimpleNamespace(type="cuda"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device == Device("cuda", GIB // 2, True, ram)
    assert read_device(_torch(total_memory=GIB), SimpleNamespace(type="cuda")).integrated is False
    cpu = _torch()
    assert read_device(cpu, SimpleNamespace(type="cpu")) == Device("cpu") and cpu.seen == []


def test_resident_batches_are_the_streamed_ones_and_items_are_sized_by_their_tensors() -> None:
    torch = pytest.importorskip("torch")
    x = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    data = [({"x": x[i]}, int(i)) for i in range(10)]
    assert nbytes(data[0]) == 16 + 8
    indices = [1, 3, 5, 7, 9]
    streamed, resident = stream_batches(data, indices, 2), resident_batches(data, indices, 2, "cpu")
    for _ in range(7):  # past the end: both cycle the shard the same way
        (sx, sy), (rx, ry) = next(streamed), next(resident)
        assert torch.equal(sx["x"], rx["x"]) and torch.equal(sy, ry)
