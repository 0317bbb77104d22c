"""The synthesizer: the best hand-written schedule that fits, improved by greedy play-outs and local moves.

    costs, p, m, v, caps --> hand-written orders that fit  --+
                         --> greedy play-outs (policies)    --+--> best few --> local moves --> lower, validate
                         --> lower bound (bound.py)  ------------------------------------------> reported

Deterministic: the search is bounded by a count of evaluations, never by the clock, so every rank that
synthesizes from the same inputs gets the same schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._util import gc_paused
from ..ir import Schedule
from ..passes import lower
from ..simulation import CostModel, simulate
from .bound import Bound, bound_of
from .exact import available as exact_available
from .exact import exact_orders
from .greedy import list_schedule
from .improve import improve
from .orders import Instance, Orders, peak, to_actions
from .problem import Problem, make_problem
from .starts import fitting, hand_written, one_at_a_time, policies


@dataclass(frozen=True)
class Synthesis:
    """What a synthesis found, beside the schedule (also in ``schedule.meta["synthesis"]`` as a dict)."""

    makespan: float
    lower_bound: float
    bound_reason: str
    baseline: str  # the best hand-written schedule that fits the caps ("one-at-a-time" when none does)
    baseline_makespan: float
    evaluations: int
    peaks: dict[str, tuple[float, ...]] = field(default_factory=dict)  # per memory unit, per rank

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
    else loop). ``effort``: evaluations of the local search (deterministic; default by size). ``exact``: a
    budget, in CP-SAT's deterministic seconds, for the exact model (:mod:`.exact`; needs OR-Tools, the
    ``exact`` extra; for small problems: a few hundred actions), seeded with the best order found.

    The result is a complete schedule (F, I / W or B, SYNC, sends and receives) whose simulated makespan
    is never above the best registered schedule that fits the same caps; ``schedule.meta["synthesis"]``
    reports its makespan, the lower bound (:func:`stagewise.synthesis.lower_bound`) and that baseline.
    Raises ``ValueError`` naming the stage for costs of the wrong shape, and the smallest cap that works
    for a cap nothing fits.
    """
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
        orders, report = search(problem, default_effort(problem) if effort is None else effort, exact)
        return finish(problem, orders, report, name)


def search(problem: Problem, effort: int, exact: float = 0.0) -> tuple[Orders, Synthesis]:
    """The best orders found, and the report (peaks are filled in by :func:`finish`)."""
    inst = Instance(problem)
    bound = bound_of(problem)
    base_name, base_ms, base_orders = baseline(problem, inst)
    pool = [(base_ms, base_orders)]
    evaluations = 0
    for pol in policies(inst):
        played = list_schedule(inst, pol)
        evaluations += 1
        if played is None or not fitting(problem, played):
            continue
        ms = inst.makespan(played)
        if ms is not None:
            pool.append((ms, played))
            if bound_reached(ms, bound):
                break
    pool.sort(key=lambda x: x[0])
    best_ms, best = pool[0]
    if not bound_reached(best_ms, bound):
        best, best_ms, used = improve(inst, [o for _, o in pool[:3]], effort, bound.value)
        evaluations += used
    if exact > 0 and not bound_reached(best_ms, bound):
        best, best_ms = solve_exactly(inst, best, best_ms, exact)
    return best, Synthesis(best_ms, bound.value, bound.why, base_name, base_ms, evaluations)


def baseline(problem: Problem, inst: Instance) -> tuple[str, float, Orders]:
    """The fastest registered schedule that fits the caps; the one-at-a-time order when none does."""
    name, orders = "one-at-a-time", one_at_a_time(problem)
    best = inst.makespan(orders)
    assert best is not None  # one micro-batch at a time always finishes
    for label, hand in hand_written(problem):
        if fitting(problem, hand):
            ms = inst.makespan(hand)
            if ms is not None and ms < best:
                name, best, orders = label, ms, hand
    return name, best, orders


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
    """Fuse each I directly followed by its own W into a B where that costs no time, lower, validate, report."""
    m = problem.microbatches
    inst = Instance(problem)
    target = inst.makespan(orders)
    pairs = frozenset(c // 3 for acts in orders for a, c in zip(acts, acts[1:]) if a % 3 == 1 and c == a + 1)
    fuse = pairs
    fused = _compute_schedule(problem, orders, name, fuse)
    if simulate(fused, problem.costs).makespan > (target or 0.0) * (1 + 1e-12):
        fuse = frozenset(k for k in pairs if k // m == 0)  # stage 0's input gradient goes nowhere: always free
        fused = _compute_schedule(problem, orders, name, fuse)
    complete = lower(fused)  # validates: the validator's guarantee holds for every result
    sim = simulate(complete, problem.costs)
    peaks = {lim.unit: tuple(_peaks(problem, orders, k)) for k, lim in enumerate(problem.limits)}
    final = Synthesis(
        sim.makespan,
        report.lower_bound,
        report.bound_reason,
        report.baseline,
        report.baseline_makespan,
        report.evaluations,
        peaks,
    )
    complete.meta["synthesis"] = final.to_dict()
    complete.meta["placement"] = problem.placement_kind
    return complete


def _compute_schedule(problem: Problem, orders: Orders, name: str, fuse: frozenset[int]) -> Schedule:
    ranks = to_actions(orders, problem.microbatches, fuse)
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
    )
