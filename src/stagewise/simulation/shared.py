"""The simulator's makespan when the ranks share fewer cores than there are processes (processor sharing).

:func:`stagewise.simulation.arrays.simulate` gives each rank a device of its own. On a
node whose processes outnumber its cores - 4 or 8 ranks on this project's
2-core machine, or any oversubscribed host - the operating system shares the
cores among the processes that are computing: while ``n`` of them compute on
``c`` cores, each advances at ``min(1, c / n)`` of its own speed, and a rank
waiting for a message sleeps (the transports do not spin) and takes no core.

That is what this event-driven replay does, on the same dependency rules as
the simulator (an action starts when its rank is free and its input has
arrived; transfers take ``latency + bytes / bandwidth`` and no core, and a
rank's messages between machines leave its link one after another; SYNC and
STEP take their time on their rank and no core, but the ``sync_cpu`` share of
a SYNC's time, which computes as F and B do: the replicas' all-reduce inside a
node on CPUs is partly the node's CPU work, partly a wait for the peer; while
a share ``f`` of it shares ``c`` cores with ``n`` runnable processes (it counts
as ``f`` of one), it advances at ``1 / ((1 - f) + f n / c)``); a message between machines, while on its
link, counts as ``link_cpu`` of a process at each end (its sender's node and its receiver's: the I/O
threads and the kernel's network work beside the compute). One pipeline rank may stand
for several processes on the node - its data-parallel, sharding and tensor
replicas, which run the same timeline - so each rank carries a ``weight``: the
number of the node's processes that compute whenever it does, and that each
send their own copy of its messages over the link between machines.

It answers the makespan only; the planner uses it in place of
``max(simulated, busiest node's work / cores)`` - a bound that holds with
perfect packing and misses the fill and drain, where fewer ranks compute than
there are cores, and the steady state, where more do.

``tied``: reductions the step waits for at its end, outside every rank's action
list - the gradient sum of parameters tied across stages (an embedding and the
head reusing it: :mod:`stagewise.planning.tied_sum`), which each rank holding
one of ``stages`` starts at its SYNC of that stage (its last compute action of
it where the list has no SYNC) and every one of them waits for before the step
ends. The step lasts at least until ``seconds`` after the last such start
(:func:`~stagewise.simulation.tied.tied_done`, on the replay's timed actions).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import COMM, Action, Kind, Schedule
from .costs import CostModel
from .tied import tied_done

_F, _B, _I, _W, _SYNC = Kind.F, Kind.B, Kind.I, Kind.W, Kind.SYNC


def shared_makespan(
    schedule: Schedule,
    costs: CostModel,
    weights: Sequence[float],
    cores: float,
    nodes: Sequence[int] | None = None,
    tied: Sequence[tuple[Sequence[int], float]] = (),
) -> float:
    """The step's makespan when rank ``r`` is ``weights[r]`` processes computing alike on node ``nodes[r]``'s
    ``cores`` shared cores (``nodes`` None: one node); ``tied``: ``(stages, seconds)`` reductions the step waits for
    at its end (module docstring).

    With ``cores`` at least each node's summed weights, no ``tied``, and weights of 1 where a message crosses
    machines on a finite bandwidth, it equals ``simulate(schedule, costs).makespan``. Raises ``ValueError`` on a
    schedule that cannot finish, as the simulator does.
    """
    n, p = schedule.num_stages, schedule.num_ranks
    if costs.num_stages != n:
        raise ValueError(f"cost model describes {costs.num_stages} stages, schedule {schedule.name!r} has {n}")
    if len(weights) != p or not all(w > 0 for w in weights):
        raise ValueError(f"shared_makespan: one weight > 0 per rank ({p}), got {list(weights)}")
    if not cores > 0:
        raise ValueError(f"shared_makespan: cores must be > 0, got {cores!r}")
    node = [0] * p if nodes is None else list(nodes)
    if len(node) != p:
        raise ValueError(f"shared_makespan: one node per rank ({p}), got {len(node)}")
    for stages, seconds in tied:
        if not all(0 <= s < n for s in stages) or not 0 <= seconds < float("inf"):
            raise ValueError(
                f"shared_makespan: a tied sum is (stages of 0..{n - 1}, seconds >= 0), "
                f"got ({list(stages)}, {seconds!r})"
            )
    replay = _SharedCores(schedule, costs, weights, cores, node)
    while replay.advance(replay.start_ready()):
        pass
    stuck = [r for r in range(p) if replay.state[r] != 3]
    if stuck:
        r = stuck[0]
        raise ValueError(
            f"schedule {schedule.name!r} cannot finish: rank {r} waits at {replay.ranks[r][replay.pos[r]]} "
            f"for a value no rank produces first (run validate_schedule for details)"
        )
    end = max((replay.end, *tied_done(replay, tied)))
    return end - (replay.first or 0.0)


class _SharedCores:
    """The replay's state at time ``t``: per rank, its next action, the work left of a running compute action
    (seconds at full speed), the end of a running SYNC/STEP, and what it is doing; each message's arrival; the
    start and end of each action run so far (a :class:`~stagewise.simulation.tied.Timed` step once done)."""

    __slots__ = (
        "arrival", "b_full", "cores", "costs", "delay_b", "delay_f", "end", "ends", "first", "flows", "lane", "last",
        "left", "m", "node", "part", "placement", "pools", "pos", "ranks", "starts", "state", "t", "until", "weights",
        "wire_b", "wire_f",
    )  # fmt: skip

    def __init__(
        self, schedule: Schedule, costs: CostModel, weights: Sequence[float], cores: float, node: list[int]
    ) -> None:
        n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
        plc, last = schedule.placement, n - 1
        self.costs, self.m, self.last, self.placement = costs, m, last, plc
        self.weights, self.cores, self.node, self.pools = weights, cores, node, sorted(set(node))
        self.b_full = list(costs.backward_times())
        delay = costs.boundary_transfers(plc, p)  # 0 on one rank, the local link on one node
        # how long a message holds its sender's link between machines: each of the rank's processes sends its own,
        # and its receiver waits for the last copy (one copy's time is in the delay already)
        wire = costs.boundary_wires(plc, p)
        self.wire_f = [w * weights[plc[s]] for s, w in enumerate(wire)]
        self.wire_b = [0.0, *(w * weights[plc[s + 1]] for s, w in enumerate(wire[:-1]))]
        self.delay_f = [d + (w - one) if w != one else d for d, w, one in zip(delay, self.wire_f, wire, strict=True)]
        self.delay_b = [0.0, *(d + (w - one) if w != one else d for d, w, one in zip(delay, self.wire_b[1:], wire))]
        self.part = [1.0] * p  # the share of a core the rank's running action takes while it runs
        self.lane = [0.0] * p  # when each rank's link is free of the messages it already sent
        self.flows: list[tuple[float, float, int, int]] = []  # messages on a link: from, until, their ends' nodes
        self.ranks = [[a for a in acts if a[1] not in COMM] for acts in schedule.ranks]
        self.arrival: list[float | None] = [None] * (2 * n * m)
        self.pos = [0] * p
        self.left = [0.0] * p
        self.until = [0.0] * p
        self.state = [0] * p  # 0 idle, 1 computing, 2 in SYNC/STEP, 3 done (literals: read per rank per event)
        self.first: float | None = None
        self.end = 0.0
        self.t = 0.0
        self.starts: list[list[float]] = [[] for _ in range(p)]
        self.ends: list[list[float]] = [[] for _ in range(p)]

    @property
    def actions(self) -> list[list[Action]]:
        return self.ranks

    def finish(self, r: int) -> None:
        """Rank ``r``'s running action ends now: its message leaves, the rank is idle."""
        s, kind, i = self.ranks[r][self.pos[r]]
        m = self.m
        self.ends[r].append(self.t)
        if kind is _F and s < self.last:
            self.send(r, 2 * (s * m + i), self.wire_f[s], self.delay_f[s])  # type: ignore[operator]
        elif (kind is _B or kind is _I) and s:
            self.send(r, 2 * (s * m + i) + 1, self.wire_b[s], self.delay_b[s])  # type: ignore[operator]
        self.pos[r] += 1
        self.state[r] = 0

    def send(self, r: int, msg: int, wire: float, delay: float) -> None:
        """Rank ``r``'s message ``msg`` made now arrives ``delay`` after it leaves: now, or (``wire`` > 0: it crosses
        machines) once the rank's earlier messages have, each holding the link for its ``wire`` (its latency
        overlaps the others'); while on the link it takes ``link_cpu`` of a process at each end."""
        if not wire:
            self.arrival[msg] = self.t + delay
            return
        go = max(self.t, self.lane[r])
        self.lane[r] = go + wire
        self.arrival[msg] = go + delay
        if self.costs.link_cpu:
            s = (msg // 2) // self.m
            to = self.placement[s + 1] if msg % 2 == 0 else self.placement[s - 1]
            self.flows.append((go, go + wire, self.node[r], self.node[to]))

    def on_links(self, busy: dict[int, float]) -> float:
        """Add to ``busy`` the CPU of the messages on a link now (``link_cpu`` of a process at each end); the next
        time one starts or ends (when the shares change)."""
        t, f = self.t, self.costs.link_cpu
        self.flows = [x for x in self.flows if x[1] > t]
        flip = float("inf")
        for start, end, a, b in self.flows:
            if start <= t:
                busy[a] += f
                busy[b] += f
                flip = min(flip, end)
            else:
                flip = min(flip, start)
        return flip

    def start_ready(self) -> float:
        """Start on every idle rank what can start now (zero-length actions finish at once, and the ranks are
        swept again while one of them hands on a message in this instant); the next arrival awaited."""
        ranks, state, pos, arrival, costs, t = self.ranks, self.state, self.pos, self.arrival, self.costs, self.t
        m, last, left, until, first = self.m, self.last, self.left, self.until, self.first
        cpu = costs.sync_cpu
        wake = float("inf")
        swept = False
        while not swept:
            swept = True
            for r in range(len(ranks)):
                while state[r] == 0:
                    if pos[r] == len(ranks[r]):
                        state[r] = 3
                        self.end = max(self.end, t)
                        break
                    s, kind, i = ranks[r][pos[r]]
                    if kind is _F and s:  # the message it waits for
                        ready = arrival[2 * ((s - 1) * m + i)]  # type: ignore[operator]
                    elif (kind is _B or kind is _I) and s < last:
                        ready = arrival[2 * ((s + 1) * m + i) + 1]  # type: ignore[operator]
                    else:
                        ready = 0.0
                    if ready is None:
                        break  # its input is not made yet
                    if ready > t:
                        wake = min(wake, ready)
                        break
                    if first is None:
                        first = self.first = t
                    self.starts[r].append(t)
                    self.part[r] = cpu if kind is _SYNC else 1.0
                    if kind is _F or kind is _B or kind is _I or kind is _W or (kind is _SYNC and cpu > 0):
                        work = (
                            costs.forward[s]
                            if kind is _F
                            else self.b_full[s]
                            if kind is _B
                            else costs.backward_input[s]
                            if kind is _I
                            else costs.backward_weight[s]
                            if kind is _W
                            else costs.sync_time[s]
                        )
                        if work > 0:
                            left[r], state[r] = work, 1
                        else:
                            self.finish(r)
                            swept = False
                    else:
                        took = costs.sync_time[s] if kind is _SYNC else costs.step_time[s]
                        if took > 0:
                            until[r], state[r] = t + took, 2
                        else:
                            self.finish(r)
        return wake

    def advance(self, wake: float) -> bool:
        """Run to the next event (an action ends, or the message ``wake`` arrives), the computing ranks of each
        node sharing its cores; False when there is none (every rank done, or waiting for nothing that comes)."""
        state, left, until, t, p = self.state, self.left, self.until, self.t, len(self.state)
        weights, cores, node = self.weights, self.cores, self.node
        busy = dict.fromkeys(self.pools, 0.0)
        part = self.part  # of a core a computing rank's process takes: 1, a SYNC its CPU share (sync_cpu)
        for r in range(p):
            if state[r] == 1:
                busy[node[r]] += weights[r] * part[r]
        flip = self.on_links(busy) if self.flows else float("inf")
        rate = [1.0 / (1.0 - part[r] + part[r] * max(1.0, busy[node[r]] / cores)) if state[r] == 1 else 1.0
                for r in range(p)]  # fmt: skip
        done_at = [t + left[r] / rate[r] if state[r] == 1 else until[r] if state[r] == 2 else 0.0 for r in range(p)]
        nxt = min([wake, flip] + [done_at[r] for r in range(p) if state[r] in (1, 2)])
        if nxt == float("inf"):
            return False
        for r in range(p):
            if state[r] == 1:
                left[r] -= (nxt - t) * rate[r]
        self.t = nxt
        close = nxt + 1e-12 * (1.0 + abs(nxt))
        for r in range(p):
            if state[r] in (1, 2) and done_at[r] <= close:
                self.finish(r)
        return True
