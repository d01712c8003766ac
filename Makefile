# The two commands of the README: `make demo` and `make test`.
# Both set up everything they need on a fresh Debian 12 machine (as root).

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
# sslyze pins cryptography below the version flodl runs on, so the TLS audit
# (tests/integration/test_tls_audit.py) runs it from a venv of its own.
AUDIT       := build/audit-venv
SSLYZE      := sslyze>=6.1,<7
AUDIT_STAMP := $(AUDIT)/.installed-$(shell echo '$(SSLYZE)' | sha256sum | cut -c1-12)
# Mermaid's parser for the docs' diagrams (tests/integration/test_doc_diagrams.py), from npm.
MERMAID       := tests/support/mermaid
MERMAID_STAMP := $(MERMAID)/node_modules/.installed-$(shell sha256sum $(MERMAID)/package-lock.json | cut -c1-12)

.PHONY: setup system-deps demo test test-fast test-lab test-molecule lint collection sanity dist typecheck unit fuzz mutate lab-up lab-down gpu-wheels clean

setup: $(STAMP) $(AUDIT_STAMP) $(MERMAID_STAMP)

system-deps:
	bash scripts/system-deps

$(STAMP): pyproject.toml | system-deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,ansible,ray]'
	rm -f $(VENV)/.installed-* && touch $@

$(AUDIT_STAMP): | system-deps
	test -x $(AUDIT)/bin/python || python3 -m venv $(AUDIT)
	$(AUDIT)/bin/pip install --quiet '$(SSLYZE)'
	rm -f $(AUDIT)/.installed-* && touch $@

$(MERMAID_STAMP): $(MERMAID)/package-lock.json | system-deps
	cd $(MERMAID) && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	touch $@

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/demo

# ansible-lint with no paths lints the whole repository (.ansible-lint says what
# is left out and why); the role READMEs must match their argument specs.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/ansible-lint --profile production
	$(PY) scripts/role_readme.py --check

# The flodl.cluster collection as Galaxy would take it: assemble it (its plugins, the
# top-level roles/ and playbooks/, the LICENSE: scripts/collection.py), build the tarball
# into build/collection/, install it into a scratch collections path (offline, and away
# from ./collections, which would otherwise count as installed), and have Ansible find
# its playbooks and roles by name from there, outside this checkout.
COLLECTION_OUT := build/collection
INSTALLED := ANSIBLE_COLLECTIONS_PATH="$(CURDIR)/$(COLLECTION_OUT)/installed" ANSIBLE_CONFIG="$(CURDIR)/$(COLLECTION_OUT)/ansible.cfg" ANSIBLE_ROLES_PATH=/nonexistent
collection: setup
	rm -rf $(COLLECTION_OUT)
	$(PY) scripts/collection.py assemble $(COLLECTION_OUT)/src
	printf '[defaults]\n' > $(COLLECTION_OUT)/ansible.cfg  # none of this checkout's settings
	$(VENV)/bin/ansible-galaxy collection build $(COLLECTION_OUT)/src/ansible_collections/flodl/cluster --output-path $(COLLECTION_OUT) --force
	$(INSTALLED) $(VENV)/bin/ansible-galaxy collection install --offline \
		-p $(COLLECTION_OUT)/installed $(COLLECTION_OUT)/flodl-cluster-*.tar.gz
	$(INSTALLED) $(VENV)/bin/ansible-galaxy collection verify --offline flodl.cluster
	cd /tmp && for book in site run golden_image probe; do \
		$(INSTALLED) $(CURDIR)/$(VENV)/bin/ansible-playbook --syntax-check -i localhost, flodl.cluster.$$book >/dev/null || exit 1; done

# ansible-test sanity on the assembled collection, offline: ansible-test bootstraps pip into
# each test's venv from a script it would download; scripts/sanity.py puts a stand-in in its
# cache that installs from the configured package indexes. Waivers: the collection's
# tests/sanity/ignore-2.19.txt, each with its reason.
sanity: collection
	$(PY) scripts/sanity.py $(COLLECTION_OUT)/src/ansible_collections/flodl/cluster

# The installable artifacts: the collection (above) and the wheel and sdist, which carry
# the same collection and version (setup.py assembles it into the wheel). Both checked:
# twine's metadata check, and the wheel installed into a scratch path, where Ansible finds
# the collection's playbooks by name through sys.path, as after `pip install flodl-fleet`.
DIST_OUT := build/dist
dist: collection
	rm -rf $(DIST_OUT)
	$(PY) -m build --no-isolation --outdir $(DIST_OUT) . >/dev/null
	$(VENV)/bin/twine check --strict $(DIST_OUT)/*
	$(PY) -m pip install --quiet --no-deps --target $(DIST_OUT)/installed $(DIST_OUT)/*.whl
	$(PY) scripts/collection.py check $(DIST_OUT)/installed/ansible_collections/flodl/cluster
	cd /tmp && PYTHONPATH="$(CURDIR)/$(DIST_OUT)/installed" ANSIBLE_COLLECTIONS_PATH=/nonexistent \
		ANSIBLE_CONFIG="$(CURDIR)/$(COLLECTION_OUT)/ansible.cfg" \
		$(CURDIR)/$(VENV)/bin/ansible-playbook --syntax-check -i localhost, flodl.cluster.site >/dev/null
	@echo "dist: $$(ls $(DIST_OUT)/*.whl $(DIST_OUT)/*.tar.gz $(COLLECTION_OUT)/*.tar.gz | tr '\n' ' ')"

typecheck: setup
	$(VENV)/bin/mypy

unit: setup
	$(VENV)/bin/pytest tests/unit

# Everything but the lab, on PYTEST_WORKERS xdist workers: most integration and e2e tests wait
# on sshd, subprocesses and sockets, so more workers than cores pays. Tests that share a fixed
# resource (podman and the lab image, shaped network namespaces) carry an xdist_group and run
# on one worker, one after another; those marked `serial` (Ray, one e2e walk-in test) run after, alone.
PYTEST_WORKERS ?= 4
test-fast: lint sanity dist typecheck
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not lab and not serial"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -m "serial and not lab"

# The podman lab fleet: site.yml, idempotence, the door, a run (minutes).
test-lab: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/pytest -m lab --timeout 1800 tests/lab

# Molecule: each role alone on a lab node; converge + idempotence + verify
# (minutes). The scenarios run by name, side by side (scripts/molecule-scenarios;
# tests/molecule/default is an empty stub that molecule loads first). The whole-fleet scenario is left to
# `make test-molecule MOLECULE_SCENARIOS=fleet`: the lab suite converges, checks
# and runs the same fleet in make test, so running both doubled a quarter hour.
MOLECULE_SCENARIOS ?= controller worker
test-molecule: setup
	tests/lab/lab image
	tests/lab/lab wheels
	@echo "molecule: scenarios $(MOLECULE_SCENARIOS), side by side; each one's steps are its molecule.yml's test_sequence (controller, worker: create, converge, idempotence, verify; check mode is the lab suite's)"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/molecule-scenarios $(MOLECULE_SCENARIOS)

test: test-fast mutate test-molecule test-lab

# Coverage-guided fuzzing of the frame codec, the messages and admission, for five
# minutes (make test runs a short bounded pass); the corpus grows in build/fuzz.
fuzz: setup
	mkdir -p build/fuzz/corpus build/fuzz/crashes
	$(PY) -m tests.fuzz.frames -max_total_time=300 -artifact_prefix=build/fuzz/crashes/ build/fuzz/corpus

# Mutation testing of the controller's pure cores (window, admission, supervision, readoption,
# elastic) against tests/unit/controller ([tool.mutmut] in pyproject.toml); each must score
# at least 95 % (about a minute: make test runs it, so the score cannot slip).
mutate: setup
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2
	$(PY) scripts/mutation_score.py --min 95

lab-up: setup
	tests/lab/lab up

lab-down:
	tests/lab/lab down

# The wheels a GPU machine's image lacks (Python 3.12, manylinux), into the ignored .whl/
# that travels with the checkout to it (bench/README.md: the one call there).
gpu-wheels: setup
	$(PY) -m bench.gpu_wheels

clean:
	rm -rf $(VENV) build mutants .pytest_cache .mypy_cache .ruff_cache .hypothesis $(MERMAID)/node_modules
