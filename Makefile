# Two entry points for a fresh machine: `make study` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: study test test-slow venv clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first, so nothing pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

study: $(STAMP)
	$(BIN)/lowbit study

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The tests marked slow (each has a fast equivalent in `make test`); CI runs them after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu" || [ $$? -eq 5 ]

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_codecs.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
