"""The synthesizer: the best hand-written schedule that fits, improved by greedy play-outs and local moves.

    costs, p, m, v, caps --> per set of stages run whole (fusion.py):
                               hand-written orders that fit  --+
                               greedy play-outs (policies)   --+--> best set's best few --> local moves --+
                         --> lower bound (bound.py)  ---------------------------------------> reported    |
                             I, W pairs fused into B where the step is no longer, lower, validate  <------+

Deterministic: the search is bounded by a count of evaluations, never by the clock, so every rank that
synthesizes from the same inputs gets the same schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .._util import gc_paused
from ..ir import Kind, Schedule
from ..passes import lower
from ..simulation import CostModel, simulate
from .bound import Bound, bound_of
from .exact import available as exact_available
from .exact import exact_orders
from .fusion import FLIPS, could_run_whole, fuse_pairs, stage_sets, whole_stages
from .greedy import list_schedule
from .improve import improve
from .orders import Instance, Orders, from_schedule, peak, to_actions
from .problem import Problem, make_problem, with_fused
from .starts import fitting, one_at_a_time, policies, registered


@dataclass(frozen=True)
class Synthesis:
    """What a synthesis found, beside the schedule (also in ``schedule.meta["synthesis"]`` as a dict).

    ``baseline``: the fastest registered schedule that fits the caps, run as registered (1F1B with its B, timed
    at B's cost); ``hand_written``: every one that fits, and, for those that run B, the same order with each
    backward split (``"1f1b, split"``: a different schedule, under its own name). ``whole_stages``: the stages
    whose every backward the synthesized schedule runs whole; ``b_actions``: its B actions in all (those
    stages', and single micro-batches' elsewhere; see :mod:`.fusion`).
    """

    makespan: float
    lower_bound: float
    bound_reason: str
    baseline: str  # the best hand-written schedule that fits the caps ("one-at-a-time" when none does)
    baseline_makespan: float
    evaluations: int
    peaks: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per memory unit, per rank
    hand_written: dict[str, float] = field(default_factory=dict)
    whole_stages: tuple[int, ...] = ()
    b_actions: int = 0

    @property
    def gap(self) -> float:
        """How far above the lower bound the makespan is (0.02 = 2 %)."""
        return self.makespan / self.lower_bound - 1 if self.lower_bound > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "bound_reason": self.bound_reason,
            "gap": self.gap,
            "baseline": self.baseline,
            "baseline_makespan": self.baseline_makespan,
            "evaluations": self.evaluations,
            "peaks": {k: list(v) for k, v in self.peaks.items()},
            "hand_written": dict(self.hand_written),
            "whole_stages": list(self.whole_stages),
            "b_actions": self.b_actions,
        }


def default_effort(problem: Problem) -> int:
    """Evaluations of the local search: more for small problems, fewer per action for large ones."""
    actions = 3 * problem.num_stages * problem.microbatches
    return max(200, min(4000, 2_000_000 // max(actions, 1)))


def synthesize(
    costs: CostModel | Sequence[Sequence[float]],
    num_ranks: int,
    microbatches: int,
    *,
    memory: float | Sequence[float] | None = None,
    memory_bytes: float | Sequence[float] | None = None,
    virtual_stages: int = 1,
    placement: str | None = None,
    effort: int | None = None,
    exact: float = 0.0,
    name: str = "auto",
) -> Schedule:
    """The fastest schedule found for ``costs`` on ``num_ranks`` ranks, lowered and validated.

    ``costs``: a :class:`~stagewise.simulation.CostModel` with ``num_ranks * virtual_stages`` stages (from
    ``LayerProfile.cost_model`` or written by hand), or one ``(forward, backward_input, backward_weight)``
    per stage. ``memory``: activation cap per rank in micro-batches (one number for all ranks, or one per
    rank; a stage's activations count 1/v, the part W keeps counts its share of the stage's bytes);
    ``memory_bytes``: the same cap in bytes (the simulator's ``peak_activation_bytes``). Neither given:
    1F1B's peak, min(p, m) micro-batches. ``placement``: ``"loop"`` or ``"v"`` (default: V for v = 2,
    else loop). ``effort``: evaluations of the local search (deterministic; default by size; 0: none, the
    constructive orders' best). ``exact``: a
    budget, in CP-SAT's deterministic seconds, for the exact model (:mod:`.exact`; needs OR-Tools, the
    ``exact`` extra; for small problems: a few hundred actions), seeded with the best order found.

    The result is a complete schedule (F, I / W or B, SYNC, sends and receives) whose simulated makespan
    is never above the best registered schedule that fits the same caps; ``schedule.meta["synthesis"]``
    reports its makespan, the lower bound (:func:`stagewise.synthesis.lower_bound`) and that baseline.
    Raises ``ValueError`` naming the stage for costs of the wrong shape, and the smallest cap that works
    for a cap nothing fits.
    """
    if effort is not None and (isinstance(effort, bool) or not isinstance(effort, int) or effort < 0):
        raise ValueError(f"synthesize: effort (evaluations of the local search) must be an int >= 0, got {effort!r}")
    problem = make_problem(
        costs,
        num_ranks,
        microbatches,
        memory=memory,
        memory_bytes=memory_bytes,
        virtual_stages=virtual_stages,
        placement=placement,
    )
    with gc_paused():
        sub, orders, report = search(problem, default_effort(problem) if effort is None else effort, exact)
        return finish(sub, orders, report, name)


def search(problem: Problem, effort: int, exact: float = 0.0) -> tuple[Problem, Orders, Synthesis]:
    """The problem with the chosen stages run whole, the best orders found for it, and the report (peaks are
    filled in by :func:`finish`). Each stage set of :func:`.fusion.stage_sets` is played out, then single stages
    flipped while that helps; the best set's orders are improved by local moves (and the exact model, if asked)."""
    bound = bound_of(problem)
    hand = _Registered(problem)
    explored: dict[frozenset[int], tuple[list[tuple[float, Orders]], int]] = {}

    def best_of(stages: frozenset[int]) -> float:
        if stages not in explored:
            explored[stages] = played_out(with_fused(problem, stages), hand, bound)
        return explored[stages][0][0][0]

    for stages in stage_sets(problem.costs, hand.whole):
        if bound_reached(best_of(stages), bound):
            break
    chosen = min(explored, key=lambda k: (best_of(k), sorted(k)))
    flips = could_run_whole(problem.costs)
    if 1 < len(flips) <= FLIPS and not bound_reached(best_of(chosen), bound):
        chosen, found, walks = flipped(problem, chosen, explored[chosen][0][:3], flips)
        if chosen not in explored:  # a new set: its own play-outs, beside the orders the flips found
            pool, used = played_out(with_fused(problem, chosen), hand, bound)
            explored[chosen] = sorted(pool + found, key=lambda x: x[0]), used + walks
        else:
            explored[chosen] = explored[chosen][0], explored[chosen][1] + walks
    sub = with_fused(problem, chosen)
    pool = explored[chosen][0]
    evaluations = sum(used for _, used in explored.values())
    best_ms, best = pool[0]
    inst = Instance(sub)
    if effort > 0 and not bound_reached(best_ms, bound):  # (0: the play-outs' best, no local search)
        best, best_ms, used = improve(inst, [o for _, o in pool[:3]], effort, bound.value)
        evaluations += used
    if exact > 0 and not bound_reached(best_ms, bound):
        best, best_ms = solve_exactly(inst, best, best_ms, exact)
    report = Synthesis(
        best_ms, bound.value, bound.why, hand.name, hand.makespan, evaluations, hand_written=dict(hand.times)
    )
    return sub, best, report


def flipped(
    problem: Problem, chosen: frozenset[int], best: list[tuple[float, Orders]], flips: Sequence[int]
) -> tuple[frozenset[int], list[tuple[float, Orders]], int]:
    """One pass over ``flips``: each stage in turn run whole if it was split, or split if it was whole, kept when
    the best orders so far, timed again under the new set (and fitting its caps), get shorter. Returns the set,
    the orders that made each kept flip pay, and the walks spent (cheap: a few timings per stage)."""
    current = best[0][0]
    found: list[tuple[float, Orders]] = []
    walks = 0
    for s in flips:
        trial = chosen ^ {s}
        sub = with_fused(problem, trial)
        inst = Instance(sub)
        for _, orders in best:
            walks += 1
            ms = inst.makespan(orders) if fitting(sub, orders) else None
            if ms is not None and ms < current * (1 - 1e-12):
                chosen, current = trial, ms
                found = [(ms, orders)]
        if chosen == trial:
            best = found + best[:2]
    return chosen, found, walks


def played_out(sub: Problem, hand: _Registered, bound: Bound) -> tuple[list[tuple[float, Orders]], int]:
    """The starting orders for one stage set, best first: the best registered order that fits (else one at a
    time), then every greedy play-out that fits; and the play-outs spent."""
    inst = Instance(sub)
    base_orders = one_at_a_time(sub)
    base_ms = inst.makespan(base_orders)
    assert base_ms is not None  # one micro-batch at a time always finishes
    for orders in hand.orders:
        if fitting(sub, orders):
            ms = inst.makespan(orders)
            if ms is not None and ms < base_ms:
                base_ms, base_orders = ms, orders
    pool = [(base_ms, base_orders)]
    evaluations = 0
    for pol in policies(inst):
        played = list_schedule(inst, pol)
        evaluations += 1
        if played is None or not fitting(sub, played):
            continue
        ms = inst.makespan(played)
        if ms is not None:
            pool.append((ms, played))
            if bound_reached(ms, bound):
                break
    pool.sort(key=lambda x: x[0])
    return pool, evaluations


class _Registered:
    """The registered schedules on the problem's placement: each one's orders; the fastest that fits the caps as
    registered (its B timed as B, :func:`stagewise.simulate`), and the time of every one that fits (and of its
    split variant, for those that run B)."""

    def __init__(self, problem: Problem) -> None:
        self.orders: list[Orders] = []
        self.times: dict[str, float] = {}
        self.name, self.whole = "one-at-a-time", frozenset[int]()
        alone = Instance(problem).makespan(one_at_a_time(problem))
        assert alone is not None  # one micro-batch at a time always finishes
        self.makespan = alone
        m = problem.microbatches
        for name, schedule in registered(problem):
            orders = from_schedule(schedule, m)
            self.orders.append(orders)
            whole = whole_stages(schedule)
            if fitting(with_fused(problem, whole), orders):
                ms = simulate(schedule, problem.costs).makespan
                self.times[name] = ms
                if ms < self.makespan:
                    self.name, self.makespan, self.whole = name, ms, whole
            if whole and fitting(problem, orders):
                split = Instance(problem).makespan(orders)
                if split is not None:
                    self.times[f"{name}, split"] = split


def solve_exactly(inst: Instance, best: Orders, best_ms: float, budget: float) -> tuple[Orders, float]:
    """CP-SAT's orders when they fit and are faster in the real costs; else the ones given."""
    if not exact_available():
        raise ImportError("synthesize(exact=...) needs OR-Tools: pip install 'stagewise[exact]'")
    got = exact_orders(inst, best, budget)
    if got is not None and fitting(inst.problem, got):
        ms = inst.makespan(got)
        if ms is not None and ms < best_ms:
            return got, ms
    return best, best_ms


def bound_reached(makespan: float | None, bound: Bound) -> bool:
    return makespan is not None and makespan <= bound.value * (1 + 1e-12)


def finish(problem: Problem, orders: Orders, report: Synthesis, name: str) -> Schedule:
    """Write the whole stages' backwards as B, fuse each I directly followed by its own W into a B where that does
    not lengthen the step (:func:`.fusion.fuse_pairs`), lower, validate, report."""
    inst = Instance(problem)
    target = inst.makespan(orders)
    assert target is not None
    fuse = fuse_pairs(inst, orders, target)
    fused = _compute_schedule(problem, orders, name, fuse)
    complete = lower(fused)  # validates: the validator's guarantee holds for every result
    sim = simulate(complete, problem.costs)
    peaks = {lim.unit: tuple(_peaks(problem, orders, k)) for k, lim in enumerate(problem.limits)}
    final = replace(
        report,
        makespan=sim.makespan,
        peaks=peaks,
        whole_stages=tuple(sorted(problem.fused)),
        b_actions=sum(1 for acts in fused.ranks for a in acts if a.kind is Kind.B),
    )
    complete.meta["synthesis"] = final.to_dict()
    complete.meta["placement"] = problem.placement_kind
    return complete


def _compute_schedule(problem: Problem, orders: Orders, name: str, fuse: frozenset[int]) -> Schedule:
    ranks = to_actions(orders, problem.microbatches, fuse, problem.fused)
    return Schedule(name, problem.microbatches, problem.placement, tuple(tuple(r) for r in ranks))


def _peaks(problem: Problem, orders: Orders, k: int) -> list[float]:
    return [peak(acts, problem.limits[k], problem.microbatches) for acts in orders]


def report_of(schedule: Schedule) -> Synthesis:
    """The :class:`Synthesis` report a synthesized schedule carries."""
    data = schedule.meta.get("synthesis")
    if not isinstance(data, dict):
        raise ValueError(f"schedule {schedule.name!r} was not synthesized (no meta['synthesis'])")
    peaks = {str(k): tuple(v) for k, v in data["peaks"].items()}
    return Synthesis(
        float(data["makespan"]),
        float(data["lower_bound"]),
        str(data["bound_reason"]),
        str(data["baseline"]),
        float(data["baseline_makespan"]),
        int(data["evaluations"]),
        peaks,
        {str(k): float(v) for k, v in data.get("hand_written", {}).items()},
        tuple(int(s) for s in data.get("whole_stages", ())),
        int(data.get("b_actions", 0)),
    )
