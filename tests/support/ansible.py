"""Reading Ansible's JSON output in tests."""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """ansible-inventory's JSON with its ``{"__ansible_unsafe": ...}`` wrappers taken off."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return value["__ansible_unsafe"]
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
