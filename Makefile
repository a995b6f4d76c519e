# Set-up is part of every target: a missing or stale .venv is (re)built with python -m venv + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.odeify-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m odeify demo --out out/demo

# Two pytest-xdist workers (one per core, one torch thread each), whole files per worker so each
# file's module fixtures are built once. ODEIFY_HYPOTHESIS=ci adds the 150-example generated-
# architecture sweep (marked slow; a plain `pytest` runs 24 examples). About 7 minutes on 2 quiet cores.
test: export ODEIFY_HYPOTHESIS ?= ci
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/analyze.py
	$(PY) benchmarks/forward.py
	$(PY) benchmarks/adjoint_memory.py
	$(PY) benchmarks/gradient_error.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
