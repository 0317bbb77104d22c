"""The shape of the house, by path: torch lives under ``runtime/``; torch.distributed in its comm and hybrid rooms."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.imports import imports_of, modules

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"
RUNTIME = SRC / "runtime"
#: the rooms allowed to import torch.distributed: the transport and collectives; the hybrid axes, which wrap
#: torch's DeviceMesh, FSDP2 and DTensor; the checkpoint's storage, which wraps torch.distributed.checkpoint
#: (their collectives run inside torch); the launcher
DISTRIBUTED_ROOMS = [
    RUNTIME / "comm",
    RUNTIME / "hybrid",
    RUNTIME / "checkpoint" / "storage.py",
    RUNTIME / "checkpoint" / "dcp_files.py",  # storage's DCP half, imported at the first save or load
    RUNTIME / "launch.py",
    RUNTIME / "elastic" / "launch.py",  # torch's elastic agent, wrapped for the one line per failure (stagewise run)
    RUNTIME / "elastic" / "agent.py",  # torch's elastic agent with stagewise's run loop (stagewise run --in-place)
    RUNTIME / "measure" / "links.py",  # the probes time torch.distributed's own operations
    RUNTIME / "measure" / "sharding.py",
    RUNTIME / "interop",  # torch.distributed.pipelining's schedule classes and runtime, read and loaded
]
_DIST_IMPORT = re.compile(
    r"^\s*(import torch\.distributed|from torch\.distributed|from torch import distributed)", re.M
)
_TORCH_IMPORT = re.compile(r"^\s*(import torch\b|from torch\b)", re.M)


def _inside(path: Path, room: Path) -> bool:
    return path == room or room in path.parents


def test_torch_distributed_only_in_comm_and_hybrid() -> None:
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if _DIST_IMPORT.search(p.read_text()) and not any(_inside(p, room) for room in DISTRIBUTED_ROOMS)
    ]
    assert offenders == [], f"torch.distributed imported outside runtime/comm and runtime/hybrid: {offenders}"


def test_everything_outside_runtime_is_pure() -> None:
    outside = [p for p in SRC.rglob("*.py") if not _inside(p, RUNTIME)]
    assert len(outside) > 20  # the pure core: actions, schedules, passes, validator, simulator, renderers, ...
    offenders = [str(p.relative_to(SRC)) for p in outside if _TORCH_IMPORT.search(p.read_text())]
    assert offenders == [], f"modules outside runtime/ import torch: {offenders}"


def test_planning_and_simulating_load_no_torch() -> None:
    code = (
        "import sys, stagewise as sw\n"
        "from stagewise.simulation.arrays import simulate\n"
        "from stagewise import cli\n"
        "for name in sw.schedule_names():\n"
        "    info = sw.schedule_info(name)\n"
        "    simulate(sw.build_schedule(name, 4, 8, info.default_virtual_stages))\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


#: the runtime's rooms, floor by floor from the ground: a room imports only rooms on the floors below its own
#: (besides its own files), at the top of a file, under TYPE_CHECKING or inside a function alike. The door
#: (runtime/__init__.py, which loads every room lazily) stands above them all.
RUNTIME_FLOORS: list[list[str]] = [
    ["errors.py", "interrupt.py", "losses.py"],  # what every room may raise, note or compute
    ["comm", "launch.py", "interop"],  # torch.distributed: transports, groups, collectives, faults; starting the
    # ranks; torch.distributed.pipelining's schedules and runtime
    ["engine"],  # executes the IR: the interpreter, the runner and its two seams (StagePart, StepPart)
    ["hybrid", "checkpoint"],  # the other parallel axes; save / load (a pipeline by its declared protocol)
    ["features", "asynchronous", "measure", "elastic", "reporting"],  # what plugs into the engine's seams; weight
    # versions; profiling; lost machines (snapshots in the peers' memory); what a pipeline reports (metrics)
    ["options.py", "standing.py"],  # the one options value, checked by each feature's own rules; where a
    # pipeline's process stands (its ranks, its replica)
    ["frontends"],  # every way in: from what the user gives to this rank's parts
    ["assembly"],  # the construction path: refusals, agreement, schedule, placement, the engine around parts
    ["relayout"],  # a running pipeline takes a new layout: the construction path again, the state moved
    ["pipeline.py"],  # the facade
    ["hetpipe.py", "calibration"],  # what runs pipelines: HetPipe's virtual workers, the group's calibration
]
RUNTIME_DOOR = "stagewise.runtime"


def _room(module: str) -> str | None:
    """The runtime room of a module: its first folder under runtime/, or its own file at the root."""
    prefix = RUNTIME_DOOR + "."
    if not module.startswith(prefix):
        return None
    first = module[len(prefix) :].split(".")[0]
    return first if (RUNTIME / first).is_dir() else f"{first}.py"


def test_every_runtime_room_has_a_floor() -> None:
    rooms = {p.name for p in RUNTIME.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    declared = [room for floor in RUNTIME_FLOORS for room in floor]
    assert len(declared) == len(set(declared)), "a room stands on two floors"
    assert sorted(rooms - {"__init__.py"}) == sorted(declared), "RUNTIME_FLOORS must name every room, no more"


def test_no_runtime_import_goes_up() -> None:
    """The runtime's rooms stack: no import, eager or lazy, reaches a room on the same floor or above."""
    floor = {room: k for k, rooms in enumerate(RUNTIME_FLOORS) for room in rooms}
    upward: list[str] = []
    for module in modules():
        here = _room(module)
        if here is None or module == RUNTIME_DOOR:
            continue
        for imp in imports_of(module):
            there = _room(imp.target)
            if there is None or imp.target == RUNTIME_DOOR or there == here:
                continue
            if floor[there] >= floor[here]:
                how = "by name" if imp.by_name else "lazily" if imp.lazy else "at the top"
                found = f"{modules()[module].relative_to(SRC)}:{imp.line} imports {imp.target} ({how})"
                if found not in upward:
                    upward.append(found)
    assert upward == [], "imports that go up (or sideways) the runtime's floors:\n" + "\n".join(upward)


def test_only_the_facade_imports_the_runtime() -> None:
    """The pure core never reaches into the runtime, not even by name through importlib: only the facade
    (stagewise/__init__.py and its lazy checkpoint door) loads it, on a name's first use, and the command line
    (``stagewise run`` starts the ranks with the runtime's launcher)."""
    facade = {"stagewise", "stagewise.checkpoint"}
    offenders = [
        f"{module} -> {imp.target}" + (" (by name)" if imp.by_name else "")
        for module in modules()
        if _room(module) is None
        and module != RUNTIME_DOOR
        and module not in facade
        and not module.startswith("stagewise.cli")
        for imp in imports_of(module)
        if imp.target == RUNTIME_DOOR or _room(imp.target) is not None
    ]
    assert offenders == []


def floors_text(floors: list[list[str]], width: int = 110) -> str:
    """The floors as CONTRIBUTING draws them: ground first, ``->`` between floors, folders with a slash."""
    names = [" ".join(r if r.endswith(".py") else f"{r}/" for r in floor) for floor in floors]
    lines = [names[0]]
    for name in names[1:]:
        if len(lines[-1]) + len(name) + 6 > width:
            lines.append(f"  ->  {name}")
        else:
            lines[-1] += f"  ->  {name}"
    return "\n".join(lines)


def test_contributing_draws_the_floors_this_test_reads() -> None:
    """CONTRIBUTING's drawing of the floors is written from RUNTIME_FLOORS (regenerate it with floors_text)."""
    text = (SRC.parents[1] / "CONTRIBUTING.md").read_text()
    drawn = floors_text(RUNTIME_FLOORS)
    assert f"```\n{drawn}\n```" in text, f"CONTRIBUTING.md must draw the floors as:\n{drawn}"
