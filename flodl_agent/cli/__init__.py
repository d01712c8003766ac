"""``fdl``: the operator's command line.

Thin shell: parse flags, resolve options (``flodl_agent.options``), call the
pure cores, print with rich. One module per command group; ``common`` holds
the consoles and what every command shares. Exit codes: 0 success, 1 invalid
input or a failed operation, 2 usage error, 70 a bug.
"""

from .main import cli, main

__all__ = ["cli", "main"]
