"""A process that uses the shm slot protocol and then dies holding names, or ends cleanly.

    python shm_names_checks.py hold PREFIX    # names left in /dev/shm, prints "ready", sleeps until killed
    python shm_names_checks.py clean PREFIX   # two threads exchange values, close; prints what is still tracked

``hold``: rank 0's channels (its doorbell and rank 1's, never forgotten) and one value sent to rank 1, never
taken: the slot's name stays. ``clean``: as the transport runs, every name goes and is unregistered, so the
resource tracker has nothing to clean up (and prints nothing) when the process ends.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from stagewise.runtime.comm.shm_names import tracked
from stagewise.runtime.comm.shm_slots import Channels


def never(started: float, what: str, peer: int) -> None:
    """A check that never stops a wait."""


def hold(prefix: str) -> None:
    ch = Channels(prefix, 0, 2, never)
    ch.send(1, 0, 0, torch.arange(6, dtype=torch.float64), "a value")
    print("ready", flush=True)
    time.sleep(600)


def clean(prefix: str) -> None:
    a, b = Channels(prefix, 0, 2, never), Channels(prefix, 1, 2, never)
    rounds, tags = 3, 4

    def send() -> None:
        for r in range(rounds):
            for tag in range(tags):
                a.send(1, tag, 0, torch.full((3,), float(r * tags + tag)), f"value {tag}")
                a.ring(1)

    sender = threading.Thread(target=send)
    sender.start()
    for r in range(rounds):
        for tag in range(tags):
            work = b.expect(0, tag, 0, torch.empty(3))
            b.complete(work, f"value {tag}")
            assert torch.equal(work.tensor, torch.full((3,), float(r * tags + tag))), (r, tag, work.tensor)
    sender.join()
    a.forget_names()
    b.forget_names()
    a.close(everything=False)
    b.close(everything=False)
    print("tracked:", sorted(tracked()), flush=True)


if __name__ == "__main__":
    {"hold": hold, "clean": clean}[sys.argv[1]](sys.argv[2])
