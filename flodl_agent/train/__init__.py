"""Training together (the data plane): env:// rendezvous through the links, the CPU plane's
averaging and its hub, the Trainer and the ElChe modes, a rank's device budget, signatures.

A rank's script imports its API from here: ``from flodl_agent.train import Trainer``
(also ``ElCheConfig``, ``ShutdownWithSave``, ``Averager``, ``report``, ``answer_probe``,
``model_signature``). They load when first named, so the pure cores under this folder
(the hub, the device budget) import no asyncio or torch through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..observe.metrics import report
    from .averaging import Averager
    from .signature import answer_probe, model_signature
    from .trainer import ElCheConfig, ShutdownWithSave, Trainer

_PUBLIC = {
    "Trainer": ".trainer",
    "ElCheConfig": ".trainer",
    "ShutdownWithSave": ".trainer",
    "Averager": ".averaging",
    "report": "..observe.metrics",
    "answer_probe": ".signature",
    "model_signature": ".signature",
}

__all__ = [
    "Averager",
    "ElCheConfig",
    "ShutdownWithSave",
    "Trainer",
    "answer_probe",
    "model_signature",
    "report",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
