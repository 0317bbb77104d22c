"""Starting a benchmark's ranks: torchrun running a module of this package, from any working directory.

    cmd = torchrun(4, "benchmarks.plan_accuracy.worker", ["--out", path])
    subprocess.run(cmd, env=environ(OMP_NUM_THREADS="1"))

A benchmark whose every process is a rank (``compare``, ``async_schedules``,
``hetpipe_wsp``) starts its own ranks when run as ``python -m benchmarks.NAME``
(:func:`on_ranks`): under torchrun it is one of them. The soaks run the system
tests' programs, which import the tests' helpers as pytest has them: they run
themselves again with pytest's module path (:func:`with_the_tests`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the repository root: where ``benchmarks`` is imported from
ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, module: str, args: Sequence[str] = (), *, options: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N [options] -m MODULE ARGS``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, *options, "-m", module, *args]


def environ(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH (the ranks import ``benchmarks``
    by name whatever their working directory), and ``extra`` on top."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def launched() -> bool:
    """Whether this process is a rank started by a launcher (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def on_ranks(nproc: int, module: str, argv: Sequence[str], **extra: str) -> int:
    """Run ``module`` with ``argv`` on ``nproc`` local ranks; torchrun's exit status."""
    return subprocess.run(torchrun(nproc, module, argv), env=environ(**extra)).returncode


def run_as_rank(nproc: int, module: str, rank_main: Any, args: Any, argv: Sequence[str] | None, **extra: str) -> int:
    """A benchmark's ``main``: under a launcher, ``rank_main(args)`` here (0); else ``module`` started on ``nproc``
    local ranks with ``argv`` (this command line's when None) and ``extra`` in their environment."""
    if launched():
        rank_main(args)
        return 0
    return on_ranks(nproc, module, sys.argv[1:] if argv is None else argv, **extra)


def tests_environ(**extra: str) -> dict[str, str]:
    """:func:`environ` with the folders pytest puts on the module path first (pyproject.toml's ``pythonpath``,
    which tests/conftest.py gives the processes the tests start)."""
    import tomllib  # Python 3.11: the soaks are tools of the development environment

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    env = environ(**extra)
    env["PYTHONPATH"] = os.pathsep.join([*(str(ROOT / p) for p in options.get("pythonpath", [])), env["PYTHONPATH"]])
    return env


def with_the_tests(module: str, probe: str) -> None:
    """Return if ``probe`` (a test's program) is importable; else run ``module`` again with :func:`tests_environ`
    and exit with its status."""
    if importlib.util.find_spec(probe) is None:
        sys.exit(subprocess.run([sys.executable, "-m", module, *sys.argv[1:]], env=tests_environ()).returncode)


def timed_step(pipe: Any, x: Any, y: Any) -> float:
    """One train step of ``pipe`` on this replica's share of ``(x, y)``, timed from a barrier: the slowest rank's
    seconds (a collective; call it on every rank)."""
    import time

    import torch
    import torch.distributed as dist

    xs, ys = pipe.local_batch(x, y)  # a replica's share with dp > 1, else the whole batch
    dist.barrier()
    t0 = time.perf_counter()
    pipe.train_step(xs, ys)
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)
