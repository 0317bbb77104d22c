# Two commands on a fresh machine: `make demo`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stagewise-installed

.PHONY: install test test-core test-runtime test-distributed test-system demo lint docs docs-screenshots bench compare clean

# Bytecode is written where it is used: this machine sets PYTHONDONTWRITEBYTECODE, under which every process
# compiled all it imported again (`import stagewise` and its runtime: 3.4 -> 2.8 s with bytecode). Each module's is
# written at its first import instead: a fifth of the 15,800 files installed are ever imported, and compiling them
# all ahead (compileall over site-packages) took 50 s of CI's time on 2 cores, 2026-12-07.
export PYTHONDONTWRITEBYTECODE :=

# torch goes first, pinned: this machine has the CPU wheel locally, and a bare
# `torch` requirement would otherwise pull gigabytes of CUDA wheels. pip would compile what it installs on one core
# (60 of its 93 s here): what is imported is compiled as it is (above).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[dev,hf,examples,docs,exact,tensorboard]'
	touch $(STAMP)

install: $(STAMP)

# The whole suite, in two runs: the folders of tests in this one process (tests/core, tests/runtime: one core's
# work each) on two pytest-xdist workers, a module's tests on one worker (--dist loadfile: its fixtures made once);
# then the folders that start processes (tests/distributed, tests/system: jobs of 2-8 processes that fill both
# cores themselves) one test at a time. Both run whatever the first gives; a failure in either fails the target.
# The targets below run one folder each (its tests carry the folder's marker: -m core, ...).
XDIST := -n 2 --dist loadfile
test: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) tests/core tests/runtime; one=$$?; \
	$(PY) -m pytest -q tests/distributed tests/system; two=$$?; \
	test $$one -eq 0 && test $$two -eq 0

# The checkout's bytecode, compiled once on every core (about a second): the suite's first processes would write it
# as they import, two at a time on the same files. A source edited after is compiled again at its next import.
.PHONY: bytecode
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 src tests benchmarks examples >/dev/null

# The pure core, no torch (a test there that loads torch fails), on two workers: about a minute and a half on a quiet
# machine of two cores (about 170 s of one core's time on 2026-12-02); on a machine busy with other work, minutes more.
test-core: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) tests/core

# The pure core with every long property test at its full count of examples (the fast-vs-reference agreement
# tests of the validator, simulator and version tables, the partitioner's), the synthesizer's whole grid (every shape
# under every cost kind; `make test` takes each shape under two kinds) and the planner's scale check at 4096 processes;
# `make test` and `make test-core` draw a quarter of those examples and skip the scale check (tests/helpers/examples.py). Run it after a change to schedules/, passes/, the validator, the simulator, synthesis/ or planning/.
.PHONY: test-deep
test-deep: $(STAMP)
	STAGEWISE_DEEP=1 $(PY) -m pytest -q $(XDIST) tests/core

# The documentation pages' blocks that `make test` leaves out: a guide's `stagewise run` block whose marker names the
# tests/distributed checks that prove the API it shows (`<!-- docs-test: run -n 2 | make docs-test: IDS -->`; make
# test runs those checks, and checks that every block runs in one of the two targets); here each runs as the page shows
# it, after its IDS are found in the collected tests. Run it after a change to docs/ or to an API a guide shows
# (a few minutes on 2 cores). The README's blocks and the other pages' blocks run in `make test`.
.PHONY: docs-test
docs-test: $(STAMP)
	STAGEWISE_DOCS_TEST=1 $(PY) -m pytest -q tests/system/test_docs.py -k test_block_runs

# torch in one process, no launcher.
test-runtime: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) tests/runtime

# torchrun jobs of 2 to 8 gloo ranks, one per module, but for the modules that declare a SHARE: one job per rank
# count (2 and 4) runs all their checks (helpers/torchrun.py; a job's start costs seconds of both cores).
test-distributed: $(STAMP) bytecode
	$(PY) -m pytest -q tests/distributed

# Whole programs in subprocesses: the examples, the README, restarts, faults, two machines.
test-system: $(STAMP) bytecode
	$(PY) -m pytest -q tests/system

# The whole fault matrix, which tests/system/test_fault_matrix.py samples: {SIGKILL, SIGSTOP, exception} x {rank 0,
# a middle rank, the last rank} x {train_step, constructor, clip, eval_step, checkpoint save, checkpoint load, an
# asynchronous window, a HetPipe wave}, 72 jobs of 4 ranks, 2 at a time (~25 min on 2 cores); the figures go in
# benchmarks/RESULTS.md. A soak of random faults: `$(PY) -m benchmarks.fault_soak --random 100`.
fault-matrix: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.fault_soak --all --parallel 2

# Elastic jobs, which `make test` skips: three machines that lose one and take it back (test_elastic.py), and the
# faults during recovery: a second machine lost during the new rendezvous,
# a machine lost in a checkpoint save and in a snapshot copy, the rendezvous host lost (and survived with the
# store apart), fewer than MIN machines; each a job of 3 namespace machines x 2 processes (needs root; ~5 min on
# 2 cores); and what a user meets, on machines that are processes of one host (test_elastic_local.py, no root,
# ~4 min loaded): a finished job's snapshots gone and refused, a refusal not restarted, one line per lost machine;
# and the in-place path (test_elastic_inplace.py, no root, ~6 min loaded): survivors keep their processes, fencing.
# The measurements: `$(PY) -m benchmarks.elastic cost`, `sudo $(PY) -m benchmarks.elastic recovery` and
# `$(PY) -m benchmarks.elastic_inplace` (kill -> first step, restart vs in-place, no root);
# `sudo $(PY) -m benchmarks.recovery faults|snapshots|chaos` (3 namespace machines, issue 48's tables).
.PHONY: elastic faults chaos
# The fault jobs `make test` skips (a minute and a half): the fault matrix's sample of eight cases and the faults
# where torch waits (FSDP2, the profile, no stagewise.init), each a 4-rank job judged on exit codes and messages;
# and `--max-restarts` through six SIGKILLs, the last checkpoint left incomplete among them (`make test` kills three);
# the hang forensics on gloo's own transport (`make test` runs them on shared memory, and a dead peer on both), a
# reused run id, a process killed during a re-layout, and the GPT example stopped and resumed bit for bit.
# Run it after a change to the launcher, restarts, checkpoint resume, the re-layout or the fault paths.
faults: $(STAMP)
	STAGEWISE_FAULTS=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/system/test_fault_matrix.py tests/system/test_fault_axes.py \
		tests/system/test_restarts.py tests/system/test_runtime_faults.py \
		tests/system/test_examples.py::test_gpt_resumes_from_its_checkpoint_bit_exactly

elastic: $(STAMP)
	STAGEWISE_ELASTIC=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/system/test_elastic_local.py \
		tests/system/test_elastic_inplace.py tests/system/test_elastic.py tests/system/test_elastic_faults.py \
		tests/system/test_chaos.py

# Ten minutes of chaos (issue 48) on the in-place path: a machine of three lost (SIGKILL, SIGSTOP, its link down)
# or taken back every minute on a seeded schedule (printed first), a stopped or cut-off machine woken and fenced;
# goodput against fault-free jobs of each size (with and without snapshots), where it went, every run replayed
# bit for bit (root: ip netns; ~30 min in all on 2 cores). The two-minute version is tests/system/test_chaos.py.
chaos: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.recovery chaos --inplace --bare --duration 600 --interval 60 --again

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# The documentation site (mkdocs, Material theme, the API reference from the docstrings) into out/site; --strict:
# a warning or a broken link fails. Open out/site/index.html.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The built site opened in headless Chromium (Debian's chromium): the home page and a guide, and TensorBoard's page
# over a small run's metrics= folder (docs/tensorboard-demo.png is the demo's), screenshotted into
# out/site-screenshots (tests/system/test_docs_site.py, which CI runs with the rest of the tests). Without
# chromium on the PATH it fails, saying so, rather than pass having taken no screenshot.
docs-screenshots: $(STAMP)
	STAGEWISE_SCREENSHOTS=out/site-screenshots $(PY) -m pytest -q tests/system/test_docs_site.py

# A GPT on the standard library's source, 4 pipeline stages in 4 local processes (a few minutes on CPU).
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise run -n 4 examples/gpt_stdlib.py --out out/demo

bench: $(STAMP)
	$(PY) -m benchmarks.schedules_speed

# Every pipeline method on the same GPT and CNN, data, seeds and samples: tables, JSON, plots in out/compare (~2-3 min).
# (benchmarks/compare from this checkout: the same as `$(PY) -m benchmarks.compare --ranks 2 --out out/compare`.)
# Then its tests on both models (tests/system/test_compare.py, which `make test` skips: 30 s of CI's time). Run it after
# a change to benchmarks/compare or the asynchronous schedules.
compare: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/stagewise compare -n 2 --out out/compare
	STAGEWISE_COMPARE_ALL=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/system/test_compare.py

# The live re-layout's 4-rank job whole (about 1 min): the leak check at full length (20 re-layouts in one process,
# file descriptors and shared memory flat; `make test` runs 6), and the cases `make test` leaves out for CI's time:
# dp 4, a tagged model, from_hf, plan= and the asynchronous windows (tests/distributed/test_relayout.py), and the
# examples/relayout.py run (shrink to 2 processes, grow back to 4). Run it
# after a change to the re-layout, the checkpoint state or the frontends.
.PHONY: relayout relayout-leaks
relayout: $(STAMP)
	STAGEWISE_RELAYOUT_ALL=1 STAGEWISE_RELAYOUT_LEAKS=20 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/distributed/test_relayout.py \
		tests/system/test_examples.py::test_relayout_shrinks_to_2_processes_and_grows_back_to_4
relayout-leaks: relayout

# Pipeline.from_hf on every tested transformers family: 1f1b and zb-v, tied and untied heads, right padding and
# -100 labels, and Llama's tied head under every synchronous schedule, 2 and 4 ranks, against the one-process model
# (`make test` runs each family once and the tied sum under five); the table of measured errors goes to out/hf_grid.md;
# then examples/hf_causal_lm.py's Llama on 4 ranks, saved and reloaded with from_pretrained (a few minutes).
# The 4-D layouts on 8 ranks (tests/distributed/test_hybrid_8ranks.py, about 70 s: pp x sharding x tp, pp x dp x tp,
# sharding 4, the tied and factory cases, each against the one-process model); `make test` runs the two-axis
# layouts at 4 ranks. Run it after a change to the mesh, the parallel axes, sharding or tensor parallelism.
.PHONY: hybrid
hybrid: $(STAMP)
	STAGEWISE_HYBRID8=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/distributed/test_hybrid_8ranks.py

.PHONY: hf-grid
hf-grid: $(STAMP)
	mkdir -p out
	STAGEWISE_HF_GRID=out/hf_grid.md OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/distributed/test_hf_ranks.py \
		tests/system/test_examples.py::test_hf_llama_on_4_ranks_trains_saves_and_reloads
	cat out/hf_grid.md

# torch.distributed.pipelining both ways, the whole grid (tests/distributed/test_torch_interop.py samples it at 2
# ranks): every registered synchronous schedule at each v, m in {p, 2p}, both CSV formats, on torch's runtime, and
# every torch class at both readings on stagewise's, at 2 and 4 ranks, float64 against one process (a few minutes).
.PHONY: torch-grid
torch-grid: $(STAMP)
	STAGEWISE_TORCH_GRID=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/distributed/test_torch_interop.py

# The CUDA paths run and measured in one table (under 8 minutes on an H100; benchmarks/gpu_check): parity, host
# synchronisations, bf16 throughput against the plain loop, peak memory against the predictions, offload.
# Without a CUDA device it prints "no CUDA device"; `$(PY) -m benchmarks.gpu_check --device cpu` runs it small on the CPU.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
