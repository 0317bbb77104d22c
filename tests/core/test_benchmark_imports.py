"""What the benchmarks import from stagewise, read from their source (nothing is imported or run).

A benchmark uses the public names and the packages' doors (``stagewise``, ``stagewise.passes``, ...,
``stagewise.runtime``). Below a door it may import only the internals listed in :data:`INTERNAL`, each with
the reason no public name serves, also given in a comment at its import. And no benchmark patches
``sys.path``: they are a package, run as ``python -m benchmarks.NAME``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SRC = ROOT / "src" / "stagewise"

#: (benchmark file, module below a door) -> why no public name serves
INTERNAL = {
    ("backward_kernels.py", "stagewise.runtime.engine.backward"): "it times the runtime's I / W / B kernels themselves",
    **dict.fromkeys(
        [
            ("split_backward.py", "stagewise.runtime.engine.backward"),
            ("split_backward.py", "stagewise.runtime.engine.compute"),
            ("split_backward.py", "stagewise.runtime.features.memory"),
            ("split_backward.py", "stagewise.runtime.features.recompute"),
        ],
        "it times the runtime's I / W / B kernels on stages run as the runtime runs them, and the meter's bytes",
    ),
    **dict.fromkeys(
        [
            ("stragglers.py", "stagewise.runtime.frontends.balance"),
            ("stragglers.py", "stagewise.runtime.frontends.default_cut"),
            ("stragglers.py", "stagewise.runtime.frontends.layers"),
        ],
        "--prior timed: the layers timed and handed to every rank as partition='time' does it, for a pipeline cut "
        "by hand (no public name times a Layer list that way)",
    ),
    ("stragglers.py", "stagewise.runtime.calibration.from_run"): (
        "--prior flat: the calibration's even prior (what a pipeline cut by hand had before the first batch priced "
        "its layers), for the A/B against the run's own"
    ),
    ("relayout.py", "stagewise.runtime.measure.tensor_bytes"): (
        "the re-layout's extra tensor bytes (issue 46's bound), counted as the test of that bound counts them"
    ),
    ("pipeline_vs_torch/model.py", "stagewise.runtime.engine.backward"): (
        "the ideal's stage costs are timed with the kernels the runtime runs"
    ),
    ("plan_accuracy/worker.py", "stagewise.runtime.calibration.calibrate"): (
        "the idle CPU and the cores measured again under the run's own conditions, not calibrate()'s"
    ),
    ("plan_accuracy/worker.py", "stagewise.runtime.calibration.compute_scale"): (
        "the plan measure_compute_scale() runs, so that its mesh is shared with the timed plans"
    ),
    ("fidelity/predicted.py", "stagewise.planning.costing"): (
        "the '+ runtime' prediction is the planner's own costing of each stage, which no public name gives"
    ),
    ("fidelity/predicted.py", "stagewise.planning.tied_sum"): (
        "the '+ runtime' prediction waits for the tied layers' gradient sum, priced as the planner prices it for a "
        "pipeline's own cut (tied_sums), which no public name gives"
    ),
    ("calibration/model.py", "stagewise.planning.recalibrate"): (
        "the held-out prediction itself (held_out_costs), which no public name runs without a pipeline of Q"
    ),
    ("calibration/worker.py", "stagewise.runtime.measure.links"): (
        "the run's one message size cannot identify the link's bandwidth: a ping-pong between two ranks gives the "
        "prior; the replicas' all-reduce probed alone (all_reduce_link) prices a dp 2 plan's SYNC, and its CPU "
        "share (all_reduce_cpu) how much of it takes the shared cores"
    ),
    ("calibration/worker.py", "stagewise.runtime.measure.profiling"): (
        "the profile side by side (side_by_side_profiles): each rank's fastest round per layer, as profile_sizes "
        "takes it, before the ranks' profiles are pooled"
    ),
    ("calibration/worker.py", "stagewise.runtime.measure.cores"): (
        "--pin: the pinning stagewise run --pin-cores does, in workers the benchmark launches with torchrun itself"
    ),
    ("stragglers.py", "stagewise.runtime.measure.cores"): (
        "--pin: stagewise run --pin-cores's pinning, in workers the benchmark launches with torchrun itself"
    ),
    ("calibration/builds.py", "stagewise.runtime.measure.cores"): (
        "its pinned conditions: stagewise run --pin-cores's pinning, in workers launched with torchrun itself"
    ),
    ("transport_pingpong.py", "stagewise.runtime.comm"): "it drives a transport directly: the protocol's values",
    ("transport_pingpong.py", "stagewise.runtime.comm.shm.transport"): (
        "it times the shm protocol's own path, below the Transport protocol"
    ),
    ("defaults/count_time.py", "stagewise.runtime.frontends.hf"): "it counts the units from_hf cuts a model into",
    ("defaults/count_time.py", "stagewise.runtime.measure"): (
        "it times the count itself, with and without the key that matches a repeated layer"
    ),
    ("synthesis/measure.py", "stagewise.runtime.frontends.hf"): (
        "an HF model measured as the units from_hf cuts it into, which no public name gives"
    ),
    **dict.fromkeys(
        [
            ("synthesis/measure.py", "stagewise.runtime.frontends.balance"),
            ("synthesis/measure.py", "stagewise.runtime.frontends.layers"),
        ],
        "a layer list with a tied module profiled layer by layer as a pipeline builds it (sw.profile takes modules)",
    ),
}


def _doors() -> set[str]:
    """``stagewise`` and each package or public module at its root: the doors a benchmark may import from."""
    found = {p.stem for p in SRC.glob("*.py") if not p.name.startswith("_")}
    found |= {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    return {"stagewise", *(f"stagewise.{name}" for name in found)}


def _files() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py") if "__pycache__" not in p.parts)


def _stagewise_imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import of stagewise in ``path``, at any depth (functions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "stagewise"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "stagewise":
            out.append((node.module or "", node.lineno))
    return out


def _internal_imports() -> dict[tuple[str, str], list[int]]:
    doors = _doors()
    found: dict[tuple[str, str], list[int]] = {}
    for path in _files():
        for module, line in _stagewise_imports(path):
            if module not in doors:
                found.setdefault((path.relative_to(BENCHMARKS).as_posix(), module), []).append(line)
    return found


def test_the_doors_are_found() -> None:
    assert {"stagewise.runtime", "stagewise.passes", "stagewise.planning", "stagewise.cli"} <= _doors()
    assert len(_files()) > 20 and sum(len(_stagewise_imports(p)) for p in _files()) > 20


def test_benchmarks_import_no_internal_but_the_listed_ones() -> None:
    unlisted = {k: v for k, v in _internal_imports().items() if k not in INTERNAL}
    assert not unlisted, (
        f"internal imports with no reason in INTERNAL (use the public name if there is one): {unlisted}"
    )


def test_every_listed_internal_is_still_imported() -> None:
    stale = set(INTERNAL) - set(_internal_imports())
    assert not stale, f"INTERNAL lists imports no benchmark makes any more: {sorted(stale)}"


@pytest.mark.parametrize("where", sorted(INTERNAL), ids=lambda k: f"{k[0]}:{k[1]}")
def test_each_internal_import_says_why_in_a_comment(where: tuple[str, str]) -> None:
    """The line above the import (above a run of internal imports together) is a comment."""
    path, module = where
    lines = (BENCHMARKS / path).read_text().splitlines()
    for line in _internal_imports()[where]:
        above = line - 2
        while above >= 0 and lines[above].strip().startswith(("from stagewise.runtime.", "import stagewise.runtime.")):
            above -= 1
        assert above >= 0 and lines[above].strip().startswith("#"), f"{path}:{line} imports {module} with no comment"


def test_no_benchmark_patches_sys_path() -> None:
    patched = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                patched.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not patched, f"sys.path used (run the benchmarks as modules, set PYTHONPATH for their ranks): {patched}"


def test_ranks_run_a_module_of_the_package_from_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import _launch

    cmd = _launch.torchrun(4, "benchmarks.plan_accuracy.worker", ["--out", "x"], options=["--max-restarts=0"])
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--max-restarts=0",
        "-m",
        "benchmarks.plan_accuracy.worker",
        "--out",
        "x",
    ]
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    env = _launch.environ(OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"].split(":") == [str(ROOT), "elsewhere"] and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("RANK", raising=False)
    assert not _launch.launched()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _launch.launched()
