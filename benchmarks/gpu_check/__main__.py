"""The GPU check (issue 34): the CUDA paths run, measured, in one table, in under 8 minutes on an H100.

    python -m benchmarks.gpu_check                 # on the CUDA device (prints "no CUDA device" without one)
    python -m benchmarks.gpu_check --device cpu    # every part at small sizes on the CPU: the code paths
    make gpu-check

(a) float64 parity of several stages on one rank, and of two processes sharing the device over gloo
(:mod:`.parity`); (b) the host synchronisations of a steady step, under ``torch.cuda.set_sync_debug_mode``
(:mod:`.steady`); (c) bfloat16 throughput of a GPT-2-small-sized model, a 1-rank pipeline of 4 virtual
stages against the plain loop (:mod:`.speed`); (d) peak memory per schedule against the simulator and the
planner (:mod:`.memory`); (e) optimizer-state offload: device memory saved, step time lost (:mod:`.offload`).
One table at the end (markdown, for benchmarks/RESULTS.md), each row with its target and whether it was met.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from .._launch import launched
from .common import Row, Sizes

PARTS = "abcde"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu (small sizes)")
    p.add_argument("--parts", default=PARTS, help=f"which parts to run, a subset of {PARTS!r}")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row misses its target")
    p.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)  # (a)'s two processes, under torchrun
    return p.parse_args(argv)


def run_part(part: str, sizes: Sizes, device: torch.device) -> list[Row]:
    from . import memory, offload, parity, speed, steady

    module = {"a": parity, "b": steady, "c": speed, "d": memory, "e": offload}[part]
    started = time.perf_counter()
    try:
        rows = module.run(sizes, device)
    except Exception as err:  # noqa: BLE001 - a part that breaks is a row of the table, the others still run
        text = "".join(traceback.format_exception_only(type(err), err)).strip().replace("\n", " ")
        rows = [Row(part, "the part raised", text[:300], "", False)]
    for row in rows:
        row.detail["seconds"] = round(time.perf_counter() - started, 1)
    return rows


def table(rows: list[Row], device: torch.device, seconds: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    head = (
        f"gpu_check on {name} ({device.type}), torch {torch.__version__}, {datetime.date.today()}, "
        f"{seconds:.0f} s in all"
    )
    lines = [head, "", "| part | check | measured | target | met |", "|---|---|---|---|---|"]
    mark = {True: "yes", False: "**no**", None: ""}
    for r in rows:
        lines.append(f"| {r.part} | {r.check} | {r.measured} | {r.target} | {mark[r.ok]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.pair and launched():
        from .parity import pair_worker

        pair_worker(args.device, str(args.out))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    import stagewise as sw

    env = sw.init(backend="nccl" if args.device == "cuda" else "gloo")
    device = env.device
    sizes = Sizes.of(device)
    started = time.perf_counter()
    rows = [row for part in args.parts for row in run_part(part, sizes, device)]
    print(table(rows, device, time.perf_counter() - started))
    if args.out is not None:
        args.out.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 1 if args.strict and any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
