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
	# Compile the CPU (numba) kernels once, into numba's on-disk cache, as an install would build them
	# (about 1-2 minutes on a 2-core machine), rather than inside the first study or test that calls them.
	$(BIN)/python -c "from lowbit.codecs import get_codec; from lowbit.kernels.dispatch import warm_up; \
	  [warm_up(get_codec(s)) for s in ('qsgd:bits=8', 'qsgd:bits=4', 'qsgd:bits=2,bucket=128', 'onebit', \
	  'dettmers:type=dynamic', 'topk')]"
	# Byte-compile the package, as a non-editable install would: with PYTHONDONTWRITEBYTECODE set, every
	# process (test workers, forkserver, subprocesses) otherwise compiles lowbit's sources again (~0.3 s).
	$(BIN)/python -m compileall -q src > /dev/null
	touch $(STAMP)

venv: $(STAMP)

study: $(STAMP)
	$(BIN)/lowbit study

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The tests marked slow (each has a fast equivalent in `make test`); CI runs them after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu" || [ $$? -eq 5 ]

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_codecs.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
