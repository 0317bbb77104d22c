"""The comparison's simulated columns, from the workload's profiled per-layer costs.

Once per workload (on rank 0 only, so both ranks do not contend for the
cores), :func:`profile_costs` times each layer's forward and backward on one
micro-batch with the library's profiler (``sw.profile``: medians of 5 runs
after 2 warm-ups), cuts the layers into ``SIM_RANKS`` = 4 time-balanced
stages (``LayerProfile.partition``) and sums them into a per-stage
:class:`~stagewise.CostModel` (seconds and bytes; free transfers). An
interleaved schedule with v chunks per rank gets each of those 4 stages split
into v equal chunks (cost / v each): the workloads have too few layers for a
profiled 8-way cut.

:func:`simulated` then runs the simulator on the method's schedule at p = 4:
bubble share and throughput (samples per simulated second) for one mini-batch
(synchronous) or one window (asynchronous), peak weight versions per stage
and the per-rank memory split the simulator predicts (weights, extra weight
versions, activations, in bytes).
"""

from __future__ import annotations

from typing import Any

import torch

import stagewise as sw
from stagewise.partition import uniform_counts
from stagewise.passes import lower
from stagewise.simulation import async_report

SIM_RANKS = 4


def profile_costs(layers: Any, sample: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """Profile each layer on one micro-batch; the 4-stage partition and its cost model, as plain data."""
    model = sw.build_model(layers, seed)
    modules = [m for _, m in model.named_children()]
    profiled = sw.profile(modules, sample)
    partition = profiled.partition(SIM_RANKS)
    costs = profiled.cost_model(partition)
    return {
        "layers": list(profiled.names),
        "layer_times": profiled.times(),
        "layer_activation_bytes": [layer.activation_bytes for layer in profiled.layers],
        "bounds": list(partition.bounds),
        "costs": costs.to_dict(),
        "device": profiled.device,
    }


def _chunked(costs: sw.CostModel, v: int) -> sw.CostModel:
    """Each stage split into ``v`` equal chunks (stage k's chunk c is stage c * p + k, the interleaved placement)."""
    if v == 1:
        return costs
    p = costs.num_stages

    def per(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(values[s % p] / v for s in range(p * v))

    return sw.CostModel(
        num_stages=p * v,
        forward=per(costs.forward),
        backward_input=per(costs.backward_input),
        backward_weight=per(costs.backward_weight),
        activation_bytes=per(costs.activation_bytes),
        weight_activation_bytes=per(costs.weight_activation_bytes),
        parameter_bytes=per(costs.parameter_bytes),
        output_bytes=tuple(costs.output_bytes[s % p] for s in range(p * v)),
        latency=costs.latency,
        bandwidth=costs.bandwidth,
    )


def simulated(schedule: sw.Schedule, family: str, profiled: dict[str, Any], samples_per_mb: float) -> dict[str, Any]:
    """Bubble, throughput (samples/s), versions and the memory split per rank at p = 4, from the profiled costs."""
    if not schedule.is_complete:
        schedule = lower(schedule)
    base = sw.CostModel.from_dict(profiled["costs"])
    v = schedule.num_stages // SIM_RANKS
    costs = _chunked(base, v)
    result = sw.simulate(schedule, costs)
    weights = [sum(costs.parameter_bytes[s] for s in schedule.stages_of(r)) for r in range(SIM_RANKS)]
    if family == "async":
        report = async_report(schedule, result)
        versions = list(report.peak_versions)
        # the live weights are counted in "weights"; the version store holds the rest
        extra = [max(n - 1, 0) * w for n, w in zip(versions, weights, strict=True)]
    else:
        versions, extra = [1] * SIM_RANKS, [0.0] * SIM_RANKS
    return {
        "bubble": result.bubble_ratio,
        "throughput": schedule.num_microbatches * samples_per_mb / result.makespan,
        "versions": versions,
        "activations": list(result.peak_activations),
        "memory": {"weights": weights, "versions": extra, "activations": list(result.peak_activation_bytes)},
        "timeline": result,
    }


def simulated_activation_bytes(schedule: sw.Schedule, layers: Any, profiled: dict[str, Any]) -> list[float]:
    """Peak activation bytes per rank for ``schedule`` on the measured ranks, its stages cut as the Pipeline's
    default (uniform layer counts), with the profiled per-layer bytes (what the runtime cannot count)."""
    per_layer = _layer_bytes(profiled)
    n = len(per_layer)
    counts = uniform_counts(n, schedule.num_stages)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    act = tuple(float(sum(per_layer[a:b])) for a, b in zip(bounds, bounds[1:], strict=False))
    ones, zeros = (1.0,) * len(act), (0.0,) * len(act)
    costs = sw.CostModel(len(act), ones, ones, ones, act, act, zeros, zeros)
    lowered = schedule if schedule.is_complete else lower(schedule)
    return list(sw.simulate(lowered, costs).peak_activation_bytes)


def _layer_bytes(profiled: dict[str, Any]) -> list[float]:
    return list(profiled["layer_activation_bytes"])
