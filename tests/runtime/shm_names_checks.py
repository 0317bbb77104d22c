"""A process that uses the shm slot protocol and then dies holding names, or ends cleanly.

    python shm_names_checks.py hold PREFIX    # names left in /dev/shm, prints "ready", sleeps until killed
    python shm_names_checks.py clean PREFIX   # two threads exchange values, close; prints what is still tracked
    python shm_names_checks.py spawned PREFIX # the same with the sender a multiprocessing "spawn" child

``hold``: rank 0's channels (its doorbell and rank 1's, never forgotten) and one value sent to rank 1, never
taken: the slot's name stays. ``clean``: as the transport runs, every name goes and is unregistered, so the
resource tracker has nothing to clean up (and prints nothing) when the process ends. ``spawned``: a child
started by ``multiprocessing`` shares its parent's tracker, so each name must be registered by one side only
(the tracker keeps a name once: a second unregistration is a KeyError in it).
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time

import torch

from stagewise.runtime.comm.shm.names import tracked
from stagewise.runtime.comm.shm.slots import Channels


def never(started: float, what: str, peer: int) -> None:
    """A check that never stops a wait."""


def hold(prefix: str) -> None:
    ch = Channels(prefix, 0, 2, never)
    ch.send(1, 0, 0, torch.arange(6, dtype=torch.float64), "a value")
    print("ready", flush=True)
    time.sleep(600)


ROUNDS, TAGS = 3, 4


def send(ch: Channels) -> None:
    """Rank 1 of the pair (or the thread playing it) sends ROUNDS x TAGS values to rank 0."""
    for r in range(ROUNDS):
        for tag in range(TAGS):
            ch.send(0, tag, 0, torch.full((3,), float(r * TAGS + tag)), f"value {tag}")
            ch.ring(0)


def receive(ch: Channels) -> None:
    for r in range(ROUNDS):
        for tag in range(TAGS):
            work = ch.expect(1, tag, 0, torch.empty(3))
            ch.complete(work, f"value {tag}")
            assert torch.equal(work.tensor, torch.full((3,), float(r * TAGS + tag))), (r, tag, work.tensor)


def clean(prefix: str) -> None:
    a, b = Channels(prefix, 0, 2, never), Channels(prefix, 1, 2, never)
    sender = threading.Thread(target=send, args=(b,))
    sender.start()
    receive(a)
    sender.join()
    a.forget_names()
    b.forget_names()
    a.close(everything=False)
    b.close(everything=False)
    print("tracked:", sorted(tracked()), flush=True)


def _child(prefix: str) -> None:
    ch = Channels(prefix, 1, 2, never)
    send(ch)
    ch.close(everything=False)
    if tracked():
        raise SystemExit(f"the child still tracks {sorted(tracked())}")


def spawned(prefix: str) -> None:
    ch = Channels(prefix, 0, 2, never)  # both doorbells exist before the child opens them
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(prefix,))
    child.start()
    receive(ch)
    child.join(120)
    assert child.exitcode == 0, child.exitcode
    ch.forget_names()
    ch.close(everything=False)
    print("tracked:", sorted(tracked()), flush=True)


if __name__ == "__main__":
    {"hold": hold, "clean": clean, "spawned": spawned}[sys.argv[1]](sys.argv[2])
