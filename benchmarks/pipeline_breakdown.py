"""Where a stagewise step's time goes, per rank, against the ideal's stage costs (issue 16, part 3).

    .venv/bin/python -m benchmarks.pipeline_breakdown --ranks 2 --configs overhead small --schedules zb-v dualpipe-v

One torchrun job per config (the same model, cut and stage-cost measurement
as ``benchmarks.pipeline_vs_torch``, whose worker's parts it uses; stagewise
only, one transport). Each rank runs the warm-up steps, then the timed
steps, and after each one reads the step's measured timeline (``Pipeline.timeline()``: every action of the
rank, a compute action timed from the moment its input was there). Per
rank, medians over the timed steps:

* *step*: wall time of ``train_step`` on this rank; *CPU*: its process CPU time;
* per compute kind (F, I, W, B): measured ms per step, and the ideal's, that
  is the same actions costed with the stage times ``benchmarks.pipeline_vs_torch``
  feeds its simulator (``RankCompute``, measured between the timed steps);
* *comm*: time posting sends and receives (SEND/RECV actions), and per message;
* *other*: SYNC / STEP actions;
* *gaps*: the rest of the action list's span, between actions: waiting for a
  value from the other rank plus the interpreter's own time between actions;
* *head* / *tail*: before the first action (splitting micro-batches, posting
  the step's receives) and after the last (waiting for the sends, the check of
  non-finite gradients, the loss broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ._launch import environ, torchrun

COMPUTE = ("F", "B", "I", "W")


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from .pipeline_vs_torch.model import SCHEDULES, stages_of_rank
    from .pipeline_vs_torch.worker import rank_compute, stagewise_step, start_rank

    rank, p, cfg, x, y = start_rank(args.config)
    out: dict[str, Any] = {}
    for name in ",".join(args.schedules).split(","):
        step, pipe = stagewise_step(cfg, name, rank, p, x, y, transport=args.transport)
        for _ in range(args.warmup):
            step()
        compute = rank_compute(cfg, name, rank, p)
        local = stages_of_rank(SCHEDULES[name][1], rank, p, SCHEDULES[name][2])
        steps = []
        for _ in range(args.steps):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tl = pipe.timeline()
            steps.append({"wall": wall, "cpu": cpu, "events": [[str(e.action), e.start, e.end] for e in tl.events]})
            dist.barrier()
            compute.sample()
        costs = {s: [c.forward, c.backward_input, c.backward_weight] for s, c in zip(local, compute.costs())}
        out[name] = {"steps": steps, "costs": costs}
        dist.barrier()
    everyone: list[Any] = [None] * p
    dist.all_gather_object(everyone, out)
    if rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
    dist.barrier()
    os._exit(0)


def summarize(rank: int, name: str, data: dict[str, Any]) -> list[str]:
    from stagewise.ir import parse_action

    costs = {int(s): c for s, c in data["costs"].items()}
    rows: dict[str, list[float]] = {}
    counts: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for st in data["steps"]:
        per: dict[str, float] = {k: 0.0 for k in (*COMPUTE, "comm", "other")}
        ideal: dict[str, float] = {k: 0.0 for k in COMPUTE}
        n_comm = 0
        events = sorted(st["events"], key=lambda e: e[1])
        covered = 0.0
        for text, t0, t1 in events:
            a = parse_action(text)
            kind = str(a.kind)
            dur = t1 - t0
            covered += dur
            if kind in COMPUTE:
                per[kind] += dur
                f, i, w = costs[a.stage]
                ideal[kind] += {"F": f, "I": i, "W": w, "B": i + w}[kind]
            elif a.kind.is_comm:
                per["comm"] += dur
                n_comm += 1
            else:
                per["other"] += dur
        span_start, span_end = events[0][1], max(e[2] for e in events)
        add("step", st["wall"])
        add("cpu", st["cpu"])
        for k in per:
            add(k, per[k])
        for k in ideal:
            add("ideal " + k, ideal[k])
        add("gaps", (span_end - span_start) - covered)
        add("head", span_start)
        add("tail", st["wall"] - span_end)
        counts["comm"] = n_comm
    med = {k: statistics.median(v) for k, v in rows.items()}
    ms = lambda k: f"{med[k] * 1e3:.1f}"  # noqa: E731
    cells = []
    for k in COMPUTE:
        if med["ideal " + k] > 0 or med[k] > 0:
            r = med[k] / med["ideal " + k] if med["ideal " + k] else float("nan")
            cells.append(f"{k} {ms(k)} / {ms('ideal ' + k)} ({r:.2f})")
    per_msg = med["comm"] / counts["comm"] * 1e6 if counts.get("comm") else 0.0
    compute = sum(med[k] for k in COMPUTE)
    ideal_c = sum(med["ideal " + k] for k in COMPUTE)
    return [
        f"| {name} | {rank} | {ms('step')} | {ms('cpu')} | {compute * 1e3:.1f} / {ideal_c * 1e3:.1f} | "
        + "; ".join(cells)
        + f" | {ms('comm')} ({counts.get('comm', 0)} x {per_msg:.0f} us) | {ms('other')} | {ms('gaps')} | "
        f"{ms('head')} | {ms('tail')} |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["overhead", "small"])
    parser.add_argument("--schedules", nargs="+", default=["zb-v", "dualpipe-v"])
    parser.add_argument("--transport", default="shm", choices=["shm", "torch"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"load average {os.getloadavg()[0]:.2f}; transport {args.transport}; {args.ranks} ranks\n")
    head = (
        "| schedule | rank | step ms | CPU ms | compute ms measured / ideal | per kind: measured / ideal ms (ratio) "
        "| comm ms (msgs x per msg) | SYNC+STEP ms | gaps ms | head ms | tail ms |"
    )
    for cfg in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            flags = [
                "--worker", f"--config={cfg}", f"--schedules={','.join(args.schedules)}",
                f"--transport={args.transport}", f"--warmup={args.warmup}", f"--steps={args.steps}", f"--out={out}",
            ]  # fmt: skip
            cmd = torchrun(args.ranks, "benchmarks.pipeline_breakdown", flags, options=["--max-restarts=0"])
            env = environ(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            if not out.exists():
                raise RuntimeError((proc.stdout + proc.stderr)[-4000:])
            everyone = json.loads(out.read_text())
        print(f"{cfg}:\n\n{head}\n|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        for name in args.schedules:
            for rank, data in enumerate(everyone):
                print("\n".join(summarize(rank, name, data[name])))
        print()
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
