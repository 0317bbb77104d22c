"""The shape of the house: the pure core imports no torch; only the transport talks to torch.distributed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stagewise"
#: modules allowed to import torch.distributed (the transport, process-group set-up, the mesh)
DISTRIBUTED_ALLOWED = {
    "runtime/transport.py",
    "runtime/init.py",
    "runtime/mesh.py",
    "cli.py",
    "runtime/sharding.py",  # wraps torch's FSDP2 fully_shard; its collectives run inside torch
    "runtime/tensor_parallel.py",  # wraps torch's DTensor tensor-parallel styles; likewise
}
#: the pure core: no torch at all
PURE = [
    "actions.py",
    "profile_data.py",
    "schedule.py",
    "dataflow.py",
    "passes.py",
    "validate.py",
    "costs.py",
    "simulate.py",
    "timeline.py",
    "schedules",
    "render",
    "parallel",
    "plan",
]
_DIST_IMPORT = re.compile(
    r"^\s*(import torch\.distributed|from torch\.distributed|from torch import distributed)", re.M
)
_TORCH_IMPORT = re.compile(r"^\s*(import torch\b|from torch\b)", re.M)


def _files(entry: str) -> list[Path]:
    path = SRC / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []


def test_only_the_transport_imports_torch_distributed() -> None:
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if _DIST_IMPORT.search(path.read_text()) and str(path.relative_to(SRC)) not in DISTRIBUTED_ALLOWED
    ]
    assert offenders == [], f"torch.distributed imported outside the transport: {offenders}"


def test_the_pure_core_never_imports_torch() -> None:
    offenders = [
        str(p.relative_to(SRC)) for entry in PURE for p in _files(entry) if _TORCH_IMPORT.search(p.read_text())
    ]
    assert offenders == [], f"pure modules import torch: {offenders}"


def test_planning_and_simulating_load_no_torch() -> None:
    code = (
        "import sys, stagewise as sw\n"
        "from stagewise.simulate import simulate\n"
        "for name in sw.schedule_names():\n"
        "    info = sw.schedule_info(name)\n"
        "    simulate(sw.build_schedule(name, 4, 8, info.default_virtual_stages))\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
