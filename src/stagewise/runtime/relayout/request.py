"""What a re-layout is asked for, checked alike on every process before any group is made or any tensor moves.

The request (the members, the changed options, a plan) is reduced to a digest; every process sends its digest,
its pipeline's progress and what it refuses locally in one small exchange, and every process raises the same
error, naming each process's reason, when any digest differs or any process refuses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

from ...partition import needs_profile
from ..checkpoint.declared import Progress
from ..frontends.given import GivenStages
from ..frontends.layer_list import LayerList
from ..frontends.parts import Frontend
from ..frontends.plan import FromPlan
from ..options import Options

#: options a re-layout may change: the layout (what runs, where, how it is cut); the rest is the model's own
LAYOUT_OPTIONS = frozenset(
    {"schedule", "microbatches", "virtual_stages", "stages", "parallel", "partition", "speeds", "memory_caps"}
)
#: what a pipeline given its stages (``from_stages``) may change: never where the stages are
SAME_PLACEMENT = frozenset({"schedule", "microbatches"})


def members_of(members: Sequence[int] | None, world: int) -> tuple[int, ...]:
    """The global ranks that will hold the pipeline (None: the whole world), sorted; checked."""
    if members is None:
        return tuple(range(world))
    chosen = tuple(sorted(set(int(m) for m in members)))
    if not chosen or any(m < 0 or m >= world for m in chosen) or len(chosen) != len(members):
        raise ValueError(
            f"relayout: members must be distinct global ranks 0 to {world - 1} (at least one), got {list(members)}"
        )
    return chosen


def subgroups_ahead(members: tuple[int, ...], world: int, most: int = 4) -> list[tuple[int, ...]]:
    """The groups a pipeline on ``members`` may make for its tied modules, made ahead by the whole world (gloo
    cannot make them by their members alone then): every set of two or more members up to ``most`` members,
    else the members together; none when the members are the world (the pipeline makes them with every rank)."""
    if len(members) == world:
        return []
    if len(members) > most:
        return [members]
    return [c for k in range(2, len(members) + 1) for c in combinations(members, k)]


def digest(members: tuple[int, ...], changes: Mapping[str, Any], plan: Any) -> str:
    """The request's hash: processes that disagree on it refuse alike (``repr`` of each value, in name order)."""
    text = repr((members, sorted((k, repr(v)) for k, v in changes.items()), repr(plan)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def local_refusals(
    frontend: Frontend | None, options: Options | None, progress: Progress | None, changes: Mapping[str, Any]
) -> list[str]:
    """Why this process cannot take part (its pipeline's state, or a change its way in cannot make)."""
    allowed = ", ".join(sorted(LAYOUT_OPTIONS))
    out = [f"{k}= is not a layout option (relayout changes {allowed})" for k in changes if k not in LAYOUT_OPTIONS]
    if progress is not None and progress.merged_steps:
        out.append(
            f"it is inside a gradient merge ({progress.merged_steps} train steps under no_sync() not yet reduced): "
            "re-layout after the train_step that ends it"
        )
    if frontend is None or options is None:
        return out
    if isinstance(frontend, GivenStages):
        moved = sorted(k for k in changes if k not in SAME_PLACEMENT)
        if moved:
            out.append(
                f"a pipeline of given stages (from_stages) keeps its placement: {', '.join(moved)} cannot change "
                "(a new schedule or micro-batch count is fine)"
            )
    elif isinstance(frontend, FromPlan) and set(changes) & set(frontend.plan.pipeline_options()):
        clash = ", ".join(f"{k}=" for k in sorted(set(changes) & set(frontend.plan.pipeline_options())))
        out.append(f"{clash} set by the plan of this pipeline (from_plan): pass relayout(plan=...) instead")
    elif not isinstance(frontend, (LayerList, FromPlan)) and options.free_unused:
        how = changes.get("partition", options.partition)
        if needs_profile(how, changes.get("memory_caps", options.memory_caps)):
            out.append(
                f"partition={how!r} profiles the model, whose other ranks' parts {frontend.entry} freed "
                "(free_unused=True): give partition= as counts or 'parameters', or build it with free_unused=False"
            )
    return out + parallel_refusals(changes.get("parallel", options.parallel))


def parallel_refusals(hybrid: Any) -> list[str]:
    """What a re-layout cannot move to: a built Mesh, tensor parallelism or sharding (``parallel=``, a plan's
    layout)."""
    if hybrid is not None and not hasattr(hybrid, "pp"):
        return ["parallel= must be a ParallelConfig for a re-layout (a built Mesh holds the old groups)"]
    if hybrid is not None and (hybrid.tp > 1 or hybrid.sharding > 1):
        return ["tensor parallelism and sharding are not re-laid out yet: their tensors are DTensor shards"]
    return []


def plan_refusals(plan: Any) -> list[str]:
    """``relayout(plan=)``: the plan's layout meets ``parallel=``'s refusals, before anything changes (a plan of
    ``sw.plan`` often shards: found half-way through the move before, as a DTensor copy's error)."""
    if plan is None:
        return []
    c = plan.layout
    return [f"plan= (pp {c.pp}, dp {c.dp}, tp {c.tp}, sharding {c.sharding}): {why}" for why in parallel_refusals(c)]


def placement_refusals(
    frontend: Frontend | None, before: tuple[int, ...] | None, members: tuple[int, ...]
) -> list[str]:
    """A pipeline of given stages keeps its placement: the user placed each stage on a process, so fewer or more
    processes (or others) would put stages the user built on processes that do not hold them."""
    if not isinstance(frontend, GivenStages) or before is None or tuple(before) == tuple(members):
        return []
    return [
        f"a pipeline of given stages (from_stages) keeps its placement: its processes {list(before)} cannot become "
        f"{list(members)} (a new schedule or micro-batch count on the same processes is fine)"
    ]


def refuse_alike(everyone: list[dict[str, Any]]) -> None:
    """Raise one ``ValueError`` naming every process's reason (the same on every process), or return."""
    digests = {e["digest"] for e in everyone}
    lines = []
    if len(digests) > 1:
        asked: dict[str, list[int]] = {}
        for r, e in enumerate(everyone):
            asked.setdefault(e["digest"], []).append(r)
        lines.append(
            "the processes asked for different re-layouts (call relayout with the same members and options "
            "everywhere): " + "; ".join(f"processes {rs} asked {d}" for d, rs in asked.items())
        )
    for r, e in enumerate(everyone):
        lines += [f"process {r}: {why}" for why in e["refused"]]
    if lines:
        raise ValueError("relayout refused, before anything changed:\n  " + "\n  ".join(lines))
