# llmpipe: `make run` sets up and runs the tiny lifecycle; `make test` sets up and runs the tests.
# CI (.ci/run) runs exactly these two commands, in this order, on a clean clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: install install-test run test test-fast lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip

# what a run needs: the package with every stage family's extra, and the Triton server binary (scripts/install.sh)
install: $(PY)
	$(PY) -m pip install -qq -e '.[all]'
	PYTHON=$(PY) bash scripts/install.sh

# what the tests need besides: pytest and friends, kenlm (built from source), a browser, nginx, redis-server
install-test: install
	$(PY) -m pip install -qq -e '.[all,coherence,test]'
	PYTHON=$(PY) bash scripts/install.sh --test

run: install
	$(VENV)/bin/llmpipe run configs/tiny.yaml

test: install-test
	$(VENV)/bin/pytest -q --timeout 1500 --durations=30

test-fast: install-test
	$(VENV)/bin/pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check llmpipe tasks flows tests benchmarks

clean:
	rm -rf .llmpipe .pytest_cache
