"""Why an in-place generation makes torch's default group again: what survivors can do in the old one.

    .venv/bin/python -m benchmarks.default_group

Three processes meet in a gloo default group under ``gen0/pg/`` of one TCP store; process 2 leaves at once
(``os._exit``: a lost machine). The two survivors then try, and print with the seconds each took: a group of
the members made in the old default group (torch's world barrier, and ``use_local_synchronization``), what
``dist.get_world_size()`` answers there, a group made with no default group at all, and the way
``sw.runtime.InPlace`` takes (destroy the old default group, make the members' under ``gen1/pg/``, then the
take-over's fresh gloo group in it). The reading is in docs/design/elastic-membership.md ("The groups of a
generation"). Seconds on a loaded machine are noisy: the facts are the errors and the world sizes.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_WAIT = timedelta(seconds=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(out: dict[str, str], what: str, fn: Any) -> None:
    started = time.perf_counter()
    try:
        said = fn()
        out[what] = f"done in {time.perf_counter() - started:.3f} s" + (f"; {said}" if said else "")
    except Exception as err:  # the fact measured: which call torch refuses, and how
        out[what] = f"{type(err).__name__} after {time.perf_counter() - started:.1f} s: {str(err)[:120]}"


def _member(rank: int, port: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=_WAIT)
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/pg/", store), rank=rank, world_size=3, timeout=_WAIT)
    if rank == 2:
        os._exit(0)  # lost
    time.sleep(0.5)
    out: dict[str, str] = {}
    _timed(out, "new_group([0, 1]) in the old default group", lambda: dist.new_group([0, 1], timeout=_WAIT) and "")
    _timed(
        out,
        "new_group([0, 1], use_local_synchronization=True)",
        lambda: dist.new_group([0, 1], use_local_synchronization=True) and f"world size {dist.get_world_size()}",
    )
    _timed(out, "destroy the old default group", dist.destroy_process_group)
    _timed(out, "new_group([0, 1]) with no default group", lambda: dist.new_group([0, 1]))
    members = dist.PrefixStore("gen1/pg/", store)
    _timed(
        out,
        "init_process_group of the 2 members under gen1/pg/",
        lambda: (
            dist.init_process_group("gloo", store=members, rank=rank, world_size=2, timeout=_WAIT)
            or f"world size {dist.get_world_size()}"
        ),
    )
    _timed(out, "a fresh gloo group of the members in it", lambda: dist.new_group([0, 1], backend="gloo") and "")
    results.put((rank, out))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)  # (no options: --help says what it does, and starts nothing)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(r, port, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(30)
    for what, said in got[0].items():
        print(f"{what}: {said}")
    print(f"load: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
