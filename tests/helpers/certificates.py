"""Progress certificates for lowered schedules, computed the slow, obvious way (for the validator's array path).

:func:`stagewise.validate.arrays.proves_valid` checks a certificate: one number per batch (the run of
communication before each compute action, and the one after the last), increasing along each rank, and each
op's batch numbered above the batch before its partner's. :func:`fitting_certificate` finds such numbers for
any schedule whose batches can complete (longest waits through the batch graph), so the array path can be
asked about a schedule's other rules with progress granted.
"""

from __future__ import annotations

from stagewise.ir import Kind, Schedule
from stagewise.passes.reference import add_communication_reference

Batch = tuple[int, int]  # (rank, index of the batch on that rank)


def certified(schedule: Schedule) -> tuple[Schedule, list[list[int]]]:
    """``schedule`` lowered by the reference pass, with its certificate."""
    result = add_communication_reference(schedule)
    assert result is not None
    return result


def batches(schedule: Schedule) -> tuple[list[int], dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """Per rank its number of batches; per message, (rank, batch) of its send and of its receive."""
    m = schedule.num_microbatches
    counts, sends, recvs = [], {}, {}
    for rank, acts in enumerate(schedule.ranks):
        batch = 0
        for a in acts:
            if a.kind.is_compute:
                batch += 1
            elif a.kind is Kind.SEND_F:
                sends[2 * (a.stage * m + a.microbatch)] = (rank, batch)
            elif a.kind is Kind.SEND_B:
                sends[2 * (a.stage * m + a.microbatch) + 1] = (rank, batch)
            elif a.kind is Kind.RECV_F:
                recvs[2 * ((a.stage - 1) * m + a.microbatch)] = (rank, batch)
            elif a.kind is Kind.RECV_B:
                recvs[2 * ((a.stage + 1) * m + a.microbatch) + 1] = (rank, batch)
        counts.append(batch + 1)
    return counts, sends, recvs


def longest_paths(nodes: list[Batch], edges: list[tuple[Batch, Batch]]) -> dict[Batch, int] | None:
    """Numbers with c(a) > c(b) for every edge (a, b) (a waits for b), or None if the edges close a cycle."""
    waits: dict[tuple[int, int], list[tuple[int, int]]] = {x: [] for x in nodes}
    for a, b in edges:
        waits[a].append(b)
    value: dict[tuple[int, int], int] = {}
    state: dict[tuple[int, int], int] = {}
    for root in nodes:
        stack = [(root, 0)]
        while stack:
            x, i = stack.pop()
            if i == 0:
                if state.get(x) == 2:
                    continue
                if state.get(x) == 1:
                    return None
                state[x] = 1
            if i < len(waits[x]):
                stack.append((x, i + 1))
                y = waits[x][i]
                if state.get(y) == 1:
                    return None
                if state.get(y) != 2:
                    stack.append((y, 0))
                continue
            value[x] = 1 + max((value[y] for y in waits[x]), default=0)
            state[x] = 2
    return value


def partner_edges(schedule: Schedule) -> tuple[list[Batch], list[tuple[Batch, Batch]]]:
    """The batches, and the cross-rank waits: the batch of an op waits for the batch before its partner's."""
    counts, sends, recvs = batches(schedule)
    nodes = [(r, b) for r, c in enumerate(counts) for b in range(c)]
    edges = []
    for msg, (sr, sb) in sends.items():
        if msg not in recvs:
            continue
        rr, rb = recvs[msg]
        if rb > 0:
            edges.append(((sr, sb), (rr, rb - 1)))
        if sb > 0:
            edges.append(((rr, rb), (sr, sb - 1)))
    return nodes, edges


def fitting_certificate(schedule: Schedule) -> list[list[int]] | None:
    """A certificate that holds whenever the schedule can finish (longest waits), or None when it cannot."""
    nodes, edges = partner_edges(schedule)
    edges += [((r, b), (r, b - 1)) for r, b in nodes if b > 0]
    value = longest_paths(nodes, edges)
    if value is None:
        return None
    counts, _, _ = batches(schedule)
    return [[value[(r, b)] for b in range(n)] for r, n in enumerate(counts)]


def partner_certificate(schedule: Schedule) -> list[list[int]] | None:
    """Numbers that respect every partner's wait but not the order along a rank (they may fall): what a
    certificate check that forgot the rank order would accept for a schedule that hangs. None if even the
    partners' waits close a cycle."""
    value = longest_paths(*partner_edges(schedule))
    if value is None:
        return None
    counts, _, _ = batches(schedule)
    return [[value[(r, b)] for b in range(n)] for r, n in enumerate(counts)]
