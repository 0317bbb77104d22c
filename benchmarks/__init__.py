"""stagewise's benchmarks: one module, or one folder per family, each run from the repository root as

    .venv/bin/python -m benchmarks.NAME [--help]

``compare/`` (every pipeline method on the same workloads), ``fidelity/`` (the simulator against the
runtime, every synchronous schedule), ``pipeline_vs_torch/`` (against torch.distributed.pipelining),
``plan_accuracy/`` (the planner's predictions against runs); the rest are single modules. A benchmark that
needs several processes starts them itself with torchrun, running a module of this package
(:mod:`._launch`); models of the examples come through :mod:`._examples`. Benchmarks print tables and are
never run as tests; each records what it measured, where and when, on its page under ``docs/benchmarks/``
(``RESULTS.md``: the index).
"""
