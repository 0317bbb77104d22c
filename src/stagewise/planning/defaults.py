"""The default cut made to pay for the schedule it runs, and a word when nothing will.

:func:`refined_counts`: the min-max cut balances stages, but a schedule of several stages per rank runs at
its busiest rank's pace, and the V placements (``zb-v``, ``dualpipe-v``) hold stage 0 and the last stage on
one rank; so the cut is then improved boundary by boundary, each move kept only when the simulator times the
schedule itself faster by more than :data:`MOVE_GAIN`, from the min-max cut and from the even cut, the
better kept (a stack of equal layers stays evenly cut; the default is never worse than the even cut by its own
estimate).

:func:`against_1f1b`: the default cut makes a schedule pay where a cut can; where none can
(a model so small that a V's extra stages cost more than the bubble they fill), the user is told once, with
the simulator's figures, instead of finding out from the step time. Pure: a layer profile (measured, or
estimated from counted work) and the schedule as built; 1F1B gets its own default cut on the same layers.
Both steps wait for the gradient sum of the profile's tied layers (``LayerProfile.tied``,
:mod:`stagewise.planning.tied_sum`): what a V placement saves, holding the embedding and the head reusing it on
one rank, where 1F1B sums them over a ring of its first and last ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..ir import Schedule
from ..partition import LayerProfile, uniform_counts
from ..partition.estimate import balanced_counts
from ..passes.build import build_schedule
from ..schedules import is_asynchronous
from ..simulation import simulate, tied_done
from .action_cost import with_overhead
from .comm import Link
from .tied_sum import tied_sums

#: a boundary move is kept only when it makes the simulated step this much shorter (ties keep the cut)
MOVE_GAIN = 0.005
#: the most boundary moves tried (each a simulation of the schedule)
MOVES = 400

#: a named schedule predicted slower than 1F1B by more than this is worth a word: the profile's own
#: round-to-round spread is about 1 % per stage (runtime/assembly/auto_schedule.py), and 2 % is the margin
#: issue 49 holds a default cut to
NOISE = 0.02


def pricing(convolutions: bool, inputs: bool) -> str:
    """How the default cut prices the layers: ``"timed"`` where a layer holds a convolution and there is an
    input to time it on (``sample_inputs``, or the first batch's first micro-batch); ``"counted"`` (FLOPs,
    bytes and operators on the meta device) for other layers with an input; ``"parameters"`` without one.

    Why not count convolutions: measured per layer (docs/benchmarks/defaults.md), two convolution blocks of
    equal FLOPs and operators differ by 20-35 % in time by their shape (a small image with many channels is
    the slower, though it moves fewer bytes), so no rate of FLOPs, bytes or operators prices them, and the
    counted cut of a small ResNet stays 1.12-1.20x the time cut under ZB-V. Dense layers' count meets the
    2 % goal, and it is deterministic, so it is kept for them."""
    if not inputs:
        return "parameters"
    return "timed" if convolutions else "counted"


@dataclass(frozen=True)
class Verdict:
    """The named schedule's predicted step against 1F1B's, both in the profile's units (seconds)."""

    schedule: str
    predicted: float
    one_f_one_b: float
    counts: tuple[int, ...]
    baseline_counts: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.predicted / self.one_f_one_b if self.one_f_one_b > 0 else 1.0

    @property
    def slower(self) -> bool:
        return self.ratio > 1 + NOISE

    def line(self) -> str:
        return (
            f"stagewise: schedule {self.schedule!r} is predicted {self.ratio:.2f}x 1F1B's step on these layers "
            f"({self.predicted * 1e3:.2f} ms against {self.one_f_one_b * 1e3:.2f} ms by the simulator; cuts "
            f"{list(self.counts)} and {list(self.baseline_counts)}): consider schedule='1f1b' (or 'auto')"
        )


def against_1f1b(
    profile: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    *,
    latency: float = 0.0,
    bandwidth: float = math.inf,
    per_action: float = 0.0,
) -> Verdict | None:
    """``schedule`` cut by ``counts`` against 1F1B on as many ranks with as many micro-batches, cut by
    :func:`~stagewise.partition.estimate.balanced_counts` of the same profile, over a link of ``latency``
    seconds and ``bandwidth`` bytes per second, each compute action costing ``per_action`` seconds more (the
    runtime's own work per action: a schedule of more, smaller actions pays it more often;
    :func:`stagewise.planning.action_cost.with_overhead`), each step waiting for the profile's tied layers'
    gradient sum as its placement needs one, on the same link (module docstring); None where the comparison
    means nothing (1F1B itself, an asynchronous schedule, one rank, fewer layers than ranks)."""
    p, m = schedule.num_ranks, schedule.num_microbatches
    if schedule.name == "1f1b" or is_asynchronous(schedule) or p < 2 or len(profile) < p:
        return None
    times = profile.times()
    base_counts = balanced_counts(times, p)
    base = build_schedule("1f1b", p, m)
    link = Link(latency, bandwidth)

    def step(plan: Schedule, cut: Sequence[int]) -> float:
        costs = profile.cost_model(_bounds(cut), latency=latency, bandwidth=bandwidth)
        sim = simulate(plan, with_overhead(costs, per_action))
        sums = tied_sums(profile.tied, cut, plan.placement, between=link)  # (the V's: none at one replica)
        begin = min((ts[0] for ts in sim.starts if ts), default=0.0)
        return max((sim.makespan, *(done - begin for done in tied_done(sim, sums))))

    return Verdict(schedule.name, step(schedule, counts), step(base, base_counts), tuple(counts), tuple(base_counts))


def refined_counts(profile: LayerProfile, schedule: Schedule, counts: Sequence[int]) -> list[int]:
    """``counts`` (layers per stage of ``schedule``) improved by single-layer boundary moves while the simulator,
    on ``profile``'s costs, times the schedule faster by more than :data:`MOVE_GAIN` (the module docstring).
    One stage per rank: returned as given (the min-max cut is the bottleneck's optimum already)."""
    current = [int(c) for c in counts]
    if schedule.virtual_stages == 1 or len(current) < 2:
        return current

    def step(c: list[int]) -> float:
        return simulate(schedule, profile.cost_model(_bounds(c))).makespan

    # the moves from the even cut too: a local search from the min-max cut can stop where the even one is better
    found = [improved_counts(uniform_counts(sum(current), len(current)), step), improved_counts(current, step)]
    even, moved = found
    return moved if step(moved) < step(even) * (1 - MOVE_GAIN) else even


def improved_counts(counts: Sequence[int], score: Callable[[list[int]], float]) -> list[int]:
    """``counts`` improved by single-layer boundary moves while ``score`` (a predicted step) falls by more
    than :data:`MOVE_GAIN`, at most :data:`MOVES` scores."""
    current = [int(c) for c in counts]
    best = score(current)
    tried = 0
    improved = True
    while improved and tried < MOVES:
        improved = False
        for k in range(len(current) - 1):
            for step in (1, -1):
                moved = list(current)
                moved[k], moved[k + 1] = moved[k] + step, moved[k + 1] - step
                if min(moved[k], moved[k + 1]) < 1:
                    continue
                tried += 1
                value = score(moved)
                if value < best * (1 - MOVE_GAIN):
                    current, best, improved = moved, value, True
    return current


def _bounds(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out
