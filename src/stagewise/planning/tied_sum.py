"""The gradient sum of parameters tied across stages, priced for a plan (issue 49): pure arithmetic, no torch.

A model may use one module at two places of its layer list (a language model's head reusing the token embedding:
:class:`stagewise.runtime.Tied`). The runtime (:mod:`stagewise.runtime.frontends.tied`) sums its gradients over the
ranks holding a stage that uses it, and over their replicas: each rank starts the all-reduce at the SYNC of its last
such stage, and waits for it at the step's end (or at that stage's STEP). Where every use lives on one pipeline rank
(the V placement puts stage 0 and the last stage together) only the replicas sum it, as they sum the rest of the
stage. None of it is in the action list, so the simulator saw none of it. On two machines 10 ms apart it is what
ranked the plans backwards: every plan but ZB-V ties its first and last stages across the machines, and each step
waited for a ring between them (4 ranks at pp 2, dp 2: 6 steps of a notice and a message each), which ZB-V never
runs (issue 49, calibration benchmark, links74: 4 processes, 10 ms; measured minus the model's step, ZB-V 18-29 ms,
every other schedule 140-190 ms).

:func:`tied_sums` prices each tied set for a plan: its stages under the plan's cut, its bytes (its layers' parameter
bytes: the first use holds them), a ring over its ranks and their replicas
(:func:`~stagewise.planning.comm.posted_ring_all_reduce`, on the link between the machines its ranks span, else the
one inside a machine); the replicas alone, on the replicas' all-reduce link, as their SYNC is priced.
:func:`stagewise.simulation.shared_makespan` (``tied=``) waits for each at the step's end. The planner prices each
candidate's the same way, from the sets its profile records (``LayerProfile.tied``, with the bytes measured:
:func:`stagewise.planning.candidate.tied_costs`); :func:`tied_bytes` serves a run's sets known by index alone.

The runtime leaves a tied parameter out of its stage's own collectives (the replicas' all-reduce, sharding's
gathers and reduce-scatters: ``whole`` in :mod:`stagewise.runtime.hybrid.hybrid`), so the bytes of those
(:func:`reduced_bytes`) are the stage's parameters less the tied sets it holds; pricing both counted a tied matrix
twice. Its memory still holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..partition import LayerProfile
from .comm import Link, posted_ring_all_reduce, ring_all_reduce

__all__ = ["TiedSum", "reduced_bytes", "tied_bytes", "tied_sums"]


class TiedSum(NamedTuple):
    """One tied set's all-reduce in a plan: the stages using it and its seconds (``shared_makespan``'s ``tied``)."""

    stages: tuple[int, ...]
    seconds: float


def tied_bytes(profile: LayerProfile, tied: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Each set of tied layers (indices into ``profile``'s layers, e.g. ``[[0, 11]]``: the token embedding and the
    head reusing it) with the bytes its gradient sum moves: what ``profile.tied`` measured for the same set, else
    its layers' parameter bytes (a later use holds none; a layer that holds more than the tied matrix, as a
    transformers model's first and last units do, counts it all)."""
    measured = {tuple(layers): nbytes for layers, nbytes in profile.tied}
    out = []
    for layers in tied:
        ks = tuple(sorted({int(k) for k in layers}))
        if len(ks) < 2 or not all(0 <= k < len(profile) for k in ks):
            raise ValueError(
                f"tied layers: each set names at least two of the profile's {len(profile)} layers (0-based), got "
                f"{list(layers)}"
            )
        out.append((ks, float(measured.get(ks, sum(profile.layers[k].parameter_bytes for k in ks)))))
    return tuple(out)


def tied_sums(
    tied: Sequence[tuple[Sequence[int], float]],
    counts: Sequence[int],
    placement: Sequence[int],
    *,
    between: Link,
    local: Link | None = None,
    replicas: Link | None = None,
    dp: int = 1,
    nodes: Sequence[int] | None = None,
) -> tuple[TiedSum, ...]:
    """The plan's gradient sum of each tied set (``(layers, bytes)``, :func:`tied_bytes`): the plan cuts its layers
    into stages of ``counts`` layers, placed on pipeline ranks by ``placement``, each rank ``dp`` replicas, on
    machines ``nodes`` (per pipeline rank; None: one link for all). On several pipeline ranks: a ring over them and
    their replicas, on ``between`` where they span machines, else on ``local`` (``between`` where not given); on one:
    its replicas' ring on ``replicas`` (``between`` where not given); nothing to sum on one rank without replicas."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    if len(placement) != len(counts) or (nodes is not None and len(nodes) <= max(placement, default=0)):
        where = None if nodes is None else list(nodes)
        raise ValueError(f"tied_sums: counts of {len(counts)} stages, {len(placement)} placed, machines {where}")
    out = []
    for layers, nbytes in tied:
        stages = tuple(sorted({_stage_of(k, bounds) for k in layers}))
        ranks = {placement[s] for s in stages}
        if len(ranks) == 1:
            seconds = ring_all_reduce(nbytes, dp, replicas or between)
        else:
            spans = nodes is None or len({nodes[r] for r in ranks}) > 1
            seconds = posted_ring_all_reduce(nbytes, len(ranks) * dp, between if spans else (local or between))
        if seconds > 0:
            out.append(TiedSum(stages, seconds))
    return tuple(out)


def reduced_bytes(
    parameters: Sequence[float], bounds: Sequence[int], tied: Sequence[tuple[Sequence[int], float]]
) -> tuple[float, ...]:
    """Per stage of the cut at ``bounds`` (``parameters`` its parameter bytes), the bytes its own collectives over
    the replicas move: its parameters less the bytes of each ``tied`` set (``(layers, bytes)``, :func:`tied_bytes`)
    whose first use it holds (that layer holds the tied matrix), never below 0 (module docstring)."""
    if len(parameters) != len(bounds) - 1:
        raise ValueError(f"reduced_bytes: {len(parameters)} stages' parameter bytes for a cut of {len(bounds) - 1}")
    out = [float(x) for x in parameters]
    for layers, nbytes in tied:
        out[_stage_of(min(layers), bounds)] -= nbytes
    return tuple(max(0.0, x) for x in out)


def _stage_of(layer: int, bounds: Sequence[int]) -> int:
    for s in range(len(bounds) - 1):
        if bounds[s] <= layer < bounds[s + 1]:
            return s
    raise ValueError(f"tied layer {layer} is outside the plan's {bounds[-1]} layers")
