"""Run one module's checks on every rank of a torchrun job; one JSON line per check and rank.

    torchrun --standalone --nproc-per-node 2 tests/workers/worker.py --checks runtime_checks --out DIR

``--checks`` names a module beside this file with ``checks(world[, suite])``
returning ``{name: check}`` and a ``Ctx(rank, world)``; a check returns None
or a JSON-able dict (``info``) that the pytest side may inspect.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stagewise as sw  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", required=True, help="module beside this file that defines checks()")
    parser.add_argument("--suite", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take")
    args = parser.parse_args()
    module = importlib.import_module(args.checks)
    torch.set_num_threads(1)
    env = sw.init(backend="gloo", timeout=timedelta(seconds=args.timeout))
    todo = module.checks(env.world_size) if args.suite is None else module.checks(env.world_size, args.suite)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rank{env.rank}.jsonl", "w") as f:
        for name, check in todo.items():
            started = time.perf_counter()
            info = None
            try:
                info = check(module.Ctx(env.rank, env.world_size))
                ok, detail = True, ""
            except BaseException:  # recorded, and the next check runs
                ok, detail = False, traceback.format_exc()[-4000:]
            row = {"check": name, "ok": ok, "detail": detail, "info": info, "seconds": time.perf_counter() - started}
            f.write(json.dumps(row) + "\n")
            f.flush()
            dist.barrier()
    # Checks that fail on purpose leave receives behind that will never complete; skip the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
