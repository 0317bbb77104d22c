"""The worker side of the torchrun suites: what a check runs in, and the entry that runs one module's checks.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks runtime_checks --out DIR

(with ``PYTHONPATH=tests``, as pytest hands on its ``pythonpath``: the checks import ``helpers``).
``--checks`` names a module beside this file whose ``checks(world[, suite])`` returns ``{name: check}``;
each check is called with a :class:`Ctx` and returns None or a JSON-able dict (``info``) that the pytest
side (``helpers.torchrun``) may inspect. One JSON line per check and rank. ``--checks a,b`` runs several modules'
checks in one job (one process start, torch import and gloo setup for all), each named ``module:check``, in
``--only``'s order.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw

__all__ = ["Check", "Ctx", "gather_objects", "main", "raises", "refused"]


@dataclass
class Ctx:
    """A check's rank and world size; ``group``: the pipeline group (None = WORLD)."""

    rank: int
    world: int
    group: Any = None


#: a check: called on every rank with its context; returns None or plain data for the pytest side
Check = Callable[[Ctx], "dict[str, Any] | None"]


def gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (pickled: the checks compare the ranks' own reports; the library sends plain data)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raises(kind: type[BaseException], words: str | Sequence[str], fn: Callable[[], Any]) -> str:
    """``fn()`` must raise ``kind`` with each of ``words`` in its message (pytest.raises, on a rank); the message."""
    words = [words] if isinstance(words, str) else list(words)
    try:
        fn()
    except kind as err:
        for w in words:
            assert w in str(err), f"expected {w!r} in: {err}"
        return str(err)
    raise AssertionError(f"no {kind.__name__} (expected one naming {words})")


def refused(build: Callable[[Ctx], Any], match: str) -> Check:
    """A check: ``build(ctx)`` raises a ValueError naming ``match``, on every rank."""

    def check(ctx: Ctx) -> None:
        raises(ValueError, match, lambda: build(ctx))

    return check


def _checks(modules: list[str], world: int, suite: str | None) -> dict[str, Check]:
    """Every named module's checks in order; prefixed ``module:`` when there are several."""
    if len(modules) > 1 and suite is not None:
        raise SystemExit("--suite takes one module of checks")
    todo: dict[str, Check] = {}
    for name in modules:
        module = importlib.import_module(name)
        got = module.checks(world) if suite is None else module.checks(world, suite)
        todo |= got if len(modules) == 1 else {f"{name}:{check}": fn for check, fn in got.items()}
    return todo


def _per_transport(todo: dict[str, Check], transports: list[str], only: list[str] | None) -> dict[str, Check]:
    """Each check once per transport, named ``transport:check``, STAGEWISE_TRANSPORT set to it while it runs (one job
    for every transport: helpers.torchrun.suite_per_transport); in ``only``'s order (of those names) when given."""
    every = {f"{t}:{name}": _under(t, fn) for t in transports for name, fn in todo.items()}
    return every if only is None else {k: every[k] for k in only if k in every}


def _under(transport: str, check: Check) -> Check:
    def run(ctx: Ctx) -> dict[str, Any] | None:
        os.environ["STAGEWISE_TRANSPORT"] = transport  # read by every pipeline built after (comm/choose_transport.py)
        return check(ctx)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", required=True, help="module(s) beside this file that define checks(), by commas")
    parser.add_argument("--suite", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--transports", default="", help="run every check once per transport named, by commas")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = sw.init(backend="gloo", timeout=timedelta(seconds=args.timeout))
    todo = _checks(args.checks.split(","), env.world_size, args.suite)
    if args.transports:
        todo = _per_transport(todo, args.transports.split(","), args.only.split(",") if args.only else None)
    elif args.only:  # several modules (a shared job): in --only's order, which runs what leaves state behind last
        only = args.only.split(",")
        order = only if "," in args.checks else list(todo)
        todo = {k: todo[k] for k in order if k in todo and k in only}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rank{env.rank}.jsonl", "w") as f:
        for name, check in todo.items():
            started, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            info = None
            try:
                info = check(Ctx(env.rank, env.world_size))
                ok, detail = True, ""
            except BaseException:  # recorded, and the next check runs
                ok, detail = False, traceback.format_exc()[-4000:]
            now = resource.getrusage(resource.RUSAGE_SELF)
            row = {"check": name, "ok": ok, "detail": detail, "info": info, "seconds": time.perf_counter() - started}
            row |= {"user": now.ru_utime - used.ru_utime, "sys": now.ru_stime - used.ru_stime}
            f.write(json.dumps(row) + "\n")
            f.flush()
            dist.barrier()
    # Checks that fail on purpose leave receives behind that will never complete; skip the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    # run as the module ``worker`` that the checks import, so that the entry and the checks share one Ctx class
    importlib.import_module("worker").main()
