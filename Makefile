# llmpipe: `make run` sets up and runs the tiny lifecycle; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: install run test test-fast lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	PYTHON=$(PY) bash scripts/install.sh

run: install
	$(VENV)/bin/llmpipe run configs/tiny.yaml

test: install
	$(VENV)/bin/pytest -q --timeout 1500

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check llmpipe tasks flows tests benchmarks

clean:
	rm -rf .llmpipe .pytest_cache
