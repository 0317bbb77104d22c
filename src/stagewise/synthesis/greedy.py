"""List scheduling: the ranks play the step out in time, each picking its next action by a small policy.

After the Zero Bubble paper's heuristic (Qi et al., ICLR 2024, Sec. 3.1): a rank admits new micro-batches
up to a warm-up depth and its memory cap, runs an input gradient (I) as soon as it can because the rank
before waits for it, and fills the gaps with weight gradients (W), which nobody waits for. Here the gaps
are judged with the cost model's times and transfer delays, and the policy's knobs (warm-up depth per
rank, how much a W may overrun a gap, I or F first, which stage's F first) are searched by the caller.

Per stage, F, I and W each go in micro-batch order. Memory for every stage of a rank is reserved when a
micro-batch enters the rank's first stage, so a later stage of the rank (an interleaved chunk, the way
back of a V) never waits for memory; with that and a W run whenever memory blocks an entry, a cap that
holds one micro-batch on every rank always finishes. A policy that still paints itself into a corner
returns None.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .orders import F, I, Instance, Orders


@dataclass(frozen=True)
class Policy:
    """How a rank picks its next action (see the module docstring)."""

    warmup: tuple[int, ...]  # per rank: most micro-batches between their entry F and their entry I
    slack: float  # a W fills a gap if it ends by the next input's arrival + slack * its time (inf: always)
    i_first: bool  # a ready I goes before a ready F
    deep_first: bool  # among ready Fs, the later stage's first


class _State:
    """What the play-out tracks: counters per stage, arrivals, clocks, memory held and reserved per rank."""

    def __init__(self, inst: Instance) -> None:
        prob = inst.problem
        n, m, p = inst.n, inst.m, inst.p
        self.inst, self.prob = inst, prob
        self.local = [prob.stages_of(r) for r in range(p)]
        self.entry = [min(st) for st in self.local]
        self.nf, self.ni = [0] * n, [0] * n
        self.f_ready: list[float | None] = [None] * (n * m)
        self.b_ready: list[float | None] = [None] * (n * m)
        for i in range(m):
            self.f_ready[i] = 0.0
        self.t = [0.0] * p
        self.inflight = [0] * p
        self.pend_w: list[deque[int]] = [deque() for _ in range(p)]
        lims = prob.limits
        self.held = [[0.0] * len(lims) for _ in range(p)]
        self.future = [[0.0] * len(lims) for _ in range(p)]
        self.chain = [[sum(lim.add[s] for s in self.local[r]) for lim in lims] for r in range(p)]
        self.left = [3 * m * len(self.local[r]) for r in range(p)]
        self.orders: Orders = [[] for _ in range(p)]

    def room(self, r: int) -> bool:
        """Whether a new micro-batch's activations on every stage of rank r fit its caps."""
        for k, lim in enumerate(self.prob.limits):
            if self.held[r][k] + self.future[r][k] + self.chain[r][k] > lim.caps[r] * (1 + 1e-9) + 1e-12:
                return False
        return True


def list_schedule(inst: Instance, policy: Policy) -> Orders | None:
    """Per-rank compute orders made by playing the step out under ``policy``; None if it gets stuck."""
    st = _State(inst)
    p = inst.p
    awake = [True] * p
    wake_at: list[float | None] = [None] * p
    total = sum(st.left)
    while total:
        r = _next_rank(st, awake, wake_at)
        if r < 0:
            return None
        code, when = _decide(st, r, policy)
        if code < 0:
            awake[r], wake_at[r] = False, when
            continue
        for woken in _run(st, r, code, max(st.t[r], when)):
            awake[woken], wake_at[woken] = True, None
        total -= 1
    return st.orders


def _next_rank(st: _State, awake: list[bool], wake_at: list[float | None]) -> int:
    """The awake rank with the earliest clock, or a sleeping one whose known input comes first; -1: stuck."""
    best, best_t = -1, math.inf
    for r in range(len(awake)):
        if st.left[r] == 0:
            continue
        if awake[r]:
            at = st.t[r]
        else:
            wake = wake_at[r]
            if wake is None:
                continue
            at = max(st.t[r], wake)
        if at < best_t:
            best, best_t = r, at
    if best >= 0 and not awake[best]:
        awake[best], wake_at[best] = True, None
        st.t[best] = best_t
    return best


def _decide(st: _State, r: int, pol: Policy) -> tuple[int, float]:
    """(code, ready time) of rank r's next action, or (-1, wake time or None) to wait."""
    inst, m, now = st.inst, st.inst.m, st.t[r]
    fs: list[tuple[float, int, int]] = []  # (ready, order key, code) of the Fs that may run
    ins: list[tuple[float, int, int]] = []
    blocked = False  # an entry F is held back by memory only
    for s in st.local[r]:
        i = st.nf[s]
        if i < m and (s != st.entry[r] or st.inflight[r] < pol.warmup[r]):
            if s == st.entry[r] and not st.room(r):
                blocked = True
            else:
                fs.append(
                    (_ready(st, st.f_ready[s * m + i], s, i, F, now), -s if pol.deep_first else s, 3 * (s * m + i))
                )
        i = st.ni[s]
        if i < st.nf[s]:
            ins.append((_ready(st, st.b_ready[s * m + i], s, i, I, now), -s, 3 * (s * m + i) + 1))
    groups = (ins, fs) if pol.i_first else (fs, ins)
    for group in groups:
        ready = [c for c in group if c[0] <= now]
        if ready:
            return min(ready, key=lambda c: (c[1], c[2]))[2], now
    pend = st.pend_w[r]
    if pend:
        w = inst.took[pend[0]]
        upcoming = min((c[0] for c in fs + ins), default=math.inf)
        if blocked or not (fs or ins) or now + w <= upcoming + pol.slack * w:
            return pend[0], now
    known = [c[0] for c in fs + ins if c[0] < math.inf and _known(st, c[2])]
    return -1, min(known) if known else None  # type: ignore[return-value]


def _known(st: _State, code: int) -> bool:
    key, kind = divmod(code, 3)
    return (st.f_ready if kind == F else st.b_ready)[key] is not None


def _ready(st: _State, known: float | None, s: int, i: int, kind: int, now: float) -> float:
    """The input's arrival, or when it cannot come earlier (its producer's clock + its time + the transfer)."""
    if known is not None:
        return known
    inst, m = st.inst, st.inst.m
    producer = 3 * ((s - 1) * m + i) if kind == F else 3 * ((s + 1) * m + i) + 1
    q = st.prob.placement[(s - 1) if kind == F else (s + 1)]
    return max(st.t[q], now) + inst.took[producer] + inst.delay[producer] + 1e-12


def _run(st: _State, r: int, code: int, start: float) -> list[int]:
    """Run ``code`` on rank r from ``start``; return the ranks a message was made for."""
    inst, prob, m = st.inst, st.prob, st.inst.m
    key, kind = divmod(code, 3)
    s, i = divmod(key, m)
    end = start + inst.took[code]
    st.t[r] = end
    st.orders[r].append(code)
    st.left[r] -= 1
    woken = []
    lims = prob.limits
    if kind == F:
        st.nf[s] += 1
        for k, lim in enumerate(lims):
            st.held[r][k] += lim.add[s]
            st.future[r][k] += st.chain[r][k] - lim.add[s] if s == st.entry[r] else -lim.add[s]
        if s == st.entry[r]:
            st.inflight[r] += 1
        if s + 1 < inst.n:
            st.f_ready[key + m] = end + inst.delay[code]
            woken.append(prob.placement[s + 1])
        else:
            st.b_ready[key] = end
    elif kind == I:
        st.ni[s] += 1
        for k, lim in enumerate(lims):
            st.held[r][k] -= lim.add[s] - lim.keep[s]
        if s == st.entry[r]:
            st.inflight[r] -= 1
        st.pend_w[r].append(code + 1)
        if s > 0:
            st.b_ready[key - m] = end + inst.delay[code]
            woken.append(prob.placement[s - 1])
    else:
        st.pend_w[r].popleft()
        for k, lim in enumerate(lims):
            st.held[r][k] -= lim.keep[s]
    return woken
