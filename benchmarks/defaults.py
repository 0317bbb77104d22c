"""Defaults that pay (issue 49 item 1): every synchronous schedule with the default cut against its best cut.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.defaults --out out/defaults          # 4 workloads, 2 ranks
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.defaults --quick --out out/defaults  # smoke run

On 2 ranks of one thread, per workload (the fidelity benchmark's three, and a tapered MLP no test tunes to) and
per registered synchronous schedule (v = 2 where it takes virtual stages, 8 micro-batches), five pipelines
of the same layers: the default options (``partition`` not given, no sample inputs: the cut by parameters
refined for the schedule), the default with ``sample_inputs`` (the work counted on the meta device), and
``"uniform"``, ``"parameters"``, ``"time"``. They take turns, round by round; a timed step starts from a
barrier and is the slowest rank's ``train_step``; the median over the steps is the figure. The table gives
each default's step over the best of the three named cuts (the goal: within 2 % or the spread), and the named
schedule's step over 1F1B's, both with defaults. Writes ``defaults.json`` and ``defaults.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from ._launch import launched, on_ranks, timed_step

CUTS = ("default", "default+sample", "uniform", "parameters", "time")


def dense(a: int, b: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(a, b), nn.ReLU())


def mlp_layers() -> Any:
    """A tapered MLP (widths 1024 down to 32, 11 layers): the model no test tunes to."""
    from torch import nn

    import stagewise as sw

    widths = [256, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 32]
    layers: list[Any] = [sw.Layer(dense, a, b) for a, b in zip(widths, widths[1:])]
    return [*layers, sw.Layer(nn.Linear, 32, 10)]


def workload(name: str) -> tuple[Any, Any, Any, int]:
    """(layers factory, loss, data(samples), micro-batch samples)."""
    import torch
    import torch.nn.functional as F

    if name == "mlp":

        def data(n: int) -> Any:
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)

        return mlp_layers, F.cross_entropy, data, 16
    from .fidelity.workloads import workloads

    w = workloads()[name]
    return w.layers, w.loss, w.data, w.microbatch


def build(name: str, schedule: str, cut: str, m: int) -> Any:
    import stagewise as sw

    layers, loss, data, b = workload(name)
    x, _ = data(b)
    allowed = sw.schedule_info(schedule).virtual_stages
    v = 2 if allowed is None or 2 in allowed else None
    extra: dict[str, Any] = {}
    if cut == "default+sample":
        extra["sample_inputs"] = x
    elif cut != "default":
        extra["partition"] = cut
        extra["sample_inputs"] = x
    return sw.Pipeline(layers(), loss_fn=loss, schedule=schedule, microbatches=m, virtual_stages=v, **extra)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    schedules = args.schedules or sw.schedule_names(synchronous=True)
    out: dict[str, Any] = {}
    for name in args.workloads:
        _, _, data, b = workload(name)
        x, y = data(b * args.microbatches)
        for schedule in schedules:
            try:
                pipes = {cut: build(name, schedule, cut, args.microbatches) for cut in CUTS}
            except ValueError as err:  # too few layers for the schedule's stages
                out[f"{name} {schedule}"] = {"refused": str(err)}
                continue
            steps: dict[str, list[float]] = {cut: [] for cut in CUTS}
            for r in range(args.rounds):
                for cut, pipe in pipes.items():
                    if r == 0:
                        timed_step(pipe, x, y)  # warm-up
                    steps[cut] += [timed_step(pipe, x, y) for _ in range(args.steps)]
            out[f"{name} {schedule}"] = {
                "steps": steps,
                "counts": {cut: [len(r) for r in p.layer_ranges] for cut, p in pipes.items()},
            }
            del pipes
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "defaults.json").write_text(json.dumps({"results": out, "load": os.getloadavg()}))
        (args.out / "defaults.md").write_text(table(out))
        print(table(out))
    dist.destroy_process_group()


def table(out: dict[str, Any]) -> str:
    rows = ["| workload, schedule | default / best | default+sample / best | best of | vs 1F1B (default) | cuts |",
            "|---|---:|---:|---|---:|---|"]  # fmt: skip
    med = {k: {c: statistics.median(s) for c, s in v["steps"].items()} for k, v in out.items() if "steps" in v}
    for key, v in out.items():
        if key not in med:
            rows.append(f"| {key} | refused | | | | {v['refused'][:60]} |")
            continue
        m = med[key]
        best = min(("uniform", "parameters", "time"), key=lambda c: m[c])
        base = med.get(f"{key.split()[0]} 1f1b", {}).get("default")
        vs = f"{m['default'] / base:.3f}" if base else ""
        rows.append(
            f"| {key} | {m['default'] / m[best]:.3f} | {m['default+sample'] / m[best]:.3f} | {best} | {vs} "
            f"| {v['counts']['default']} / {v['counts']['default+sample']} / {v['counts'][best]} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/defaults"))
    parser.add_argument("--workloads", nargs="+", default=["gpt64", "gpt256", "resnet", "mlp"])
    parser.add_argument("--schedules", nargs="*", default=None, help="default: every synchronous schedule")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per pipeline per round")
    parser.add_argument("--quick", action="store_true", help="gpt64, 1f1b and zb-v, 1 round of 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.workloads, args.schedules, args.rounds, args.steps = ["gpt64"], ["1f1b", "zb-v"], 1, 2
    if launched():
        rank_main(args)
        return 0
    return on_ranks(2, "benchmarks.defaults", sys.argv[1:] if argv is None else argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
