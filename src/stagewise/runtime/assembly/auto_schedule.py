"""``schedule="auto"``: a schedule synthesized for the layers' measured costs (:mod:`stagewise.synthesis`).

Before anything is placed, the first rank profiles the layers on ``sample_inputs`` (one micro-batch) and hands the
profile to every rank (:func:`..frontends.balance.on_first_rank`), with the bytes the loss keeps (a layer list's
estimated, ``sample_inputs`` carry no targets to run it on; a transformers model's measured with the input ids as
labels: :func:`..frontends.layer_timing.with_loss_bytes`); every rank cuts the layers with the partition mode
(``"time"`` unless layer counts are given) and synthesizes a schedule for those stages' measured costs, under 1F1B's
activation memory (``min(pp, m)`` micro-batches in flight on every rank, the synthesizer's default cap):
deterministic, so every rank holds the same one. Unless ``virtual_stages`` is given (or layer counts, one per stage,
fix the stages per rank), it does so for one stage per rank (loop placement) and for two (V placement, as zb-v), and
keeps the faster by the simulator. A synthesized order replaces the fastest registered schedule that fits the same
cap (the synthesizer's baseline, run as registered) only when it simulates faster by more than
:data:`REGISTERED_MARGIN`: a gain smaller than the profile's own reproducibility is noise, and on other measurements
of the same layers it is as often a loss (measured on the d 256 GPT at 2 ranks: the order synthesized on auto's own
profile simulated 2.1 % slower than zb-v's on a second profile of the same layers, and ran 2.7 % slower). The
pipeline then runs that ordinary, validated :class:`~stagewise.Schedule` as if it had been given;
``meta["synthesis"]`` carries the synthesizer's report either way, and ``meta["auto"]`` says which was kept and why.

Layer lists and transformers models (``from_hf``, per decoder layer) are profiled this way; other ways in take
a synthesized Schedule built by hand (``stagewise.synthesis.synthesize_for``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ...partition import stage_counts
from ..comm import groups
from ..frontends.balance import ROUNDS, on_first_rank, profile_layers
from ..frontends.hf import FromHF
from ..frontends.layer_list import LayerList
from ..frontends.layer_timing import with_loss_bytes
from ..frontends.layers import parameter_count
from ..measure.profiling import steadiest
from ..options import Options
from .context import pipeline_size

log = logging.getLogger(__name__)
AUTO = "auto"
#: how much faster by the simulator a synthesized order must be than the registered baseline to be kept: the
#: profile's round-to-round spread on a quiet machine is about 1 % per stage
REGISTERED_MARGIN = 0.01


def synthesized(entry: str, frontend: Any, options: Options) -> Options:
    """``options`` with ``schedule="auto"`` replaced by the synthesized schedule and the partition it assumed."""
    if options.schedule != AUTO:
        return options
    if not isinstance(frontend, (LayerList, FromHF)):
        raise ValueError(
            f"{entry}: schedule='auto' profiles a layer list or a transformers model (from_hf); for this way in "
            "pass a Schedule synthesized with stagewise.synthesis.synthesize_for(costs, ...), the costs from "
            "sw.profile(model, sample).cost_model(boundaries)"
        )
    if options.sample_inputs is None:
        raise ValueError(
            f"{entry}: schedule='auto' synthesizes for measured costs: pass sample_inputs= (one micro-batch)"
        )
    p = pipeline_size(options)
    m = options.microbatches or p
    named: Any = frontend.named if isinstance(frontend, LayerList) else frontend.units()
    device = "cpu" if isinstance(frontend, LayerList) else next(frontend.model.parameters()).device
    measure_loss = frontend.loss_measure(options) if isinstance(frontend, FromHF) else None
    profile = on_first_rank(
        options.group if options.parallel is None else None,
        lambda: with_loss_bytes(
            steadiest(
                lambda: profile_layers(
                    named, options.sample_inputs, seed=options.seed, device=device, measure_loss=measure_loss
                ),
                ROUNDS,
            ),
            options.loss_fn is not None,
        ),
        "profiling the layers for schedule='auto'",
        options.timeout,
        options.store,
    )
    how = "time" if options.partition in ("uniform", "balanced") else options.partition  # the defaults: time it
    choices = [options.virtual_stages] if options.virtual_stages else _stages_per_rank(entry, options.partition, p)
    schedule, counts = _fastest(profile, p, m, choices, how, named)
    if groups.global_rank() == 0:
        log.info("stagewise: schedule='auto' chose %s", schedule.meta["auto"])
    return replace(options, schedule=schedule, partition=counts, microbatches=None, virtual_stages=None)


def _stages_per_rank(entry: str, partition: Any, p: int) -> list[int]:
    """The stages per rank ``auto`` compares: the count layer counts give (one per stage), else one and two."""
    if not isinstance(partition, (list, tuple)):
        return [1, 2]
    if len(partition) % p:
        raise ValueError(
            f"{entry}: schedule='auto' with partition={list(partition)}: {len(partition)} stages cannot be spread "
            f"evenly over {p} ranks; give {p} counts (one stage per rank) or {2 * p} (two, as zb-v)"
        )
    return [len(partition) // p]


def _fastest(profile: Any, p: int, m: int, choices: list[int], how: Any, named: Any) -> tuple[Any, list[int]]:
    """The faster (by the simulator) of the schedules synthesized for ``v`` stages per rank, each ``v`` in
    ``choices`` its layers cut ``how``, under 1F1B's memory; and its layer counts."""
    from ...simulation import simulate

    def cut(v: int) -> list[int]:
        return stage_counts(
            len(named), p * v, how, profile=profile, parameters=lambda: [parameter_count(x) for _, x in named]
        )

    def costs(counts: list[int]) -> Any:
        return profile.cost_model([sum(counts[:k]) for k in range(len(counts) + 1)])

    found = []
    for v in choices:
        if v > 1 and len(choices) > 1 and (p == 1 or len(named) < p * v):
            continue  # too few layers for v stages per rank
        counts = cut(v)
        model = costs(counts)
        schedule = _kept(model, p, m, v)
        found.append((simulate(schedule, model).makespan, v, schedule, counts))
    found.sort(key=lambda f: f[1])  # fewer stages per rank first: kept unless another is faster beyond the noise
    best = found[0]
    for f in found[1:]:
        if f[0] < best[0] * (1 - REGISTERED_MARGIN):
            best = f
    _, v, schedule, counts = best
    others = "; ".join(f"{w} per rank {ms:.3g} s" for ms, w, _, _ in found if w != v)
    why = f"{v} stage(s) per rank (layers {counts}), {best[0]:.3g} s simulated" + (f" (vs {others})" if others else "")
    schedule.meta["auto"] = f"{schedule.meta['auto']}; {why}"
    return schedule, counts


#: the registered schedule whose memory bounds each count of stages per rank when the default cap fits nothing
MEMORY_REFERENCE = {1: "1f1b", 2: "zb-v"}


def _kept(costs: Any, p: int, m: int, v: int) -> Any:
    """The schedule synthesized for ``costs`` with ``v`` stages per rank, or the registered baseline it started
    from (:data:`REGISTERED_MARGIN`), built complete with the synthesizer's report in its meta.

    The synthesizer's default cap, ``min(p, m)`` micro-batches, counts what W keeps as a share of each stage's
    activation bytes; on stages whose W keeps more than their activations (a lone Linear, whose input W needs is
    larger than what its forward saves) no order fits it, though the registered schedules run. Then the cap is
    the registered reference's own simulated peak in bytes (:data:`MEMORY_REFERENCE`), which that schedule fits,
    so ``auto`` always builds when a registered schedule does; ``meta["auto"]`` says so.
    """
    from ...synthesis import synthesize

    placement = "v" if v == 2 else None
    reference = MEMORY_REFERENCE.get(v, "interleaved-1f1b")
    try:
        schedule = synthesize(costs, p, m, virtual_stages=v, placement=placement)
        capped = ""
    except ValueError as err:
        if "fits no schedule" not in str(err):
            raise
        peak = _simulated(_registered(reference, p, m, v), costs).peak_activation_bytes
        capped = (
            f" (under {reference}'s simulated activation bytes per rank: the default cap of {min(p, m)} "
            "micro-batches fits no order on these stages, whose weight-gradient stash outweighs their activations)"
        )
        try:
            schedule = synthesize(costs, p, m, virtual_stages=v, placement=placement, memory_bytes=peak)
        except ValueError as again:
            if "fits no schedule" not in str(again):
                raise
            kept = _registered(reference, p, m, v)
            kept.meta["auto"] = (
                f"{reference} kept, as registered: the synthesizer's memory model fits no order on these stages "
                f"under {reference}'s own simulated activation bytes ({again})"
            )
            return kept
    report: Any = schedule.meta["synthesis"]
    base, base_ms, ms = report["baseline"], report["baseline_makespan"], report["makespan"]
    if base == "one-at-a-time" or ms < base_ms * (1 - REGISTERED_MARGIN):
        schedule.meta["auto"] = f"synthesized: {ms / base_ms - 1:+.1%} against {base} by the simulator{capped}"
        return schedule
    kept = _registered(base, p, m, v)
    kept.meta["synthesis"] = report
    kept.meta["auto"] = (
        f"{base} kept: the synthesized order was {ms / base_ms - 1:+.1%} against it by the simulator, "
        f"within the {REGISTERED_MARGIN:.0%} margin{capped}"
    )
    return kept


def _registered(name: str, p: int, m: int, v: int) -> Any:
    from ...passes.build import build_schedule

    return build_schedule(name, p, m, virtual_stages=v)


def _simulated(schedule: Any, costs: Any) -> Any:
    from ...simulation import simulate

    return simulate(schedule, costs)
