"""One plan on every rank: :func:`stagewise.plan` inside a job, and the check ``Pipeline.from_plan`` makes.

Ranks that build pipelines from different plans make different process groups and wait for messages that
never come: they hang until the pipeline's deadline, then blame a peer for a failed gather. Plans differ
when each rank plans from its own measurements (``sw.profile`` on each rank times the layers a little
differently; a memory cap read from the rank's device), so two guards:

* :func:`search_together`: inside a torch.distributed job of several processes, :func:`stagewise.plan`
  is a collective: global rank 0's inputs (the profile, every option, the calibration) go to every rank,
  and every rank runs the same search on them (deterministic: pure Python on the same numbers), then the
  ranks compare what they found. The pure planner hands over to it when torch.distributed is initialised
  with more than one process (:func:`stagewise.planning.plan`); ``stagewise.planning.search`` stays a
  plan on this process alone.
* :func:`check_same_plan`: ``Pipeline.from_plan`` gathers every rank's :meth:`~stagewise.Plan.digest`
  before any process group is made and, within the pipeline's ``timeout``, every rank refuses a mismatch
  with the same error, naming which ranks hold which plan.

Everything that crosses ranks is plain JSON (:mod:`..comm.collectives`), never a pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...partition import LayerProfile
from ...planning import Calibration, Link, Plan, PlanSearch, search
from ..comm import collectives, groups
from ..comm.faults.guard import setup_guard
from ..errors import PipelineError

#: seconds every rank may take to reach :func:`stagewise.plan` (the first to arrive waits for the last)
TIMEOUT = 300.0

_COLLECTIVE = (
    "every rank's call of stagewise.plan (inside a torch.distributed job it is a collective: call it on every "
    "rank, or stagewise.planning.search to plan on one process alone)"
)


def search_together(
    profile: LayerProfile, processes: int, *, group: Any = None, timeout: float = TIMEOUT, **options: Any
) -> PlanSearch:
    """:func:`stagewise.planning.search` on the inputs of ``group``'s first rank, the same result on every rank.

    A collective over ``group`` (None: the world), each wait bounded by ``timeout`` seconds. Raises
    :class:`~stagewise.PipelineError` if the ranks' results still differ (they cannot on one machine; a
    cluster of different CPUs could round differently).
    """
    waits = setup_guard(timeout)
    try:
        mine = {"profile": profile.to_json(), "processes": processes, "options": _plain(options)}
        first = collectives.gather_json(mine if groups.group_rank(group) == 0 else None, group, waits.wait, _COLLECTIVE)
        sent = first[0]
        found = search(LayerProfile.from_json(sent["profile"]), sent["processes"], **_unplain(sent["options"]))
        digests = [p.digest() for p in found.plans]
        everyone = collectives.gather_json(digests, group, waits.wait, "every rank's plans (stagewise.plan)")
    finally:
        waits.close()
    differ = [r for r, theirs in enumerate(everyone) if theirs != digests]
    if differ:
        raise PipelineError(
            f"stagewise.plan: ranks {differ} found other plans than rank {groups.group_rank(group)} from the same "
            "inputs (the search rounded differently there); plan on one rank and send the plan to the others"
        )
    return found


def check_same_plan(plan: Plan, entry: str, timeout: float, store: Any = None, group: Any = None) -> None:
    """Every rank of the pipeline's ``group`` (None: the world) holds a plan with the same
    :meth:`~stagewise.Plan.digest`, or every rank raises the same ``ValueError`` naming the ranks and the plans
    they hold (a collective, bounded by ``timeout``). The group, not the world: a re-layout onto fewer processes
    (``pipe.relayout(members, plan=...)``) builds on its members only, and the retiring ranks never come."""
    groups.require_initialized()
    if groups.group_size(groups.group_or_world(group)) == 1:
        return
    waits = setup_guard(timeout, store)
    try:
        held = collectives.gather_json(
            [plan.digest(), plan.describe()], group, waits.wait, f"every rank's plan digest ({entry})"
        )
    finally:
        waits.close()
    if len({digest for digest, _ in held}) > 1:
        raise ValueError(f"{entry}: the ranks hold different plans: {_who_holds(held)}. {_ADVICE}")


_ADVICE = (
    "Ranks built from different plans would wait on each other until the deadline. Plan with stagewise.plan on "
    "every rank (inside a job it plans on rank 0's inputs and gives every rank the same plans), or plan once and "
    "pass every rank the same Plan"
)


def _who_holds(held: Sequence[Sequence[str]]) -> str:
    """``ranks 0, 2: pp=2 ... (digest 1a2b...); rank 1: ...``, the largest group first."""
    by_digest: dict[str, list[int]] = {}
    names: dict[str, str] = {}
    for rank, (digest, name) in enumerate(held):
        by_digest.setdefault(digest, []).append(rank)
        names[digest] = name
    parts = []
    for digest, ranks in sorted(by_digest.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        parts.append(f"{who}: {names[digest]} (digest {digest})")
    return "; ".join(parts)


def _plain(value: Any) -> Any:
    """The planner's options as JSON-able data (links and calibrations tagged, sequences as lists)."""
    if isinstance(value, Link):
        return {"__link__": [value.latency, value.bandwidth]}
    if isinstance(value, Calibration):
        return {"__calibration__": value.to_dict()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(x) for x in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"stagewise.plan: an option value of type {type(value).__name__} cannot be sent to the other ranks")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if "__link__" in value:
            latency, bandwidth = value["__link__"]
            return Link(latency, bandwidth)
        if "__calibration__" in value:
            return Calibration.from_dict(value["__calibration__"])
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(x) for x in value]
    return value
