"""flodl fleet: stand up and run multi-host deep-learning training fleets."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flodl-fleet")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
