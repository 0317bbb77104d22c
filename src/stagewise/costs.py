"""The cost model: what a stage costs in time and memory, for the simulator and the planner."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _per_stage(value: float | Sequence[float], num_stages: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * num_stages
    values = tuple(float(x) for x in value)
    if len(values) != num_stages:
        raise ValueError(f"cost model: {what} has {len(values)} entries, expected one per stage ({num_stages})")
    return values


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs. Times in any unit (seconds when profiled); bytes per micro-batch.

    ``forward``, ``backward_input`` (I) and ``backward_weight`` (W) are compute
    times; a full backward B costs I + W. ``activation_bytes`` is what a
    stage keeps from F until its backward; ``weight_activation_bytes`` the
    part of it that W still needs after I has run. ``output_bytes`` is what a
    stage sends to its neighbour (activations forward, gradients back); a
    transfer takes ``latency + bytes / bandwidth`` and overlaps compute.
    """

    num_stages: int
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    weight_activation_bytes: tuple[float, ...]
    parameter_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    latency: float = 0.0
    bandwidth: float = math.inf
    sync_time: tuple[float, ...] = ()
    step_time: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "forward",
            "backward_input",
            "backward_weight",
            "activation_bytes",
            "weight_activation_bytes",
            "parameter_bytes",
            "output_bytes",
            "sync_time",
            "step_time",
        ):
            value = getattr(self, name)
            if name in ("sync_time", "step_time") and value == ():
                object.__setattr__(self, name, (0.0,) * self.num_stages)
                continue
            values = _per_stage(value, self.num_stages, name)
            bad = [(s, x) for s, x in enumerate(values) if x < 0 or math.isnan(x)]
            if bad:
                raise ValueError(f"cost model: {name} must be >= 0, got {bad[0][1]} for stage {bad[0][0]}")
            object.__setattr__(self, name, values)
        if self.latency < 0 or self.bandwidth <= 0:
            raise ValueError(f"cost model: need latency >= 0 and bandwidth > 0, got {self.latency}, {self.bandwidth}")

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        activation_bytes: float = 1.0,
        weight_activation_bytes: float | None = None,
        parameter_bytes: float = 1.0,
        output_bytes: float = 1.0,
        comm_time: float = 0.0,
    ) -> CostModel:
        """Every stage alike; ``comm_time`` is a fixed transfer time (latency, infinite bandwidth)."""
        return cls(
            num_stages=num_stages,
            forward=(forward,) * num_stages,
            backward_input=(backward_input,) * num_stages,
            backward_weight=(backward_weight,) * num_stages,
            activation_bytes=(activation_bytes,) * num_stages,
            weight_activation_bytes=(
                (activation_bytes / 2 if weight_activation_bytes is None else weight_activation_bytes),
            )
            * num_stages,
            parameter_bytes=(parameter_bytes,) * num_stages,
            output_bytes=(output_bytes,) * num_stages,
            latency=comm_time,
        )

    def backward(self, stage: int) -> float:
        return self.backward_input[stage] + self.backward_weight[stage]

    def transfer_time(self, stage: int) -> float:
        """Time to move stage ``stage``'s output (or input gradient) to a neighbouring rank."""
        return self.latency + self.output_bytes[stage] / self.bandwidth
