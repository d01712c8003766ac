"""Where each torch variant of a worker comes from, and the pip settings that install it."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

DOCUMENTATION = r"""
name: torch_plan
short_description: Plan each torch variant's source and pip arguments
description:
  - For every variant a worker carries (C(cpu), C(cu126), C(rocm6.4) ...), the source its torch comes from
    and the pip settings that install torch from that source and nowhere else.
  - A declared source is an index URL (C(https://...); a plain C(http://) one is trusted as written) or a
    wheelhouse directory on the control machine (copied to C(<home>/wheels/torch-<variant>)).
  - An undeclared variant takes the common wheelhouse when there is one (an offline fleet has no index),
    else the variant's own index under I(index) (PyTorch's C(https://download.pytorch.org/whl/<variant>)).
positional: _input
options:
  _input:
    description: The variants, e.g. C([cu126, rocm6.4]).
    type: list
    elements: str
    required: true
  sources:
    description: Declared sources by variant (C(flodl_worker_torch_sources)); others are ignored.
    type: dict
    default: {}
  home:
    description: The service user's home on the box (holds C(wheels/)).
    type: path
    required: true
  wheelhouse:
    description: Whether the common wheelhouse is copied to C(<home>/wheels).
    type: bool
    default: false
  index:
    description: Base of the per-variant indexes.
    type: str
    default: https://download.pytorch.org/whl
"""

EXAMPLES = r"""
- ansible.builtin.debug:
    msg: "{{ ['cu126'] | flodl.cluster.torch_plan(home='/opt/flodl') }}"
"""

RETURN = r"""
_value:
  description: >-
    By variant - C(source) (as declared or defaulted), C(wheelhouse) (the control machine's directory to
    copy, or empty), C(box_source) (the same source as the box sees it: a URL or a directory there) and
    C(pip_env) (pip's own environment variables: the pip module counts any C(extra_args) as a change
    under C(--check)).
  type: dict
"""

_VARIANT = re.compile(r"cpu|cu\d{3}|rocm\d+(\.\d+)*")


def torch_plan(
    variants: list[str],
    sources: dict[str, str] | None = None,
    home: str = "/opt/flodl",
    wheelhouse: bool = False,
    index: str = "https://download.pytorch.org/whl",
) -> dict[str, dict[str, Any]]:
    sources = sources or {}
    common = f"{home}/wheels"
    plan: dict[str, dict[str, Any]] = {}
    for variant in variants:
        if not _VARIANT.fullmatch(str(variant)):
            raise ValueError(f"torch_plan: {variant!r} is not a torch variant (cpu, cuNNN, rocmX.Y)")
        source = str(sources.get(variant) or ("" if wheelhouse else f"{index.rstrip('/')}/{variant}"))
        if not source:
            entry: dict[str, Any] = {
                "wheelhouse": "",
                "box_source": common,
                "pip_env": {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": common},
            }
        elif source.startswith("/"):
            own = f"{home}/wheels/torch-{variant}"
            links = f"{own} {common}" if wheelhouse else own  # torch's dependencies from the common one
            entry = {
                "wheelhouse": source,
                "box_source": own,
                "pip_env": {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": links},
            }
        elif re.match(r"https?://", source):
            host = urlsplit(source).hostname or ""
            env = {"PIP_INDEX_URL": source}
            if source.startswith("http://"):
                env["PIP_TRUSTED_HOST"] = host
            entry = {"wheelhouse": "", "box_source": source, "pip_env": env}
        else:
            raise ValueError(
                f"torch_plan: the source of {variant} ({source!r}) is neither an http(s) index URL "
                "nor an absolute wheelhouse directory"
            )
        plan[variant] = {"source": source, **entry}
    return plan


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"torch_plan": torch_plan}
