# Two commands on a fresh machine: `make demo`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stagewise-installed

.PHONY: install test test-core test-runtime test-distributed test-system demo lint bench compare clean

# torch goes first, pinned: this machine has the CPU wheel locally, and a bare
# `torch` requirement would otherwise pull gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite; the targets below run one folder each (its tests carry the folder's marker: -m core, ...).
test: $(STAMP)
	$(PY) -m pytest -q

# The pure core, no torch (a test there that loads torch fails): well under a minute.
test-core: $(STAMP)
	$(PY) -m pytest -q tests/core

# torch in one process, no launcher.
test-runtime: $(STAMP)
	$(PY) -m pytest -q tests/runtime

# torchrun jobs of 2 to 8 gloo ranks, one per module.
test-distributed: $(STAMP)
	$(PY) -m pytest -q tests/distributed

# Whole programs in subprocesses: the examples, the README, restarts, faults, two machines.
test-system: $(STAMP)
	$(PY) -m pytest -q tests/system

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# A GPT on the standard library's source, 4 pipeline stages in 4 local processes (a few minutes on CPU).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise run -n 4 examples/gpt_stdlib.py --out out/demo

bench: $(STAMP)
	$(PY) -m benchmarks.schedules_speed

# Every pipeline method on the same GPT and CNN, data, seeds and samples: tables, JSON, plots in out/compare (~2-3 min).
# (benchmarks/compare from this checkout: the same as `$(PY) -m benchmarks.compare --ranks 2 --out out/compare`.)
compare: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise compare -n 2 --out out/compare

# Pipeline.from_hf on every tested transformers family: 1f1b and zb-v, tied and untied heads, right padding and
# -100 labels, 2 and 4 ranks, against the one-process model; the table of measured errors goes to out/hf_grid.md
# (a few minutes).
.PHONY: hf-grid
hf-grid: $(STAMP)
	mkdir -p out
	STAGEWISE_HF_GRID=out/hf_grid.md OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/distributed/test_hf_ranks.py
	cat out/hf_grid.md

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
