"""Measure what one FSDP2 unit costs on the actual group (the planner's calibrated sharding costs).

The runtime (:mod:`..hybrid.sharding`) gathers a unit's parameters at its first forward
and reduce-scatters its gradient at SYNC. Here one ``Linear(width, width)``
unit sharded over every rank does exactly that once per round (a forward, a
backward, :func:`..hybrid.sharding.reduce`), and the same layer unsharded does the
forward and backward alone; the difference, the slowest rank's median, is the
unit's collective cost per step. Two widths give a fixed part per unit and a
part per parameter byte.

Every micro-batch also runs FSDP2's hooks around each unit's forward and
backward, with the parameters already gathered (no traffic): :func:`hook_cost`
times many micro-batches of a gathered unit against the same layer unsharded,
CPU time of the calling thread, and gives the seconds per unit and micro-batch
(the planner adds them to each action of a sharded stage). Before it was
measured, the layouts' fitted cost carried it as a cross term per unit and
micro-batch, read off four probe corners (u <= 2, m <= 6) and so multiplied, with
the corners' noise, by u x m = 768 for a 12-unit stage of 64 micro-batches.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..hybrid import sharding as zero
from .links import average, slowest


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
    gathered = [_round(sharded, x, list(units)) for _ in range(rounds + 1)][1:]  # (FSDP2's view warning: shard_layers)
    return slowest(max(statistics.median(gathered) - statistics.median(plain), 0.0), deadline)


def sharding_costs(*, rounds: int = 5, timeout: float = 60.0) -> tuple[float, float]:
    """``(fixed seconds per unit, seconds per parameter byte)`` on every rank, from widths 16 and 512."""
    small, large = 16, 512
    t_small = unit_cost(small, rounds=rounds, timeout=timeout)
    t_large = unit_cost(large, rounds=rounds, timeout=timeout)
    bytes_small, bytes_large = 8 * small * small, 8 * large * large
    per_byte = max(t_large - t_small, 0.0) / (bytes_large - bytes_small)
    return max(t_small - per_byte * bytes_small, 0.0), per_byte


def hook_cost(*, width: int = 16, microbatches: int = 20, rounds: int = 5, timeout: float = 60.0) -> float:
    """CPU seconds FSDP2 adds to one unit's forward and backward per micro-batch, its parameters gathered and its
    reduction off (as the runtime runs every micro-batch but the step's last reduce), the mean over ranks."""
    deadline = time.monotonic() + timeout
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sharding",))
    torch.manual_seed(0)
    local = nn.Linear(width, width).double()
    sharded = copy.deepcopy(local)
    units = zero.shard_layers([sharded], mesh)
    x = torch.randn(1, width, dtype=torch.float64)

    def per_microbatch(layer: nn.Module) -> float:
        started = time.thread_time()
        for _ in range(microbatches):
            layer(x).sum().backward()
        return (time.thread_time() - started) / microbatches

    sharded(x).sum().backward()  # the first forward gathers the parameters (every rank at once)
    plain, hooked = [], []
    for _ in range(rounds + 1):  # alternating, the first pair a warm-up
        plain.append(per_microbatch(local))
        hooked.append(per_microbatch(sharded))
    zero.reduce(units)  # the step's end: reduce-scatter, reshard (every rank at once)
    extra = max(statistics.median(hooked[1:]) - statistics.median(plain[1:]), 0.0)
    return average(extra, deadline)
