"""Device offers: ``local_devices`` / ``join.devices`` / ``--devices``.

Three spellings: an explicit list of GPU indices (``[0, 1]`` or ``"0,1"``),
``all`` (probed on the box at dispatch), or ``cpu:N`` (N CPU ranks, for CPU
training, labs and CI). One device is one rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic_core import PydanticCustomError

from ..names import shown
from .problems import fail

DEVICE_FORMS = "a list of GPU indices like [0, 1], `all`, or `cpu:N`"
# The hello carries at most this many devices (messages.Hello): a box offering more could
# never be admitted, so the offer is refused where it is written.
MAX_DEVICES = 1024
_COUNT = re.compile(r"[0-9]{1,7}")  # ASCII digits, and few enough for int() to be cheap


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


def _too_many(count: int) -> PydanticCustomError:
    return _bad(
        f"offers {count} devices: a box offers at most {MAX_DEVICES} (one rank each)",
        f"offer at most {MAX_DEVICES} here (the hello carries no more) and walk the rest in from other boxes",
    )


def _gpu_list(items: list[Any]) -> DeviceOffer:
    if not items:
        raise _bad("offers no device", "list at least one GPU index, or write `all` or `cpu:N`")
    if len(items) > MAX_DEVICES:
        raise _too_many(len(items))
    seen: set[int] = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < MAX_DEVICES:
            raise _bad(
                f"`{shown(repr(item))}` is not a GPU index",
                f"GPU indices are whole numbers from 0 to {MAX_DEVICES - 1}",
            )
        if item in seen:
            raise _bad(f"device {item} is listed twice", "list each GPU once; one device is one rank")
        seen.add(item)
    return DeviceOffer("gpus", gpus=tuple(items))


def _cpus(value: str, count: str) -> DeviceOffer:
    """``cpu:N``'s N (``value`` as written, for the message)."""
    if not _COUNT.fullmatch(count) or int(count) < 1:
        raise _bad(f"`{shown(value)}` needs a CPU rank count", "write cpu:N with N >= 1, e.g. cpu:2")
    if int(count) > MAX_DEVICES:
        raise _too_many(int(count))
    return DeviceOffer("cpu", cpus=int(count))


def _text(value: str) -> DeviceOffer:
    """The string spellings: ``all``, ``cpu:N`` or ``"0,1"``."""
    text = value.strip()
    if not text:
        raise _bad("is empty", f"write {DEVICE_FORMS}")
    if text == "all":
        return DeviceOffer("all")
    if text.startswith("cpu:") or text == "cpu":
        return _cpus(value, text.removeprefix("cpu").removeprefix(":"))
    parts = [p.strip() for p in text.split(",")]
    if all(_COUNT.fullmatch(p) for p in parts):
        return _gpu_list([int(p) for p in parts])
    raise _bad(f"`{shown(value)}` is not a device offer")


def parse_devices(value: Any) -> DeviceOffer:
    if isinstance(value, DeviceOffer):
        return value
    if isinstance(value, (list, tuple)):
        return _gpu_list(list(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return _gpu_list([value])
    if isinstance(value, str):
        return _text(value)
    raise _bad(f"`{shown(repr(value))}` is not a device offer")


def dump_devices(offer: DeviceOffer) -> list[int] | str:
    return offer.to_data()


_CPUS = r"([1-9][0-9]{0,2}|10[01][0-9]|102[0-4])"  # 1..MAX_DEVICES, for the schema's pattern
_INDEX = r" *([0-9]{1,3}|10[01][0-9]|102[0-3]) *"  # 0..MAX_DEVICES - 1
DEVICES_JSON_SCHEMA: dict[str, Any] = {
    "description": f"Devices this host offers, one rank each: {DEVICE_FORMS}.",
    "anyOf": [
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": MAX_DEVICES - 1},
            "minItems": 1,
            "maxItems": MAX_DEVICES,
            "uniqueItems": True,
        },
        {"type": "string", "pattern": rf"^(all|cpu:{_CPUS}|{_INDEX}(,{_INDEX})*)$"},
    ],
}
