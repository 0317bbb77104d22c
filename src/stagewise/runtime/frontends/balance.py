"""Balancing stages from measurements: profile once, on one rank, so every rank cuts the model alike.

Every rank must hold the same partition, but timings differ from run to run
and rank to rank. So the first rank of the group measures (one layer at a
time, so a list of :class:`~stagewise.Layer` specs is never built whole) and
sends its :class:`~stagewise.LayerProfile` to the others; each rank then cuts
the same numbers the same way (:func:`stagewise.partition.modes.stage_counts`).

On a shared machine a measurement is only ever slowed down (the process is
preempted, never sped up), so the profile is taken :data:`ROUNDS` times and
each layer keeps its fastest round (:func:`steadiest`).

Heterogeneous ranks (HetPipe's setting: Park et al., *HetPipe*, USENIX ATC
2020) are described per rank: ``speeds[r]`` (relative; a rank at 0.5 gets
about half the work) and ``memory_caps[r]`` (bytes). A rank holding ``v``
stages gives each the rank's speed and ``1/v`` of its cap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ...ir import Kind, Schedule
from ...partition import PartitionSpec, check_options, counts_to_ranges, needs_profile, stages_per_rank_note
from ...partition.modes import DEFAULT
from ..comm import collectives, groups
from ..comm.faults.guard import setup_guard
from ..errors import PipelineError
from ..measure.profiling import LayerProfile, steadiest
from .layer_timing import ROUNDS as ROUNDS  # re-exported: partition="time"'s callers import them here
from .layer_timing import profile_layers as profile_layers
from .layer_timing import with_loss_bytes
from .layers import LayerLike
from .layers import partition as partition_layers

T = TypeVar("T")


@dataclass(frozen=True)
class LayerPlan:
    """Which layers each stage holds, and the profile the choice was made from (None if none was needed)."""

    ranges: list[range]
    profile: LayerProfile | None


def per_stage(
    schedule: Schedule, speeds: Sequence[float] | None, memory_caps: Sequence[float] | None
) -> tuple[list[float] | None, list[float] | None]:
    """Per-rank speeds and memory caps as per-stage values (a rank's cap is shared by its stages)."""
    p = schedule.num_ranks
    for what, values in (("speeds", speeds), ("memory_caps", memory_caps)):
        if values is not None and len(values) != p:
            raise ValueError(f"{what} has {len(values)} entries, expected one per rank ({p})")
        if values is not None and not all(float(x) > 0 for x in values):
            raise ValueError(f"{what} must be > 0, got {list(values)}")
    held = [len(schedule.stages_of(r)) for r in range(p)]
    stage_speeds = None if speeds is None else [float(speeds[r]) for r in schedule.placement]
    caps = None if memory_caps is None else [float(memory_caps[r]) / held[r] for r in schedule.placement]
    return stage_speeds, caps


def in_flight(schedule: Schedule) -> int:
    """The most micro-batches whose activations one stage holds at once (forwards not yet backwarded)."""
    peak = 1
    for actions in schedule.ranks:
        held: dict[int, int] = {}
        for a in actions:
            if a.kind is Kind.F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak = max(peak, held[a.stage])
            elif a.kind in (Kind.B, Kind.W):
                held[a.stage] = held.get(a.stage, 0) - 1
    return peak


def on_first_rank(group: Any, fn: Callable[[], T], what: str, timeout: float = 300.0, store: Any = None) -> T:
    """``fn()`` computed on the group's first rank and handed to every rank (a collective).

    If it fails there, every rank raises: the first its own error, the others a
    :class:`PipelineError` that quotes it, so no rank waits for a value that never comes. Each rank waits at
    most ``timeout`` seconds for the hand-over (the others: ``fn`` included) and stops at any failure posted
    on the run's board (``store``: the c10d store, None for the default group's), as a pipeline's own waits
    do: a rank that dies or stops meanwhile is named, not waited for.
    """
    waits = setup_guard(timeout, store)
    try:
        if groups.group_rank(group) == 0:
            try:
                value = fn()
            except Exception as err:
                collectives.gather_json(["error", f"{type(err).__name__}: {err}"], group, waits.wait, what)
                raise
            collectives.gather_json(["ok", _plain(value)], group, waits.wait, what)
            return value
        status, value = collectives.gather_json(None, group, waits.wait, f"the result of {what} from rank 0")[0]
    finally:
        waits.close()
    if status == "error":
        raise PipelineError(f"rank 0 of the pipeline group failed while {what}: {value}")
    return _unplain(value)


def _plain(value: Any) -> Any:
    """A profile as JSON-able data (what crosses ranks is plain data, never a pickle)."""
    if isinstance(value, LayerProfile):
        return {"profile": value.to_json()}
    return {"value": value}


def _unplain(data: Any) -> Any:
    if "profile" in data:
        return LayerProfile.from_json(data["profile"])
    return data["value"]


def plan_layers(
    named: Sequence[tuple[str, LayerLike]],
    schedule: Schedule,
    how: PartitionSpec,
    *,
    group: Any,
    device: torch.device,
    seed: int,
    sample_inputs: Any = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    timeout: float = 300.0,
    store: Any = None,
    has_loss: bool = False,
    measure_loss: Callable[[Any], float | None] | None = None,
) -> LayerPlan:
    """The layer ranges of each stage; ``"time"`` / ``"memory"`` profile ``sample_inputs`` (one micro-batch) first
    (``has_loss``: the pipeline trains with a loss, whose kept bytes the profile measures with ``measure_loss``
    where given, else estimates: :func:`with_loss_bytes`). ``group``: the ranks that must cut alike (a collective
    over it when a profile is needed; None is the world, as for the pipelines of a mesh), within ``timeout``
    seconds (see :func:`on_first_rank`).
    """
    stage_speeds, caps = per_stage(schedule, speeds, memory_caps)
    # every rank checks what it can before the collective, so a bad argument fails everywhere alike
    why = stages_per_rank_note(schedule.name, schedule.num_ranks, schedule.virtual_stages)
    check_options(len(named), schedule.num_stages, how, stage_speeds, caps, why=why)
    measured = None
    if how == DEFAULT and memory_caps is None:
        return _default_plan(named, schedule, group, device, seed, sample_inputs, stage_speeds, timeout, store)
    if needs_profile(how, memory_caps):
        if sample_inputs is None:
            why = "memory_caps= measure" if memory_caps is not None and how in ("balanced", DEFAULT) else (
                f"partition={how!r} profiles"
            )  # fmt: skip
            raise ValueError(f"{why} the layers: pass sample_inputs= (one micro-batch of inputs)")
        measured = on_first_rank(
            group,
            lambda: with_loss_bytes(steadiest(lambda: profile_layers(named, sample_inputs, seed=seed, device=device,
                                                                     measure_loss=measure_loss), ROUNDS), has_loss),
            "profiling the layers", timeout, store,
        )  # fmt: skip
    with caps_explained(schedule, memory_caps):
        ranges = partition_layers(
            named,
            schedule.num_stages,
            how,
            profile=measured,
            speeds=stage_speeds,
            memory_caps=caps,
            in_flight=in_flight(schedule),
        )
    if measured is not None:  # a measured profile predicts too: the same word as the default cut's
        from . import default_cut

        cut = default_cut.DefaultCut([len(r) for r in ranges], measured, "profiled")
        default_cut.warn_if_slower(schedule, cut, groups.group_rank(group), device.type)
    return LayerPlan(ranges, measured)


def _default_plan(
    named: Sequence[tuple[str, LayerLike]],
    schedule: Schedule,
    group: Any,
    device: torch.device,
    seed: int,
    sample_inputs: Any,
    stage_speeds: Sequence[float] | None,
    timeout: float,
    store: Any,
) -> LayerPlan:
    """``partition="balanced"``: rank 0 decides (:mod:`.default_cut`), every rank builds its cut."""
    from . import default_cut

    def decided() -> dict[str, Any]:
        cut = default_cut.decide(
            named, schedule, sample_inputs=sample_inputs, speeds=stage_speeds, seed=seed, device=device.type
        )
        return default_cut.plain(cut)

    cut = default_cut.unplain(
        on_first_rank(group, decided, "cutting the layers (partition='balanced')", timeout, store)
    )
    default_cut.warn_if_slower(schedule, cut, groups.group_rank(group), device.type)
    return LayerPlan(counts_to_ranges(cut.counts), None)


@contextmanager
def caps_explained(schedule: Schedule, memory_caps: Sequence[float] | None) -> Iterator[None]:
    """Say how per-rank caps became the per-stage caps an infeasible partition names."""
    try:
        yield
    except ValueError as err:
        if memory_caps is None or schedule.virtual_stages == 1:
            raise
        raise ValueError(
            f"{err} (memory_caps={list(memory_caps)} per rank, each shared evenly by the rank's "
            f"{schedule.virtual_stages} stages)"
        ) from err
