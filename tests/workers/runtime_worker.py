"""Run one suite of runtime checks on every rank of a torchrun job; one JSON line per check and rank.

torchrun --standalone --nproc-per-node 2 tests/workers/runtime_worker.py --suite features --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import runtime_checks  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stagewise as sw  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = sw.init(backend="gloo", timeout=timedelta(seconds=90))
    checks = runtime_checks.checks(env.world_size, args.suite)
    if args.only:
        checks = {k: v for k, v in checks.items() if k in args.only.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"rank{env.rank}.jsonl", "w") as f:
        for name, check in checks.items():
            started = time.perf_counter()
            try:
                check(runtime_checks.Ctx(env.rank, env.world_size))
                ok, detail = True, ""
            except BaseException:  # recorded, and the next check runs
                ok, detail = False, traceback.format_exc()[-4000:]
            seconds = time.perf_counter() - started
            f.write(json.dumps({"check": name, "ok": ok, "detail": detail, "seconds": seconds}) + "\n")
            f.flush()
            dist.barrier()
    # Checks that fail on purpose leave receives behind that will never complete; skip the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
