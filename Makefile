# Two commands on a fresh machine: `make demo`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stagewise-installed

.PHONY: install test demo lint bench compare clean

# torch goes first, pinned: this machine has the CPU wheel locally, and a bare
# `torch` requirement would otherwise pull gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# A GPT on the standard library's source, 4 pipeline stages in 4 local processes (a few minutes on CPU).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise run -n 4 examples/gpt_stdlib.py --out out/demo

bench: $(STAMP)
	$(PY) benchmarks/schedules_speed.py

# Every pipeline method on the same GPT and CNN, data, seeds and samples: tables, JSON, plots in out/compare (~2-3 min).
compare: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise compare -n 2 --out out/compare

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
