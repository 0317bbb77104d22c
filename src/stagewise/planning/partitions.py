"""The exact partition of each (tp, recompute, speeds, crossings, caps), computed once per search."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..ir import boundary_crossings
from ..partition import partition_costs
from .comm import Link
from .costing import LayerArrays, StageBase, layer_arrays, partition_weights, stage_base
from .inputs import Problem
from .layouts import Layout


class Partitions:
    """The exact partition for each (layout shape, stages, tp, recompute, speeds, caps), computed once."""

    def __init__(self, prob: Problem) -> None:
        self.prob = prob
        self.arrays: dict[int, LayerArrays] = {}
        self.cache: dict[tuple[object, ...], tuple[tuple[int, ...], StageBase] | str] = {}

    def layer_arrays(self, tp: int) -> LayerArrays:
        if tp not in self.arrays:
            self.arrays[tp] = layer_arrays(self.prob.profile, tp, self.prob.tp_layers)
        return self.arrays[tp]

    def get(
        self, layout: Layout, placement: Sequence[int], v: int, recompute: str | None
    ) -> tuple[tuple[int, ...], StageBase] | str:
        config = layout.config
        speeds = tuple(layout.speeds[r] for r in placement)
        finite = any(not math.isinf(c) for c in layout.caps)
        # parameters + gradients + optimizer state per parameter byte (see static_memory)
        per_byte = 2 + self.prob.optimizer_state / config.sharding
        caps = tuple(layout.caps[r] / v / per_byte for r in placement) if finite else None
        tp_link = layout.links["tp"]
        crossing = boundary_crossings(placement)  # the messages a stage posts: the free key's fifth, before any caps
        free_key = (config.tp, recompute, speeds, tp_link if config.tp > 1 else None, crossing)
        got = self._partition(free_key, None)
        if caps is None or isinstance(got, str):
            return got
        arrays = self.layer_arrays(config.tp)
        bounds = got[0]
        if all(sum(arrays.parameters[a:b]) <= cap for a, b, cap in zip(bounds, bounds[1:], caps)):
            return got  # the fastest cut already fits: no need to cut again under the caps
        if sum(arrays.parameters) > sum(caps) or max(arrays.parameters) > max(caps):
            return got  # no cut can fit: the memory check will say by how much
        capped = self._partition((*free_key, caps), caps)
        # no cut fits: keep the fastest, so the memory check reports its exact peak and what dominates it
        return got if isinstance(capped, str) else capped

    def _partition(
        self, key: tuple[object, ...], caps: tuple[float, ...] | None
    ) -> tuple[tuple[int, ...], StageBase] | str:
        tp, recompute, speeds, tp_link, crossing = key[:5]
        if key not in self.cache:
            arrays = self.layer_arrays(tp)  # type: ignore[arg-type]
            link = tp_link if isinstance(tp_link, Link) else Link()
            weights = partition_weights(
                arrays,
                tp=tp,  # type: ignore[arg-type]
                tp_link=link,
                recompute=recompute,  # type: ignore[arg-type]
                overhead=self.prob.overhead,
                backward_overhead=self.prob.backward_overhead,
            )
            try:
                part = partition_costs(
                    weights,
                    len(speeds),  # type: ignore[arg-type]
                    speeds=speeds,  # type: ignore[arg-type]
                    memory=arrays.parameters if caps is not None else None,
                    memory_caps=caps,
                )
            except ValueError as err:
                self.cache[key] = f"parameters, gradients and optimizer state do not fit: {err}"
            else:
                base = stage_base(
                    arrays,
                    part.bounds,
                    tp=tp,  # type: ignore[arg-type]
                    tp_link=link,
                    recompute=recompute,  # type: ignore[arg-type]
                    overhead=self.prob.overhead,
                    action_overhead=self.prob.action_overhead,
                    message=self.prob.message,
                    factor=self.prob.compute_scale,
                    backward_overhead=self.prob.backward_overhead,
                    crossing=crossing,  # type: ignore[arg-type]
                )
                self.cache[key] = (part.bounds, base)
        return self.cache[key]
