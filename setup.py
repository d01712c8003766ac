"""The wheel carries the flodl.cluster collection (roles, playbooks, plugins) beside the
package: ansible-core finds collections under site-packages/ansible_collections, as it
finds those of the `ansible` package, so `pip install flodl-fleet` is enough for
`ansible-playbook flodl.cluster.site` and for `fdl deploy` away from a checkout.

Everything else is pyproject.toml's. The collection is assembled at build time from the
top-level roles/ and playbooks/ (scripts/collection.py), never kept twice.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithCollection(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # a checkout: ansible.cfg reaches roles/ and collections/ where they are
        spec = importlib.util.spec_from_file_location("flodl_collection", HERE / "scripts" / "collection.py")
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.assemble(Path(self.build_lib), HERE)


setup(cmdclass={"build_py": BuildWithCollection})
