"""Facts about a schedule's action order the search needs, cached: placement, split backward, activation states."""

from __future__ import annotations

from functools import lru_cache

from ..ir import Kind, Schedule, loop_placement, v_placement
from ..passes import add_grad_sync
from ..schedules import generate, schedule_info


@lru_cache(maxsize=4096)
def splits_backward(name: str) -> bool:
    s = generate(name, 2, 4, None)
    return any(a.kind is Kind.I for acts in s.ranks for a in acts)


@lru_cache(maxsize=1024)
def backward_counts(name: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, how many backwards the schedule runs whole (B) and how many split (I, then W)."""
    schedule = generate(name, pp, m, v)
    whole, split = [0] * schedule.num_stages, [0] * schedule.num_stages
    for acts in schedule.ranks:
        for a in acts:
            if a.kind is Kind.B:
                whole[a.stage] += 1
            elif a.kind is Kind.I:
                split[a.stage] += 1
    return tuple(whole), tuple(split)


@lru_cache(maxsize=256)
def compute_schedule(name: str, pp: int, m: int, v: int) -> Schedule:
    return add_grad_sync(generate(name, pp, m, v))


#: per rank, its activation states: (its stages, full activations held per stage, W-only parts held per stage)
_States = tuple[tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...], ...]


@lru_cache(maxsize=1024)
def activation_states(name: str, pp: int, m: int, v: int) -> _States:
    """Per rank, each distinct state right after a forward or an I: (stages, full activations held, W's stashes
    held per stage).

    A rank's activation memory only rises at a forward, or at an I whose stash outweighs what it frees, and
    depends on its action order alone, not on timing, so the peak bytes for any stage sizes is the largest dot
    product over these states (the simulator's ``peak_activation_bytes``, without simulating).
    """
    schedule = generate(name, pp, m, v)
    out = []
    for rank, acts in enumerate(schedule.ranks):
        stages = schedule.stages_of(rank)
        index = {st: k for k, st in enumerate(stages)}
        full, keep = [0] * len(stages), [0] * len(stages)
        states = set()
        for a in acts:
            k = index[a.stage]
            if a.kind is Kind.F:
                full[k] += 1
                states.add((tuple(full), tuple(keep)))
            elif a.kind is Kind.B:
                full[k] -= 1
            elif a.kind is Kind.I:
                full[k] -= 1
                keep[k] += 1
                states.add((tuple(full), tuple(keep)))
            elif a.kind is Kind.W:
                keep[k] -= 1
        out.append(tuple((stages, f, w) for f, w in _maximal(states)))
    return tuple(out)


def _maximal(states: set[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The states no other state dominates (holds at least as much of everything): only they can be the peak."""
    flat = sorted(states, key=lambda st: -(sum(st[0]) + sum(st[1])))
    keep: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for st in flat:
        vec = st[0] + st[1]
        if not any(all(a >= b for a, b in zip(k[0] + k[1], vec)) for k in keep):
            keep.append(st)
    return keep


@lru_cache(maxsize=4096)
def placement_of(name: str, pp: int, v: int) -> tuple[int, ...]:
    return loop_placement(pp, v) if schedule_info(name).placement == "loop" else v_placement(pp, v)
