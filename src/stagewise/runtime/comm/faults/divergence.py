"""A peer's collective calls read against this process's: why a rank waits in vain, when the script is at fault.

Each process publishes ``at/<global rank>/<scope>`` for each pipeline it runs (:mod:`.heartbeat`, from
:mod:`.calls`); a rank that has waited a few seconds (:meth:`.guard.Guard.check_deadline`), or whose wait failed
on a closed connection, reads its pipeline's here. A peer in another call, or whose script ended, is the
cause - no rank stopped or died.
"""

from __future__ import annotations

import torch.distributed as dist

from . import calls, heartbeat


def diverged(me: str, scope: str) -> str:
    """Why ``me`` (how messages name this rank) waits in vain in the pipeline ``scope`` names, when a peer's
    published calls diverge from this process's (:func:`.calls.judge`: a peer in another call, or whose script
    ended), in words; "" when none does (or nothing can be read)."""
    return _first(_peers(), me, scope, ended_only=False)


def blame_ended(scope: str) -> str:
    """The words for a peer whose script ended while this rank waits in a call of ``scope``'s pipeline that the
    peer has not made (a closed connection then is no death), or ""."""
    return _first(_peers(), None, scope, ended_only=True)


def ended_words(rank: int, scope: str) -> str:
    """``"global rank 1's script ended after 2 collective calls, ..."`` when global ``rank`` left by ending its
    script while this rank waits in a call of ``scope``'s pipeline it did not make, else ""."""
    return _first([rank], None, scope, ended_only=True)


def _first(ranks: list[int] | None, me: str | None, scope: str, ended_only: bool) -> str:
    """The words of the first of ``ranks`` whose calls diverge (only a script that ended, with ``ended_only``);
    ``me`` None, or the pipeline's ``"rank N"`` where N is also its global rank: this process by its global rank,
    as the peers are named. "" when none does, or nothing can be read (no store, no
    group: no evidence)."""
    try:
        mine = dist.get_rank()
        me = f"global rank {mine}" if me in (None, f"rank {mine}") else me  # named as the peers are, where alike
        for rank in ranks if ranks is not None else []:
            found = _judged(rank, me, scope)
            if found is not None and (found.ended or not ended_only):
                return found.words
    except Exception:
        return ""
    return ""


def _peers() -> list[int] | None:
    """Every other process of the default group: each publishes its calls by its global rank (a pipeline's
    ranks are among them; one that runs no pipeline of ``scope`` published nothing for it and is passed over);
    None where there is no group."""
    try:
        mine = dist.get_rank()
        return [r for r in range(dist.get_world_size()) if r != mine]
    except Exception:
        return None


def _judged(rank: int, me: str, scope: str) -> calls.Divergence | None:
    store = heartbeat.store()
    key = f"at/{rank}/{scope}"
    if store is None or not store.check([key]):
        return None
    return calls.judge(calls.current(scope), f"global rank {rank}", store.get(key).decode(), me)
