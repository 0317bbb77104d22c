"""``schedule="auto"``: a schedule synthesized for the layers' measured costs (:mod:`stagewise.synthesis`).

Before anything is placed, the first rank profiles the layers on ``sample_inputs`` (one micro-batch) and
hands the profile to every rank (:func:`..frontends.balance.on_first_rank`); every rank cuts the layers with
the partition mode (``"time"`` unless layer counts are given) over ``pp * virtual_stages`` stages, and
synthesizes the schedule for those stages' costs: deterministic, so every rank holds the same one. The
pipeline then runs that ordinary, validated :class:`~stagewise.Schedule` as if it had been given.

Only layer lists are profiled this way; other ways in take a synthesized Schedule built by hand
(``stagewise.synthesis.synthesize_for``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...partition import stage_counts
from ..frontends.balance import ROUNDS, on_first_rank, profile_layers
from ..frontends.layer_list import LayerList
from ..frontends.layers import parameter_count
from ..measure.profiling import steadiest
from ..options import Options
from .context import pipeline_size

AUTO = "auto"


def synthesized(entry: str, frontend: Any, options: Options) -> Options:
    """``options`` with ``schedule="auto"`` replaced by the synthesized schedule and the partition it assumed."""
    if options.schedule != AUTO:
        return options
    if not isinstance(frontend, LayerList):
        raise ValueError(
            f"{entry}: schedule='auto' profiles a layer list; for this way in pass a Schedule synthesized with "
            "stagewise.synthesis.synthesize_for(costs, ...)"
        )
    if options.sample_inputs is None:
        raise ValueError(
            f"{entry}: schedule='auto' synthesizes for measured costs: pass sample_inputs= (one micro-batch)"
        )
    from ...synthesis import synthesize_for

    p = pipeline_size(options)
    v = options.virtual_stages or 1
    m = options.microbatches or p
    named = frontend.named
    profile = on_first_rank(
        options.group if options.parallel is None else None,
        lambda: steadiest(lambda: profile_layers(named, options.sample_inputs, seed=options.seed), ROUNDS),
        "profiling the layers for schedule='auto'",
        options.timeout,
        options.store,
    )
    how = "time" if options.partition == "uniform" else options.partition  # "uniform" is the default: time it
    counts = stage_counts(
        len(named), p * v, how, profile=profile, parameters=lambda: [parameter_count(x) for _, x in named]
    )
    schedule = synthesize_for(profile, p, m, partition=counts, virtual_stages=v)
    return replace(options, schedule=schedule, partition=counts, microbatches=None, virtual_stages=None)
