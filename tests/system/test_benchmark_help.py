"""Every benchmark starts as ``python -m benchmarks.NAME``: its ``--help`` (argparse only, nothing measured), from
a working directory outside the checkout, with only the checkout on PYTHONPATH; and every example a benchmark
trains loads through :mod:`benchmarks._examples`."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)  # not a rank of a launcher: a benchmark that starts its own ranks must only print its help
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """``--help`` of every benchmark, a few at a time (each imports torch: seconds apiece on a loaded machine)."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = pool.map(lambda m: _run(["-m", m, "--help"], cwd), PARSED)
        return dict(zip(PARSED, done, strict=True))


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
