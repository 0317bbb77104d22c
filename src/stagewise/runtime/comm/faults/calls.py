"""Which collective call each process is in, so that a rank left waiting on a peer in another call says so.

A pipeline's steps, evaluations and checkpoints are collectives: every rank makes the same calls in the same
order. A script that makes one on some ranks only (``if rank == 0: sw.checkpoint.save(...)``), or once more on
one rank than on another, leaves the others waiting on a peer that never comes; the deadline ended that wait
minutes later, blaming no one. So each process counts the collective calls it enters (:func:`call`), per
pipeline (its ranks make the same calls; a pipeline on other ranks need not), its heartbeat publishes the
count, the call and whether the script has ended (:func:`published`), and a rank that has waited a few seconds
compares a peer's with its own history (:func:`judge`): the n-th call must be the same call on every rank. A
peer merely behind (still writing the checkpoint this rank has left) is not a divergence: its n-th call is
this rank's n-th.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

LOOK_AFTER_S = 2.5  # a wait this long reads the peers' calls (their stamps are at most a second old)

NAMES = {  # how the messages name each kind of call
    "train_step": "train_step",
    "eval_step": "eval_step",
    "eval_loss": "eval_loss",
    "save": "sw.checkpoint.save",
    "load": "sw.checkpoint.load",
    "relayout": "pipe.relayout",
}
_COLLECTIVES = "train_step, eval_step, eval_loss, sw.checkpoint.save and load, pipe.relayout"


class History:
    """The kinds of this process's collective calls in order (run-length: a million steps are one run)."""

    def __init__(self) -> None:
        self.runs: list[list[object]] = []  # [kind, how many in a row]
        self.count = 0
        self.depth = 0  # calls inside calls (eval_loss runs an eval_step) count once, as the outer one
        self.ended = False

    def enter(self, kind: str) -> None:
        self.count += 1
        if self.runs and self.runs[-1][0] == kind:
            self.runs[-1][1] = int(self.runs[-1][1]) + 1  # type: ignore[call-overload]
        else:
            self.runs.append([kind, 1])

    def kind_at(self, n: int) -> str | None:
        """The kind of call number ``n`` (1-based), or None outside the history."""
        if n < 1 or n > self.count:
            return None
        last = self.count
        for kind, times in reversed(self.runs):
            first = last - int(times) + 1  # type: ignore[call-overload]
            if n >= first:
                return str(kind)
            last = first - 1
        return None

    def published(self) -> str:
        """``"<count> <kind> <in|after|ended>"``: what a peer compares its own history with."""
        kind = str(self.runs[-1][0]) if self.runs else "-"
        state = "ended" if self.ended else "in" if self.depth else "after"
        return f"{self.count} {kind} {state}"


class Divergence(NamedTuple):
    """What :func:`judge` found: whether the peer's script ended (a closed connection then is no death), and
    the message."""

    ended: bool
    words: str


_histories: dict[str, History] = {}  # by scope: one pipeline's calls (its ranks make them; others need not)


@contextmanager
def call(kind: str, scope: str) -> Iterator[None]:
    """Count this process's entry into a collective call of ``kind`` (a key of :data:`NAMES`) of the pipeline
    ``scope`` names (its guard's :attr:`~.guard.Guard.scope`: alike on its ranks, another on other pipelines')."""
    history = _histories.setdefault(scope, History())
    if history.depth == 0:
        history.enter(kind)
    history.depth += 1
    try:
        yield
    finally:
        history.depth -= 1


def published() -> dict[str, str]:
    """By scope, what a peer compares with (:meth:`History.published`)."""
    return {scope: h.published() for scope, h in list(_histories.items())}


def current(scope: str) -> History:
    return _histories.get(scope) or History()


def ended() -> None:
    """The script ended cleanly: a peer still waiting on this process is waiting on a script that has ended."""
    for h in list(_histories.values()):
        h.ended = True


def reset() -> None:
    """A new membership begins (an in-place elastic generation: a newcomer counts from zero, as do the others)."""
    _histories.clear()


def judge(mine: History, peer: str, value: str, me: str) -> Divergence | None:
    """The divergence ``peer``'s published ``value`` shows against ``mine`` while ``me`` waits, or None.

    Only what cannot be a peer merely behind or ahead: a peer whose script ended while this rank is inside a
    call it has not made, or whose n-th call is another than this rank's n-th.
    """
    try:
        count_s, kind, state = value.split()
        count = int(count_s)
    except ValueError:
        return None
    if mine.count == 0 or not mine.depth:
        return None
    now = mine.kind_at(mine.count)
    assert now is not None
    rule = f"{_COLLECTIVES} are collectives: make each call on every rank, as many times and in the same order"
    theirs, here = NAMES.get(kind, kind), NAMES[now]
    if state == "ended":
        if count >= mine.count:
            return None
        made = f"{count} collective call{'s' if count != 1 else ''}" + (f", the last a {theirs}" if count else "")
        said = f"{peer}'s script ended after {made}, while {me} waits in its {_nth(mine.count)}, a {here}: {rule}"
        return Divergence(True, said)
    if count > mine.count or count == 0:
        return None  # ahead: it waits on this rank, and says so itself if it must
    before = NAMES.get(mine.kind_at(count) or "", "")
    if before == theirs:
        return None
    where = "is in" if state == "in" else "has made"
    if count == mine.count:
        said = f"{peer} {where} {theirs} while {me} waits in {here} (the {_nth(count)} of each): {rule}"
        return Divergence(False, said)
    return Divergence(
        False,
        f"{peer} {where} {theirs} as its {_nth(count)}, where {me} made a {before}; {me} waits in its "
        f"{_nth(mine.count)}, a {here}: {rule}",
    )


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix} collective call"
