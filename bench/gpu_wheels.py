"""The wheels a GPU machine lacks, downloaded here into ``.whl/`` (gitignored) to travel with
the checkout: ``python -m bench.gpu_wheels``.

The GPU machine is an image with its own Python 3.12 and CUDA torch and no network. It holds
most of what the project needs (``IMAGE_HAS``); ``CARRIED`` names the rest, each pinned, when
downloaded, to the version the project's virtualenv runs (read from it, so a new release on
PyPI changes both together): pydantic and its core, cryptography and its cffi, and
ansible-core (the ``gpu_facts`` module imports its ``module_utils``). ``pip download
--no-deps`` takes each by name, so every dependency is named here; the few that the image may
hold too (typing-extensions, markdown-it-py) are carried anyway: newer than the image's copy
is what pydantic and rich accept, and the bytes are few.

On the GPU machine, from the checkout, with ``.whl`` carried (the one call)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
        python3 -m bench.gpu_check --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / ".whl"

# `pip list` on the GPU image (names normalized as pip does: lower case, '-').
IMAGE_HAS = frozenset(
    {
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "build",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "colorama",
        "filelock",
        "fsspec",
        "h11",
        "httpcore",
        "httpx",
        "idna",
        "jinja2",
        "markupsafe",
        "msgpack",
        "numpy",
        "packaging",
        "pip",
        "pluggy",
        "psutil",
        "pygments",
        "pytest",
        "pytest-xdist",
        "pyyaml",
        "requests",
        "rich",
        "setuptools",
        "typer",
        "typing-extensions",
        "urllib3",
        "hypothesis",
        "prometheus-client",
        "torch",
    }
)

# What the image lacks, by name; the binary ones have cp312 (or abi3) manylinux wheels.
CARRIED = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "cryptography",
    "cffi",
    "pycparser",
    "ansible-core",
    "resolvelib",
    "markdown-it-py",
    "mdurl",
)

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def normalize(name: str) -> str:
    """A requirement's project name as pip lists it: ``PyYAML>=6`` -> ``pyyaml``."""
    for stop in "<>=!~[;( ":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-").replace(".", "-")


def pinned() -> dict[str, str]:
    """Each carried project at the version this virtualenv runs."""
    return {name: importlib.metadata.version(name) for name in CARRIED}


def download_command(folder: Path = FOLDER) -> list[str]:
    """One ``pip download`` for every carried wheel, for CPython 3.12 on manylinux x86_64."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pins = [f"{name}=={version}" for name, version in sorted(pinned().items())]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(folder),
        *pins,
    ]


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--dest", type=Path, default=FOLDER, help="where the wheels go (default: .whl/)")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(download_command(args.dest), check=False)
    if done.returncode != 0:
        sys.exit(f"pip download failed ({done.returncode}); PyPI must be reachable from this machine")
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.dest}")


if __name__ == "__main__":
    main()
