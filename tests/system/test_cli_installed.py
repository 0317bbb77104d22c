"""The ``stagewise`` console script: as installed here, and from a wheel built from this tree.

``stagewise compare`` runs ``python -m benchmarks.compare`` from a source
checkout (the one stagewise is installed from, else the working directory): the
comparison trains the examples' models and is not library code, so the wheel
ships neither. From a wheel away from any checkout the command exits 2 and says
so; in a checkout it finds it; every other command works from the wheel alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = Path(sys.executable).with_name("stagewise")
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]


def test_console_script_prints_json() -> None:
    done = subprocess.run(
        [str(CONSOLE), "simulate", "--schedule", "gpipe", "--ranks", "4", "--microbatches", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    assert report["makespan"] == 7 * 3.0 and report["peak_activations"] == [4, 4, 4, 4]


def test_console_script_prints_the_version() -> None:
    done = subprocess.run([str(CONSOLE), "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == f"stagewise {version('stagewise')}\n"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the folder it is installed in without its dependencies). Built from a copy of what a wheel is
    built from (pyproject.toml, README.md, src/), so the build writes nothing into the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp / "dist"), str(tree)]
    subprocess.run(build, check=True, timeout=300)
    (built,) = (tmp / "dist").glob("stagewise-*.whl")
    install = [*PIP, "install", "--no-deps", "--no-compile", "--target", str(tmp / "site"), str(built)]
    subprocess.run(install, check=True, timeout=300)
    return built, tmp / "site"


def _from_wheel(site: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` with the wheel's stagewise first on the module path (before this checkout's editable install)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_ships_the_library_not_the_benchmarks(wheel: tuple[Path, Path]) -> None:
    names = zipfile.ZipFile(wheel[0]).namelist()
    assert "stagewise/cli/compare.py" in names and "stagewise/cli/main.py" in names
    assert all(n.startswith(("stagewise/", "stagewise-")) for n in names), [n for n in names if "stagewise" not in n]


def test_compare_from_the_wheel_outside_a_checkout_exits_2_saying_so(wheel: tuple[Path, Path], tmp_path: Path) -> None:
    built, site = wheel
    done = _from_wheel(site, [str(site / "bin" / "stagewise"), "compare", "-n", "2"], cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("stagewise compare: error:") and len(done.stderr.strip().splitlines()) == 1
    assert "source checkout" in done.stderr and str(tmp_path) in done.stderr
    # the rest of the command line works from the wheel alone, and it is the wheel's that answers
    done = _from_wheel(site, [str(site / "bin" / "stagewise"), "--version"], cwd=tmp_path)
    assert done.stdout == f"stagewise {built.name.split('-')[1]}\n"
    argv = [str(site / "bin" / "stagewise"), "simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--json"]
    assert json.loads(_from_wheel(site, argv, cwd=tmp_path).stdout)["makespan"] == (8 + 4 - 1) * 3.0


def test_compare_from_the_wheel_in_a_checkout_finds_the_benchmark(wheel: tuple[Path, Path]) -> None:
    _, site = wheel
    code = "import stagewise.cli.compare as c; print(c.__file__); print(c.find_checkout())"
    done = _from_wheel(site, [sys.executable, "-c", code], cwd=ROOT)
    module, checkout = done.stdout.split()
    assert Path(module).is_relative_to(site) and Path(checkout) == ROOT, done.stderr
