"""Python source read as syntax, safely inside a test run.

CPython 3.11's ``ast.parse`` is not re-entrant: a finalizer that the collector runs
while it builds the tree (a transport some earlier test left to the garbage) and that
raises goes to pytest's unraisable hook, whose traceback formatting parses the failing
line with ``ast.parse`` again, and the outer parse then fails with "AST constructor
recursion depth mismatch" (a fresh-clone CI run on 3.11.7 did). With the collector paused
for the parse, no finalizer can run inside it.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """``path``'s syntax tree, built with the garbage collector paused."""
    source = path.read_text()
    was_on = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, str(path))
    finally:
        if was_on:
            gc.enable()
