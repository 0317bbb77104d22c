"""Every benchmark starts as ``python -m benchmarks.NAME``: its ``--help`` (argparse only, nothing measured), from
a working directory outside the checkout, with only the checkout on PYTHONPATH (each in a process of its own, forked
from one interpreter that imported torch once); and every example a benchmark
trains loads through :mod:`benchmarks._examples`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _runnable() -> dict[str, Path]:
    """The modules that run, and their files: each package's ``__main__`` (by the package's name) and each module
    with a main guard."""
    out = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__main__.py":
            out[".".join(parts[:-1])] = path
        elif 'if __name__ == "__main__":' in path.read_text():
            out[".".join(parts)] = path
    return out


RUNNABLE = _runnable()
MODULES = list(RUNNABLE)
#: the ones with a command line: only these are started (one without would run its measurement on ``--help``)
PARSED = [m for m, path in RUNNABLE.items() if "ArgumentParser(" in path.read_text()]


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)  # not a rank of a launcher: a benchmark that starts its own ranks must only print its help
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


#: run in one interpreter (``python -c``, so that sys.path[0] is the working directory, as under ``-m``): torch is
#: imported once, then each benchmark runs ``-m NAME --help`` in a child forked from that state, two at a time (its
#: own process: what one benchmark imports or sets up cannot help or hurt the next), its stdout and stderr in files,
#: its exit code from ``SystemExit``. One torch import instead of one per benchmark (about 1.5 s of CPU each).
_HELPS = """
import json, os, runpy, sys, traceback
import torch  # noqa: F401 (the shared, expensive import)
out, done, running = sys.argv[1], {}, {}


def reap():
    pid, status = os.wait()
    module, paths = running.pop(pid)
    done[module] = [os.waitstatus_to_exitcode(status), *(open(path).read() for path in paths)]


for k, module in enumerate(sys.argv[2:]):
    paths = [os.path.join(out, f"{k}.{s}") for s in ("out", "err")]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in zip((1, 2), paths):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = [module, "--help"]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    running[pid] = (module, paths)
    if len(running) == 2:  # two at a time
        reap()
while running:
    reap()
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """``--help`` of every benchmark, each in its own process forked from one that imported torch once."""
    cwd, out = tmp_path_factory.mktemp("elsewhere"), tmp_path_factory.mktemp("helps")
    done = _run(["-c", _HELPS, str(out), *PARSED], cwd, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    return {m: subprocess.CompletedProcess([m, "--help"], code, out, err) for m, (code, out, err) in rows.items()}


def test_the_benchmarks_are_found() -> None:
    families = {"benchmarks.compare", "benchmarks.pipeline_vs_torch", "benchmarks.plan_accuracy"}
    assert families | {"benchmarks.schedules_speed", "benchmarks.plan_accuracy.worker"} <= set(MODULES)
    assert len(MODULES) >= 15


@pytest.mark.parametrize("module", MODULES)
def test_help(helps: dict[str, subprocess.CompletedProcess[str]], module: str) -> None:
    assert module in helps, f"{RUNNABLE[module]} has no ArgumentParser: `python -m {module} --help` would run it"
    done = helps[module]
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-3000:]


def test_the_examples_load_under_their_own_names(tmp_path: Path) -> None:
    """The examples import one another by bare name; loaded by path, their siblings come first."""
    code = (
        "from benchmarks._examples import example\n"
        "for name in ('gpt_model', 'gpt_data', 'digits_cnn', 'hybrid_tp_pp'):\n"
        "    print(name, example(name).__file__)\n"
        "import sys, reporting, gpt_model\n"
        "assert example('hybrid_tp_pp').GPTConfig is gpt_model.GPTConfig\n"
    )
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = dict(line.split() for line in done.stdout.splitlines())
    assert loaded == {name: str(ROOT / "examples" / f"{name}.py") for name in loaded} and len(loaded) == 4
