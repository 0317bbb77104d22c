"""A held-out plan Q's stage costs from a run's calibration (issue 49 item 2): pure arithmetic, no torch.

The calibrated layers (:meth:`~stagewise.planning.recalibrate.RunCalibration.profile`) cut as Q cuts them, at
Q's micro-batch, and each stage's SYNC a ring all-reduce of its gradients over Q's replicas on the calibrated
(or probed) link; nothing of Q is measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from ..partition import LayerProfile
from ..simulation import CostModel
from .action_cost import at_batch
from .comm import Link, ring_all_reduce
from .tied_sum import reduced_bytes


class Calibrated(Protocol):
    """What a held-out plan's costs read of a :class:`~stagewise.planning.recalibrate.RunCalibration` (a protocol,
    so that this module does not import the one that uses it; ``RunCalibration`` below is that class)."""

    @property
    def counts(self) -> tuple[int, ...]: ...
    @property
    def tied(self) -> tuple[tuple[tuple[int, ...], float], ...]: ...
    @property
    def reduce(self) -> tuple[float, float] | None: ...
    @property
    def reduce_cpu(self) -> float: ...
    @property
    def reduce_link(self) -> Link: ...

    def profile(self, prior: LayerProfile) -> LayerProfile: ...


def held_out_costs(
    calibration: Calibrated,
    prior: LayerProfile,
    counts: Sequence[int],
    *,
    batch_ratio: float = 1.0,
    dp: int = 1,
    at: LayerProfile | None = None,
) -> CostModel:
    """A plan Q's stage costs from the calibrated layers: cut into ``counts``; every time and activation scaled
    by Q's micro-batch over the calibrating plan's (``batch_ratio``, the planner's linear scaling), or, with
    ``at`` (the layers profiled at Q's micro-batch), ``at``'s costs scaled as the run scaled ``prior``'s
    (:func:`~stagewise.planning.action_cost.at_batch`; ``batch_ratio`` is then not applied); with ``dp``
    replicas each stage's SYNC a ring all-reduce of its gradients over the calibrated link (:func:`ring_synced`).
    Nothing of Q is measured."""
    if at is not None:
        costs = at_batch(calibration.profile(prior), prior, at).cost_model(layer_bounds(counts))
        return ring_synced(costs, dp, calibration, counts)
    layers = calibration.profile(prior).layers
    scaled = tuple(
        replace(
            x,
            forward=x.forward * batch_ratio,
            backward=x.backward * batch_ratio,
            backward_input=x.backward_input * batch_ratio,
            backward_weight=x.backward_weight * batch_ratio,
            activation_bytes=x.activation_bytes * batch_ratio,
            weight_activation_bytes=x.weight_activation_bytes * batch_ratio,
            output_bytes=x.output_bytes * batch_ratio,
        )
        for x in layers
    )
    return ring_synced(replace(prior, layers=scaled).cost_model(layer_bounds(counts)), dp, calibration, counts)


def ring_synced(costs: CostModel, dp: int, calibration: Calibrated, counts: Sequence[int] | None = None) -> CostModel:
    """``costs`` (the layers cut by ``counts``; None: the calibrating plan's, :attr:`RunCalibration.counts`) with
    each stage's SYNC a ring all-reduce over ``dp`` replicas on the calibration's
    :attr:`RunCalibration.reduce_link` (unchanged for one replica) of its parameter bytes less the
    :attr:`RunCalibration.tied` weights it holds, which the runtime sums apart
    (:func:`~stagewise.planning.tied_sum.reduced_bytes`); its CPU share :attr:`RunCalibration.reduce_cpu`."""
    if dp <= 1:
        return costs
    bounds = layer_bounds(calibration.counts if counts is None else counts)
    nbytes = reduced_bytes(costs.parameter_bytes, bounds, calibration.tied)
    link = calibration.reduce_link
    cpu = calibration.reduce_cpu if calibration.reduce is not None else 0.0
    return replace(costs, sync_time=tuple(ring_all_reduce(b, dp, link) for b in nbytes), sync_cpu=cpu)


def layer_bounds(counts: Sequence[int]) -> list[int]:
    """The layer bounds of stages of ``counts`` layers each (``[0, c0, c0 + c1, ...]``)."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds
