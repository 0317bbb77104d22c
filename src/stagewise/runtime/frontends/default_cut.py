"""The default cut of a layer list (``partition="balanced"``), decided on one rank and handed to the others.

Rank 0 of the pipeline's group counts the layers' work on the ``meta`` device (one micro-batch of
``sample_inputs``; :mod:`..measure.counting`), or reads their parameter counts without sample inputs, and
cuts (:func:`stagewise.partition.modes.stage_counts`); the counts per stage, and the estimated profile they
came from, reach every rank through :func:`.balance.on_first_rank`, so every rank builds the same cut
whatever its own arithmetic would say. The cut is recorded where every layout is (a checkpoint's and a
snapshot's ``layout.pipeline.layers``, with ``layout.pipeline.partition``), and a resume on the same layout
takes it back rather than deciding again (:mod:`stagewise.runtime.checkpoint.recorded_cut`). When the
estimate predicts the schedule slower than 1F1B on the same layers by more than
:data:`stagewise.planning.defaults.NOISE`, rank 0 says so in one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...ir import Schedule
from ...partition import LayerProfile, stage_counts
from ...partition.estimate import CountedLayer, estimated_profile, rates_for
from ...planning.defaults import against_1f1b, refined_counts
from ..measure.counting import count_layers
from .layers import LayerLike, parameter_count
from .tied import TiedBuilder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DefaultCut:
    """Layer counts per stage; the estimated profile (None when cut by parameters); what decided."""

    counts: list[int]
    profile: LayerProfile | None
    source: str  # "counted", "parameters" (or "profiled": a measured profile's cut, for the warning)


def decide(
    named: Sequence[tuple[str, LayerLike]],
    schedule: Schedule,
    *,
    sample_inputs: Any,
    speeds: Sequence[float] | None,
    seed: int,
    device: str,
) -> DefaultCut:
    """The default cut as this rank computes it (rank 0's is the one every rank uses, handed round by
    :func:`.balance.on_first_rank`)."""
    profile, source = None, "parameters"
    if sample_inputs is not None:
        try:
            builder = TiedBuilder(named, seed, None)
            counted = count_layers([n for n, _ in named], lambda k: builder.build(named[k][1], k), sample_inputs)
            profile, source = estimated_profile(counted, rates_for(device)), "counted"
        except Exception as err:  # a layer that cannot run on meta: its parameters say what they can
            log.info("stagewise: counting the layers on the meta device failed (%s); cutting by parameters", err)
    if profile is None:
        profile = estimated_profile([_by_parameters(n, x) for n, x in named], rates_for(device), loss_passes=0.0)
    counts = stage_counts(
        len(named),
        schedule.num_stages,
        "balanced",
        times=profile.times() if any(profile.times()) else None,
        speeds=speeds,
        placement=schedule.placement,
    )
    if speeds is None and any(profile.times()):
        counts = refined_counts(profile, schedule, counts)
    if source != "counted":
        profile = None  # parameter counts are no times: nothing to predict from
    return DefaultCut(counts, profile, source)


def _by_parameters(name: str, layer: LayerLike) -> CountedLayer:
    """Without sample inputs: a layer's work as if proportional to its parameters (a multiply-add per
    parameter and sample forward, two backward), which is what ``"parameters"`` balances."""
    n = float(parameter_count(layer))
    return CountedLayer(name, 2 * n, 4 * n, 0.0, 0.0, 0, 0, n, 4 * n, 0.0)


def plain(cut: DefaultCut) -> dict[str, Any]:
    """The cut as JSON data (what crosses ranks)."""
    return {
        "counts": cut.counts,
        "source": cut.source,
        "profile": None if cut.profile is None else cut.profile.to_json(),
    }


def unplain(data: dict[str, Any]) -> DefaultCut:
    raw = data["profile"]
    return DefaultCut(
        [int(c) for c in data["counts"]], None if raw is None else LayerProfile.from_json(raw), data["source"]
    )


def warn_if_slower(schedule: Schedule, cut: DefaultCut, rank: int) -> None:
    """Rank 0: one warning when the estimate predicts ``schedule`` slower than 1F1B beyond the noise."""
    if rank != 0 or cut.profile is None:
        return
    try:
        verdict = against_1f1b(cut.profile, schedule, cut.counts)
    except ValueError as err:  # a schedule the plain simulator cannot time: nothing to say
        log.debug("stagewise: no prediction against 1F1B (%s)", err)
        return
    if verdict is not None and verdict.slower:
        log.warning("%s", verdict.line())
