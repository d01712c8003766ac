"""Device offers: ``local_devices`` / ``join.devices`` / ``--devices``.

Three spellings: an explicit list of GPU indices (``[0, 1]`` or ``"0,1"``),
``all`` (probed on the box at dispatch), or ``cpu:N`` (N CPU ranks, for CPU
training, labs and CI). One device is one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic_core import PydanticCustomError

from .problems import fail

DEVICE_FORMS = "a list of GPU indices like [0, 1], `all`, or `cpu:N`"


@dataclass(frozen=True)
class DeviceOffer:
    kind: Literal["gpus", "all", "cpu"]
    gpus: tuple[int, ...] = ()
    cpus: int = 0

    @property
    def capacity(self) -> int | None:
        """Ranks this offer carries; ``None`` until ``all`` is probed."""
        if self.kind == "gpus":
            return len(self.gpus)
        if self.kind == "cpu":
            return self.cpus
        return None

    def to_data(self) -> list[int] | str:
        if self.kind == "gpus":
            return list(self.gpus)
        return "all" if self.kind == "all" else f"cpu:{self.cpus}"

    def __str__(self) -> str:
        data = self.to_data()
        return ",".join(map(str, data)) if isinstance(data, list) else data


def _bad(message: str, hint: str = f"write {DEVICE_FORMS}") -> PydanticCustomError:
    return fail(((), message, hint))


def _gpu_list(items: list[Any]) -> DeviceOffer:
    if not items:
        raise _bad("offers no device", "list at least one GPU index, or write `all` or `cpu:N`")
    seen: set[int] = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise _bad(f"`{item!r}` is not a GPU index", "GPU indices are whole numbers from 0")
        if item in seen:
            raise _bad(f"device {item} is listed twice", "list each GPU once; one device is one rank")
        seen.add(item)
    return DeviceOffer("gpus", gpus=tuple(items))


def parse_devices(value: Any) -> DeviceOffer:
    if isinstance(value, DeviceOffer):
        return value
    if isinstance(value, (list, tuple)):
        return _gpu_list(list(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return _gpu_list([value])
    if not isinstance(value, str):
        raise _bad(f"`{value!r}` is not a device offer")
    text = value.strip()
    if text == "all":
        return DeviceOffer("all")
    if text.startswith("cpu:") or text == "cpu":
        count = text.removeprefix("cpu").removeprefix(":")
        if not count.isdigit() or int(count) < 1:
            raise _bad(f"`{value}` needs a CPU rank count", "write cpu:N with N >= 1, e.g. cpu:2")
        return DeviceOffer("cpu", cpus=int(count))
    parts = [p.strip() for p in text.split(",")]
    if all(p.isdigit() for p in parts) and parts != [""]:
        return _gpu_list([int(p) for p in parts])
    raise _bad(f"`{value}` is not a device offer")


def dump_devices(offer: DeviceOffer) -> list[int] | str:
    return offer.to_data()


DEVICES_JSON_SCHEMA: dict[str, Any] = {
    "description": f"Devices this host offers, one rank each: {DEVICE_FORMS}.",
    "anyOf": [
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True},
        {"type": "string", "pattern": r"^(all|cpu:[1-9][0-9]*|[0-9]+(,[0-9]+)*)$"},
    ],
}
