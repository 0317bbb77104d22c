"""The simulator written plainly, one action at a time: the reference for :mod:`stagewise.simulation.arrays`.

:func:`stagewise.simulation.arrays.simulate` computes the same times, peaks and bubble
with every per-action fact prepared as arrays first; a property test keeps the
two equal on random schedules and cost models.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from stagewise.ir import COMM, Kind, Schedule
from stagewise.simulation import CostModel

_F, _B, _I, _W, _SYNC, _STEP = Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC, Kind.STEP


class ReferenceResult(NamedTuple):
    makespan: float
    bubble_ratio: float
    peak_activations: list[float]
    peak_activation_bytes: list[float]
    starts: list[list[float]]
    ends: list[list[float]]


def _crosses(placement: tuple[int, ...], a: int, b: int) -> bool:
    return 0 <= b < len(placement) and placement[a] != placement[b]


def _leave(lane: list[float], rank: int, t: float, wire: float) -> float:
    """When a message made at ``t`` leaves ``rank``: once the rank's earlier messages have (``wire`` > 0)."""
    if not wire:
        return t
    go = lane[rank] if lane[rank] > t else t
    lane[rank] = go + wire
    return go


def simulate_reference(schedule: Schedule, costs: CostModel) -> ReferenceResult:
    """Time ``schedule`` one action at a time (ValueError when it cannot finish)."""
    ranks = [[a for a in acts if a[1] not in COMM] for acts in schedule.ranks]
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    placement = schedule.placement
    fwd, b_in, b_wt = costs.forward, costs.backward_input, costs.backward_weight
    b_full = tuple(x + y for x, y in zip(b_in, b_wt)) if not costs.backward_full else costs.backward_full
    sync, step = costs.sync_time, costs.step_time
    act = costs.activation_bytes
    keep = costs.weight_activation_bytes  # W's stash, left by I in place of the activations (may be larger)
    # Arrival delay of stage s's output at stage s+1, and of stage s's input gradient at stage s-1.
    delay_f = [costs.transfer_time(s) if s + 1 < n and placement[s + 1] != placement[s] else 0.0 for s in range(n)]
    delay_b = [costs.transfer_time(s - 1) if s > 0 and placement[s - 1] != placement[s] else 0.0 for s in range(n)]
    # A message to another rank (every rank a machine of its own) holds its sender's link for bytes / bandwidth:
    # a rank's messages leave one after another.
    wire_f = [costs.output_bytes[s] / costs.bandwidth if _crosses(placement, s, s + 1) else 0.0
              for s in range(n)]  # fmt: skip
    wire_b = [costs.output_bytes[s - 1] / costs.bandwidth if _crosses(placement, s, s - 1) else 0.0
              for s in range(n)]  # fmt: skip
    lane = [0.0] * p
    inv_v = 1.0 / schedule.virtual_stages
    last = n - 1

    # A message is a flat int: (stage, micro-batch) -> 2 * (stage * m + mb) (+1 for gradients).
    arrival: list[float | None] = [None] * (2 * n * m)
    waiting: dict[int, int] = {}  # message -> the rank blocked on it
    starts: list[list[float]] = [[] for _ in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    pos = [0] * p
    busy = [0.0] * p
    count = [0.0] * p
    mem = [0.0] * p
    peak_count = [0.0] * p
    peak_mem = [0.0] * p
    queue = deque(range(p))
    while queue:
        rank = queue.popleft()
        acts = ranks[rank]
        began, ended = starts[rank].append, ends[rank].append
        t, idx, end_idx = clock[rank], pos[rank], len(acts)
        cnt, byt, pk_c, pk_b, work = count[rank], mem[rank], peak_count[rank], peak_mem[rank], busy[rank]
        mb: int  # compute actions carry a micro-batch; per-stage ones (None) never reach the index arithmetic
        while idx < end_idx:
            a = acts[idx]
            s, kind, mb = a  # type: ignore[assignment]
            if kind is _F:
                if s:
                    ready = arrival[2 * ((s - 1) * m + mb)]
                    if ready is None:
                        waiting[2 * ((s - 1) * m + mb)] = rank
                        break
                    if ready > t:
                        t = ready
                start = t
                t += fwd[s]
                cnt += 1.0
                byt += act[s]
                if cnt > pk_c:
                    pk_c = cnt
                if byt > pk_b:
                    pk_b = byt
                if s < last:
                    key = 2 * (s * m + mb)
                    arrival[key] = _leave(lane, rank, t, wire_f[s]) + delay_f[s]
                    if key in waiting:
                        queue.append(waiting.pop(key))
            elif kind is _B or kind is _I:
                if s < last:
                    ready = arrival[2 * ((s + 1) * m + mb) + 1]
                    if ready is None:
                        waiting[2 * ((s + 1) * m + mb) + 1] = rank
                        break
                    if ready > t:
                        t = ready
                start = t
                if kind is _B:
                    t += b_full[s]
                    byt -= act[s]
                else:
                    t += b_in[s]
                    byt -= act[s] - keep[s]
                    if byt > pk_b:  # a stash larger than the activations it replaces
                        pk_b = byt
                cnt -= 1.0
                if s:
                    key = 2 * (s * m + mb) + 1
                    arrival[key] = _leave(lane, rank, t, wire_b[s]) + delay_b[s]
                    if key in waiting:
                        queue.append(waiting.pop(key))
            elif kind is _W:
                start = t
                t += b_wt[s]
                byt -= keep[s]
            else:  # SYNC or STEP: this rank's time only, not compute
                began(t)
                t += sync[s] if kind is _SYNC else step[s]
                ended(t)
                idx += 1
                continue
            work += t - start
            began(start)
            ended(t)
            idx += 1
        clock[rank], pos[rank] = t, idx
        count[rank], mem[rank], peak_count[rank], peak_mem[rank], busy[rank] = cnt, byt, pk_c, pk_b, work

    stuck = [r for r in range(p) if pos[r] < len(ranks[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(
            f"schedule {schedule.name!r} cannot finish: rank {r} waits at {ranks[r][pos[r]]} "
            f"for a value no rank produces first (run validate_schedule for details)"
        )
    firsts = [times[0] for times in starts if times]
    makespan = max(times[-1] for times in ends if times) - min(firsts) if firsts else 0.0
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    return ReferenceResult(
        makespan=makespan,
        bubble_ratio=bubble,
        peak_activations=[c * inv_v for c in peak_count],
        peak_activation_bytes=peak_mem,
        starts=starts,
        ends=ends,
    )
