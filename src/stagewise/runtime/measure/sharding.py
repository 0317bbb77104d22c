"""Measure what one FSDP2 unit costs per step on the actual group (the planner's calibrated sharding cost).

The runtime (:mod:`..hybrid.sharding`) gathers a unit's parameters at its first forward
and reduce-scatters its gradient at SYNC. Here one ``Linear(width, width)``
unit sharded over every rank does exactly that once per round (a forward, a
backward, :func:`..hybrid.sharding.reduce`), and the same layer unsharded does the
forward and backward alone; the difference, the slowest rank's median, is the
unit's collective cost. Two widths give a fixed part per unit and a part per
parameter byte.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..hybrid import sharding as zero
from .links import slowest


def _round(layer: nn.Module, x: torch.Tensor, units: list[object]) -> float:
    started = time.perf_counter()
    layer(x).sum().backward()
    if units:
        zero.reduce(units)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    layer.zero_grad(set_to_none=True)
    return elapsed


def unit_cost(width: int, *, rounds: int = 5, timeout: float = 60.0) -> float:
    """Seconds one sharded ``Linear(width, width)`` unit adds per step over every rank (a collective)."""
    deadline = time.monotonic() + timeout
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sharding",))
    torch.manual_seed(0)
    local = nn.Linear(width, width, bias=False).double()
    sharded = copy.deepcopy(local)
    units = zero.shard_layers([sharded], mesh)
    x = torch.randn(1, width, dtype=torch.float64)
    plain = [_round(local, x, []) for _ in range(rounds + 1)][1:]
    with warnings.catch_warnings():  # FSDP2 warns that a bias-free Linear's output is a view: nothing here edits it
        warnings.simplefilter("ignore", UserWarning)
        gathered = [_round(sharded, x, list(units)) for _ in range(rounds + 1)][1:]
    return slowest(max(statistics.median(gathered) - statistics.median(plain), 0.0), deadline)


def sharding_costs(*, rounds: int = 5, timeout: float = 60.0) -> tuple[float, float]:
    """``(fixed seconds per unit, seconds per parameter byte)`` on every rank, from widths 16 and 512."""
    small, large = 16, 512
    t_small = unit_cost(small, rounds=rounds, timeout=timeout)
    t_large = unit_cost(large, rounds=rounds, timeout=timeout)
    bytes_small, bytes_large = 8 * small * small, 8 * large * large
    per_byte = max(t_large - t_small, 0.0) / (bytes_large - bytes_small)
    return max(t_small - per_byte * bytes_small, 0.0), per_byte
