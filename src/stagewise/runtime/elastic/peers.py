"""Which machine's memory holds a copy of each rank's snapshot: a ring over the machines (pure: no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Peers:
    """Who this rank sends its snapshots to, and who sends theirs here (group ranks; None: no other machine)."""

    machines: list[str]
    dest: int | None
    sources: list[int]


def peers_of(machines: list[str], rank: int) -> Peers:
    """Rank ``j`` of machine ``i`` (machines in order of first appearance) -> rank ``j mod n`` of machine ``i+1``."""
    order = list(dict.fromkeys(machines))
    members = {m: [r for r, x in enumerate(machines) if x == m] for m in order}

    def dest_of(r: int) -> int | None:
        if len(order) < 2:
            return None
        i = order.index(machines[r])
        nxt = members[order[(i + 1) % len(order)]]
        return nxt[members[machines[r]].index(r) % len(nxt)]

    return Peers(machines, dest_of(rank), [r for r in range(len(machines)) if dest_of(r) == rank])
