"""The shape of the house, by path: torch lives under ``runtime/``; torch.distributed in its comm and hybrid rooms."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"
RUNTIME = SRC / "runtime"
#: the rooms allowed to import torch.distributed: the transport and collectives; the hybrid axes, which wrap
#: torch's DeviceMesh, FSDP2 and DTensor; the checkpoint's storage, which wraps torch.distributed.checkpoint
#: (their collectives run inside torch); the launcher
DISTRIBUTED_ROOMS = [
    RUNTIME / "comm",
    RUNTIME / "hybrid",
    RUNTIME / "checkpoint" / "storage.py",
    RUNTIME / "launch.py",
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
