# The two commands of the README: `make demo` (set up, train 8 ingredients on Cora, soup them)
# and `make test` (the test suite CI runs). `make bench` runs the slow benchmarks.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first: on these machines torch==2.13.0 is a CPU wheel pip takes from disk; elsewhere pip's normal build.
TORCH := torch==2.13.0

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[plots]'
	touch $@

# The test extras in one install (a superset of the demo's, so it marks that one done too).
$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[plots,dev,ray]'
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	$(BIN)/python -m ladle.train --recipe default --ingredients 8 --baseline
	$(BIN)/python -m ladle.soup

# Two pytest workers, each test file on one of them (so its module fixtures are built once).
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-slow: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -m slow

bench: $(VENV)/.installed-dev
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/soup_accuracy.py
	$(BIN)/python bench/parallel_phase.py
	$(BIN)/python bench/varrate.py
	$(BIN)/python bench/beyond.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/scale.py

clean:
	rm -rf $(VENV) build *.egg-info
