"""A machine that comes back, or a spare, joins a running in-place job: nobody restarts, it takes the
committed step's state from the live members.

The same store as :mod:`.membership` (``stagewise rendezvous``'s, the job's prefix), the same primitives only
(``set``, ``compare_set``, ``check``, ``get``, ``wait``):

* ``gen0/members``: generation 0's ids (written before ``generation``): a newcomer's ids start above them;
* ``id/<n>``: an id claimed by a newcomer (``compare_set`` on an empty key: first claim wins); ids are never
  given twice, so a newcomer never takes the id of a live member or of a fenced or lost one;
* ``gen<g+1>/joiners``: the newcomers asking for generation g+1 (a list, appended by ``compare_set``);
  ``gen<g>/grow``: set by a newcomer once every newcomer of its machine asked, it asks the members of
  generation g to make room (a proposal takes in as many newcomers as leave a size the layout can use);
* ``gen<g>/grow_at``: the step generation g ends after. Each member looks at ``gen<g>/grow`` once per step
  (one ``check``, between steps); the first to see it proposes its step + :data:`MARGIN` (``compare_set``), and
  every member ends the generation after that step. Why a margin of 2 is enough: every rank ends a step in
  exchanges that reach the whole world (the loss and the non-finite check over the pipeline group, the
  gradients over the replicas), so no member is more than one step ahead of another, and the member that
  proposes saw the key at most one step later than any other;
* then, after that step (whose snapshot every member finished: the committed step), the members agree on
  generation g+1 as after a loss (:meth:`.membership.Membership.next`, which takes the joiners in), meet in its
  process group, and every member - the newcomer too, with an empty memory folder - resumes the committed
  step from the snapshots. The step in flight is never lost: the change happens between steps;
* ``ended``: written when the members' ``run`` returns: a newcomer still waiting leaves (exit status 0).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..comm.machine import MACHINE_ENV
from . import membership as ms

log = logging.getLogger(__name__)

JOIN_ENV = "STAGEWISE_JOIN"  # set (by ``stagewise run --in-place`` on a machine that finds its job running)
IDS_ENV = "STAGEWISE_JOIN_IDS"  # this machine's newcomers' ids ("6,7"; set by the agent): they ask together
TOGETHER_S = 60.0  # the most a newcomer waits for its machine's others to ask before the members make room
MARGIN = 2  # steps between the first member seeing a request and the generation's end
_POLL_S = 0.05


def job_running(store: Any) -> bool:
    """Whether the job on ``store`` runs (generation 0 started and its members' ``run`` did not end)."""
    return bool(store.check(["generation"])) and not store.check(["ended"])


def claim_ids(store: Any, count: int, timeout: float = 60.0) -> list[int]:
    """``count`` fresh ids, never given before in this job: above generation 0's, each claimed on the store."""
    store.wait(["gen0/members"], _seconds(timeout))
    n = max(json.loads(store.get("gen0/members"))) + 1
    token, taken = secrets.token_hex(8), list[int]()
    while len(taken) < count:
        if store.compare_set(f"id/{n}", "", token).decode() == token:
            taken.append(n)
        n += 1
    return taken


def ask(store: Any, me: int, timeout: float, together: Sequence[int] = ()) -> tuple[int, list[int]]:
    """Ask to join and wait until a generation takes ``me`` in; returns (its number, its members). A generation
    decided without ``me`` (a loss agreed first, or the members closed before ``me`` asked): ask the next one.
    ``together``: this machine's newcomers (``me`` among them): the members are asked to make room once every
    one of them asked (or :data:`TOGETHER_S` passed) - else the first to ask would be taken in alone, at a size
    the layout may refuse. Raises :class:`Ended` when the job ended first, TimeoutError after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        g = int(store.get("generation"))
        _append(store, f"gen{g + 1}/joiners", me)
        log.warning("stagewise elastic: worker %d asks to join generation %d (at its next step boundary)", me, g + 1)
        key, asked, room = f"gen{g + 1}/members", time.monotonic(), f"gen{g}/grow"
        while not store.check([key]):
            if not store.check([room]) and (_all_asked(store, g, together) or time.monotonic() - asked > TOGETHER_S):
                store.set(room, "1")
            if store.check(["ended"]):
                raise Ended(f"the job ended (step {store.get('ended').decode()}) before worker {me} could join")
            if time.monotonic() > end:
                raise TimeoutError(f"worker {me} was not taken into the job within {timeout:g} s")
            time.sleep(_POLL_S)
        members = [int(m) for m in json.loads(store.get(key))]
        if me in members:
            return g + 1, members


def _all_asked(store: Any, g: int, together: Sequence[int]) -> bool:
    """Whether every one of ``together`` not yet a member of generation ``g`` asked for ``g + 1``."""
    inside = json.loads(store.get(f"gen{g}/members")) if store.check([f"gen{g}/members"]) else []
    key = f"gen{g + 1}/joiners"
    asked = json.loads(store.get(key)) if store.check([key]) else []
    return all(i in asked for i in together if i not in inside)


def newcomer(
    store: Any, me: int, deadline_s: float, timeout: float, silent_s: float = 2.0, together: Sequence[int] = ()
) -> ms.Membership:
    """This worker's membership once a generation took it in (its barrier passed; see :func:`ask`)."""
    g, members = ask(store, me, timeout, together)
    m = ms.Membership(store, me, [], silent_s=silent_s, generation=g - 1)
    m.start()
    m.enter(g, members, deadline_s)
    return m


def membership(store: Any, deadline_s: float, timeout: float = 600.0, silent_s: float = 2.0) -> ms.Membership:
    """This worker's membership: generation 0's (RANK of WORLD_SIZE), or a newcomer's (``STAGEWISE_JOIN=1``: its
    id is RANK when the agent claimed it, else claimed here; its machine is named by its first id)."""
    if not os.environ.get(JOIN_ENV):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        m = ms.Membership(store, rank, list(range(world)), silent_s=silent_s).start()
        missing = m.barrier(0, m.members, timeout)  # (workers start seconds apart: imports on a loaded machine)
        if missing:
            raise RuntimeError(f"workers {missing} of generation 0 did not start within {timeout:g} s")
        return m
    me = int(os.environ["RANK"]) if os.environ.get("RANK") else claim_ids(store, 1)[0]
    warm()
    os.environ.setdefault(MACHINE_ENV, str(me))
    together = [int(i) for i in os.environ.get(IDS_ENV, "").split(",") if i]
    try:
        return newcomer(store, me, deadline_s, timeout, silent_s, together)
    except Ended as err:
        log.warning("stagewise elastic: %s; it leaves", err)
        raise SystemExit(0) from None


def warm() -> None:
    """Load, before asking, what a newcomer's first build would load while the members wait for it (they pause
    from the agreed step until its build meets theirs): torch's optimizers import ``torch._dynamo`` when the
    first one is made - 2.8-4 s of a cold build's 4-5 s on a loaded 2-core machine, 0.2 s left after it."""
    import torch._dynamo  # noqa: F401


class Ended(RuntimeError):
    """The job's members finished before a newcomer was taken in."""


@dataclass
class Joins:
    """The members' side: whether the generation ends after this step to take newcomers in (one ``check`` per
    step until some newcomer asks; then the agreed step)."""

    store: Any
    generation: int = -1
    at: int | None = None

    def due(self, generation: int, step: int) -> bool:
        """After ``step`` of ``generation``: True when this generation ends here to take newcomers in."""
        if generation != self.generation:
            self.generation, self.at = generation, None
        if self.at is None:
            if not self.store.check([f"gen{generation}/grow"]):
                return False
            self.at = int(self.store.compare_set(f"gen{generation}/grow_at", "", str(step + MARGIN)).decode())
            if self.at < step:
                raise RuntimeError(
                    f"generation {generation} was agreed to end after step {self.at} to take newcomers in, but this "
                    f"member is at step {step} already (members more than {MARGIN - 1} step apart)"
                )
        return step >= self.at


def between_steps(job: Any, step: int, last: bool, record: Callable[..., Any]) -> None:
    """The in-place loop's one call between steps (``job``: :class:`..relayout.generation.InPlace`; ``record``:
    its record of a change of members): at the last step the job says it ended; otherwise newcomers are taken
    in when their generation's agreed step came."""
    if last:
        job.store.set("ended", str(step))
        return
    if job.joins is None:
        job.joins = Joins(job.store)
    if job.joins.due(job.generation, step):
        grow(job, step, record)


def grow(job: Any, step: int, record: Callable[..., Any]) -> None:
    """End the generation after ``step`` (committed: its snapshot finished everywhere) and go on in the next one,
    its members with the newcomers, every one from the committed step's state."""
    started = time.perf_counter()
    before = job.members
    members, parts = job.take_in(step)  # the snapshot of ``step`` committed, the pipeline dropped, the next entered
    seconds = time.perf_counter() - started
    job.recoveries.append(record(job.generation, members, step, job.step, seconds, parts, cause="joined"))
    (log.warning if job.speaks_for_machine(members) else log.info)(  # one line per machine, not per worker
        "stagewise elastic: generation %d: workers %s joined (members %s, %d processes); going on from step %d "
        "after %.1f s",
        job.generation,
        sorted(set(members) - set(before)),
        members,
        len(members),
        job.step,
        seconds,
    )
    if job.after_recovery is not None:
        job.after_recovery(job)


def _append(store: Any, key: str, me: int) -> None:
    """``me`` added to the list at ``key`` (``compare_set`` until no other writer came between)."""
    while True:
        now = store.get(key).decode() if store.check([key]) else ""
        listed = json.loads(now) if now else []
        if me in listed:
            return
        if store.compare_set(key, now, json.dumps([*listed, me])).decode() == json.dumps([*listed, me]):
            return


def _seconds(timeout: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=timeout)
