"""``fdl``: the operator's command line.

Thin shell: parse flags, resolve options (``flodl_agent.cli.options``), call the
pure cores, print with rich. One module per command group; ``common`` holds
the consoles and what every command shares. Exit codes: 0 success, 1 invalid
input or a failed operation, 2 usage error, 70 a bug. The console script is
``flodl_agent.cli.main:main``; this package imports nothing, so the option
resolvers load without click.
"""
