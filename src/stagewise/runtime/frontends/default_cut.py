"""The default cut of a layer list (``partition="balanced"``), decided on one rank and handed to the others.

Rank 0 of the pipeline's group prices the layers on one micro-batch (``sample_inputs``) and cuts
(:func:`stagewise.partition.modes.stage_counts`, refined for the schedule): where a layer holds a convolution
it **times** each layer's forward + backward, as ``partition="time"`` does (no count prices a convolution's
shape: :func:`stagewise.planning.defaults.pricing`); other layers' work it **counts** on the ``meta`` device
(:mod:`..measure.counting`: deterministic); without sample inputs it reads their parameter counts. The counts
per stage, and the profile they came from, reach every rank through :func:`.balance.on_first_rank`, so every
rank builds the same cut whatever its own timing or arithmetic would say. Without sample inputs a list holding
a convolution is cut evenly, and the first batch's first micro-batch is timed instead (:mod:`.first_batch`).
The cut is recorded where every
layout is (a checkpoint's and a snapshot's ``layout.pipeline.layers``, with ``layout.pipeline.partition``),
and a resume on the same layout takes it back rather than deciding again
(:mod:`stagewise.runtime.checkpoint.recorded_cut`). When the estimate predicts the schedule slower than 1F1B
on the same layers by more than
:data:`stagewise.planning.defaults.NOISE` (the link and the runtime's work per action priced by a rough
prior, :data:`stagewise.partition.estimate.LINKS`), rank 0 says so in one warning; without sample inputs, at
the first batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ...ir import Schedule
from ...partition import LayerProfile, stage_counts
from ...partition.estimate import CountedLayer, estimated_profile, link_for, parameters_as_work, rates_for
from ...planning.defaults import against_1f1b, pricing, refined_counts
from ..measure.counting import count_layers
from ..measure.profiling import steadiest
from .layer_timing import ROUNDS, profile_layers
from .layers import Layer, LayerLike
from .tied import Tied, TiedBuilder
from .ties import tied_layers

log = logging.getLogger(__name__)

#: the layers whose parameters are reused over their input's positions (work per parameter unknown unsized)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class DefaultCut:
    """Layer counts per stage; the estimated profile (None when cut by parameters); what decided."""

    counts: list[int]
    profile: LayerProfile | None
    source: str  # "timed", "counted", "parameters" (or "profiled": a measured profile's cut, for the warning)


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
    profile, source = priced(named, sample_inputs, seed=seed, device=device)
    if profile is None:
        profile = estimated_profile(_by_parameters(named), rates_for(device), loss_passes=0.0)
    counts = cut_by(profile, schedule, speeds)
    if source == "parameters":
        profile = None  # parameter counts are no times: nothing to predict from
    return DefaultCut(counts, profile, source)


def priced(
    named: Sequence[tuple[str, LayerLike]], sample_inputs: Any, *, seed: int, device: str
) -> tuple[LayerProfile | None, str]:
    """Each layer's cost on one micro-batch as the default prices it: timed where a layer holds a convolution,
    else counted on the ``meta`` device; (None, "parameters") without sample inputs or where neither works. Either
    profile records the layers that use one parameter (``tied``: :func:`.ties.tied_layers`), whose gradient sum
    across ranks :func:`warn_if_slower`'s estimate waits for."""
    if sample_inputs is None:
        return None, "parameters"
    if pricing(holds_convolution(named), True) == "timed":
        try:
            return timed_profile(named, sample_inputs, seed=seed, device=device), "timed"
        except Exception as err:  # a layer that cannot be timed alone: counted as dense layers are
            log.info("stagewise: timing the layers failed (%s); cutting by counted work", err)
    try:
        builder = TiedBuilder(named, seed, None)
        built: list[nn.Module] = []  # (on meta: kept for the finder of ties at no cost)

        def build(k: int) -> nn.Module:
            built.append(builder.build(named[k][1], k))
            return built[-1]

        counted = count_layers([n for n, _ in named], build, sample_inputs)
        return replace(estimated_profile(counted, rates_for(device)), tied=tied_layers(built)), "counted"
    except Exception as err:  # a layer that cannot run on meta: its parameters say what they can
        log.info("stagewise: counting the layers on the meta device failed (%s); cutting by parameters", err)
    return None, "parameters"


def cut_by(profile: LayerProfile, schedule: Schedule, speeds: Sequence[float] | None = None) -> list[int]:
    """The default's cut for ``profile``'s layers: the least slowest stage by their times on ``schedule``'s
    placement, then refined for the schedule itself (:func:`~stagewise.planning.defaults.refined_counts`);
    the even cut where no layer has a time."""
    times = profile.times()
    counts = stage_counts(
        len(times),
        schedule.num_stages,
        "balanced",
        times=times if any(times) else None,
        speeds=speeds,
        placement=schedule.placement,
    )
    if speeds is None and any(times):
        counts = refined_counts(profile, schedule, counts)
    return counts


def timed_profile(
    named: Sequence[tuple[str, LayerLike]], sample_inputs: Any, *, seed: int, device: str
) -> LayerProfile:
    """Each layer's forward + backward timed on one micro-batch, as ``partition="time"`` times it (the median
    of a layer's repeats, the fastest of :data:`.layer_timing.ROUNDS` rounds: one preempted timing does not decide).
    Called on the first rank only (its profile is what every rank cuts by)."""
    return steadiest(lambda: profile_layers(named, sample_inputs, seed=seed, device=device), ROUNDS)


def _by_parameters(named: Sequence[tuple[str, LayerLike]]) -> list[CountedLayer]:
    """Without sample inputs: each layer's work as if proportional to the parameters it multiplies with (a
    multiply-add per parameter and sample forward, two backward; :func:`multiplied_parameters`), what the default
    balances then; no work at all (the even cut) where a layer holds a convolution
    (:func:`~stagewise.partition.estimate.parameters_as_work`)."""
    built = [_on_meta(x) for _, x in named]
    positional = [_convolves(module) for module in built]
    work = parameters_as_work(multiplied_parameters(named, built), positional)
    if any(positional):
        first = named[positional.index(True)][0]
        log.info(
            "stagewise: cutting the layers evenly: %r holds a convolution, whose work per parameter depends on "
            "its input's size; the first batch's layers are timed and cut by (or pass sample_inputs=, one micro-batch)",
            first,
        )
    return [CountedLayer(n, 2 * w, 4 * w, 0.0, 0.0, 0, 0, w, 4 * w, 0.0) for (n, _), w in zip(named, work)]


#: the modules whose parameters are read by index, not multiplied: a look-up does no work per parameter
LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def multiplied_parameters(named: Sequence[tuple[str, LayerLike]], built: Sequence[nn.Module]) -> list[int]:
    """Per layer, the parameters its forward multiplies with: a table looked up (:data:`LOOKUPS`) counts none,
    a tied table used again through ``forward_fn`` (a language model's head, ``h @ table.T``) counts whole at
    that use, a tied module called again counts at every call as at its first. A parameter held by a look-up
    and a product both (a transformers model's tied head, when one unit holds both) counts once.

    Why: a large vocabulary's embedding holds as many parameters as the head but does a read per token, where
    the head does a multiply-add per parameter and token; counting the table as work gave the first rank of a
    transformers llama a layer too few (docs/benchmarks/defaults.md, 2026-12-04)."""
    first: dict[str, nn.Module] = {}
    out: list[int] = []
    for (_, layer), module in zip(named, built):
        if isinstance(layer, Tied):
            if layer.key not in first:
                first[layer.key] = module
            elif layer.forward_fn is not None:
                out.append(sum(p.numel() for p in first[layer.key].parameters()))
                continue
            else:
                module = first[layer.key]
        out.append(_multiplied(module))
    return out


def _multiplied(module: nn.Module) -> int:
    """The parameters of ``module`` held by a module other than a look-up (each once)."""
    multiplied = {id(p): p.numel() for sub in module.modules() if not isinstance(sub, LOOKUPS)
                  for p in sub.parameters(recurse=False)}  # fmt: skip
    return sum(multiplied.values())


def holds_convolution(named: Sequence[tuple[str, LayerLike]]) -> bool:
    """Whether a layer holds a convolution: then, without sample inputs, the cut waits for the first batch
    (:mod:`.first_batch`)."""
    return any(_convolves(_on_meta(x)) for _, x in named)


def _convolves(module: nn.Module) -> bool:
    return any(isinstance(m, CONVOLUTIONS) for m in module.modules())


def _on_meta(layer: LayerLike) -> nn.Module:
    """A spec built on the meta device (no memory); a built module as it is."""
    if isinstance(layer, Layer):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return layer.build()
    return layer


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


#: the warnings this process has given: a process that builds the same pipeline again (a benchmark's turns, an
#: elastic job's regenerations) is told once
_SAID: set[str] = set()


def warn_if_slower(schedule: Schedule, cut: DefaultCut, rank: int, device: str = "cpu") -> None:
    """Rank 0: one warning when the estimate predicts ``schedule`` slower than 1F1B beyond the noise (once
    per process for the same schedule, cut and figures), the transfers priced by the ``device``'s rough link
    (:data:`~stagewise.partition.estimate.LINKS`: a V's extra messages count)."""
    if rank != 0 or cut.profile is None:
        return
    link = link_for(device)
    try:
        verdict = against_1f1b(
            cut.profile,
            schedule,
            cut.counts,
            latency=link.latency,
            bandwidth=link.bandwidth,
            per_action=link.per_action,
        )
    except ValueError as err:  # a schedule the plain simulator cannot time: nothing to say
        log.debug("stagewise: no prediction against 1F1B (%s)", err)
        return
    if verdict is not None and verdict.slower and verdict.line() not in _SAID:
        _SAID.add(verdict.line())
        log.warning("%s", verdict.line())
