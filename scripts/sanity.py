"""ansible-test sanity on the assembled flodl.cluster collection, offline of ansible's CI files.

ansible-test gives each sanity test a virtualenv of its own and bootstraps pip into it with a
get-pip script it downloads from ci-files.testing.ansible.com, which these machines cannot
reach. It takes the script from its cache when one is there, so this puts one there: a small
script that installs what ansible-test asks for (its pinned pip) with this venv's pip, which
reads the package indexes pip is configured with (the local one, PyPI). The tests' own
requirements then come the same way.

    python scripts/sanity.py COLLECTION_DIR [ansible-test sanity options]

COLLECTION_DIR is the assembled collection (.../ansible_collections/flodl/cluster,
`scripts/collection.py assemble`). It is tested from a copy in a scratch directory: inside
this checkout, git ignores build/ and ansible-test would find no targets. Exits with
ansible-test's status.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

# What ansible-test runs as `python get_pip.py [pip options] pip==X --no-setuptools --no-wheel`
# inside the new venv: install the packages into that venv (pip --python) with the pip of the
# venv that runs ansible-test. get-pip's own flags mean nothing to pip install.
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
SHIM = '''"""Stand-in for get-pip.py, written by flodl's scripts/sanity.py (no ci-files access)."""
import subprocess
import sys

GET_PIP_ONLY = {{"--no-setuptools", "--no-wheel"}}
args = [a for a in sys.argv[1:] if a not in GET_PIP_ONLY]
sys.exit(subprocess.call([{outer!r}, "-m", "pip", "--python", sys.executable, "install", *args]))
'''


def pip_version() -> str:
    """The pip version ansible-test pins into its venvs (it names the cached script after it)."""
    from ansible_test._internal.python_requirements import get_venv_packages

    return get_venv_packages(types.SimpleNamespace(version=PYTHON))["pip"]


def write_shim() -> Path:
    cache = Path.home() / ".ansible/test/cache"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"get_pip_{pip_version().replace('.', '_')}.py"
    path.write_text(SHIM.format(outer=sys.executable))
    return path


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    collection = Path(argv[0]).resolve()
    if collection.parent.parent.name != "ansible_collections":
        print(f"sanity: {collection} is not .../ansible_collections/NAMESPACE/NAME", file=sys.stderr)
        return 2
    write_shim()
    ansible_test = Path(sys.executable).parent / "ansible-test"
    command = [str(ansible_test), "sanity", "--python", PYTHON, "--color", "no", *argv[1:]]
    with tempfile.TemporaryDirectory(prefix="flodl-sanity-") as scratch:
        copy = Path(scratch) / "ansible_collections" / collection.parent.name / collection.name
        shutil.copytree(collection, copy, symlinks=True)
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=scratch)
        return subprocess.call(command, cwd=copy, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
