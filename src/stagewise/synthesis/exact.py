"""An exact model for small problems: CP-SAT (Google OR-Tools) searches every order, seeded with the best found.

Optional: ``pip install stagewise[exact]``; the synthesizer runs it only when asked (``exact=`` a budget),
and the rest of the package never imports OR-Tools.

The model is the simulator's, in integer time (costs scaled by :data:`SCALE`, rounded): one interval per
F, I and W; on each rank the intervals do not overlap; an F waits for the previous stage's F plus the
transfer, an I for its own F and the next stage's I plus the transfer, a W for its I. Memory is a
reservoir per rank and cap: an F adds its activations at its start, an I frees all but what W keeps at
its end, the W the rest at its end. As the ranks never overlap their actions, the level at a time is the
level after the actions that began before it, which is what the simulator counts. Minimise the last end.

The solution's per-rank orders are timed again by the simulator's walk (:mod:`.orders`) in the real
costs, and kept by the caller only if they are faster. With one worker and a deterministic time limit
the search is repeatable.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .bound import heads_and_tails
from .orders import F, I, Instance, Orders, W

log = logging.getLogger(__name__)

SCALE = 1000  # time units per cost unit in the integer model
_LEVEL = 3000  # memory units per micro-batch (a third of a stage's activations is exact)


def available() -> bool:
    """Whether OR-Tools is installed (the ``exact`` extra)."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def exact_orders(inst: Instance, start: Orders, budget: float) -> Orders | None:
    """The best orders CP-SAT finds within ``budget`` deterministic seconds, hinted with ``start``; None if none."""
    from ortools.sat.python import cp_model

    prob, m, n = inst.problem, inst.m, inst.n
    timed = inst.times(start)
    if timed is None:
        return None
    starts, _ = timed
    hint = {code: starts[g] for g, code in enumerate(c for acts in start for c in acts)}
    dur = [round(t * SCALE) for t in inst.took]
    horizon = max(round(max(s + inst.took[c] for c, s in hint.items()) * SCALE) + 1, 1)
    model = cp_model.CpModel()
    begin: dict[int, Any] = {}
    end: dict[int, Any] = {}
    per_rank: list[list[Any]] = [[] for _ in range(inst.p)]
    head, tail = heads_and_tails(prob)
    for s in range(n):
        for i in range(m):
            for k in (F, I, W):
                code = 3 * (s * m + i) + k
                lo = math.floor(head[s][k] * SCALE)
                hi = max(lo, horizon - dur[code] - math.floor(tail[s][k] * SCALE))
                begin[code] = model.new_int_var(lo, hi, f"b{code}")
                end[code] = model.new_int_var(lo + dur[code], hi + dur[code], f"e{code}")
                box = model.new_interval_var(begin[code], dur[code], end[code], f"x{code}")
                per_rank[prob.placement[s]].append(box)
                model.add_hint(begin[code], round(hint[code] * SCALE))
    for intervals in per_rank:
        model.add_no_overlap(intervals)
    _precedences(model, inst, begin, end)
    _memory(model, inst, begin, end)
    makespan = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(makespan, list(end.values()))
    model.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = budget
    status = solver.solve(model)
    log.info(
        "cp-sat: %s, makespan %s, proven bound %s (x%d)",
        solver.status_name(status), solver.objective_value, solver.best_objective_bound, SCALE,
    )  # fmt: skip
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return _orders(inst, {c: solver.value(b) for c, b in begin.items()}, {c: solver.value(e) for c, e in end.items()})


def _precedences(model: Any, inst: Instance, begin: dict[int, Any], end: dict[int, Any]) -> None:
    m, n = inst.m, inst.n
    for s in range(n):
        for i in range(m):
            f, b, w = (3 * (s * m + i) + k for k in (F, I, W))
            if s > 0:
                prev = 3 * ((s - 1) * m + i)
                model.add(begin[f] >= end[prev] + round(inst.delay[prev] * SCALE))
            if s + 1 < n:
                nxt = 3 * ((s + 1) * m + i) + 1
                model.add(begin[b] >= end[nxt] + round(inst.delay[nxt] * SCALE))
            model.add(begin[b] >= end[f])
            model.add(begin[w] >= end[b])


def _memory(model: Any, inst: Instance, begin: dict[int, Any], end: dict[int, Any]) -> None:
    prob, m = inst.problem, inst.m
    for r in range(inst.p):
        local = prob.stages_of(r)
        for lim in prob.limits:
            if lim.caps[r] == math.inf:
                continue
            scale = _LEVEL if lim.unit == "micro-batches" else _LEVEL / max(max(lim.add[s] for s in local), 1e-300)
            times, changes = [], []
            for s in local:
                add, keep = round(lim.add[s] * scale), round(lim.keep[s] * scale)
                for i in range(m):
                    key = 3 * (s * m + i)
                    times += [begin[key], end[key + 1], end[key + 2]]
                    changes += [add, -(add - keep), -keep]
            model.add_reservoir_constraint(times, changes, 0, math.floor(lim.caps[r] * scale + 1e-6))


def _orders(inst: Instance, begin: dict[int, int], end: dict[int, int]) -> Orders:
    """Per rank, its actions by start time (then end, then data order: F by stage, I and W backwards)."""
    prob, m, n = inst.problem, inst.m, inst.n

    def key(code: int) -> tuple[int, int, int, int]:
        s, kind = divmod(code, 3)[0] // m, code % 3
        data = s if kind == F else 2 * n - s
        return begin[code], end[code], data, kind

    return [
        sorted((3 * (s * m + i) + k for s in prob.stages_of(r) for i in range(m) for k in (F, I, W)), key=key)
        for r in range(inst.p)
    ]
