"""stagewise vs ``torch.distributed.pipelining``: same model, schedule and rank count, one invocation.

    .venv/bin/python -m benchmarks.pipeline_vs_torch                 # both configs, 2 and 4 ranks
    .venv/bin/python -m benchmarks.pipeline_vs_torch --ranks 2 --configs overhead --schedules 1f1b

For each config and rank count one torchrun job (gloo, one thread per
process) times every schedule both libraries have, taking turns step by step
(see ``worker.py``): torch on its own class; stagewise on each of its
transports (``gloo``: torch.distributed point-to-point; ``shm``: same-host
shared memory), once on stagewise's schedule of that name and once on *torch's
order* of the class (``@torch``: what torch's ``step()`` runs, read with
``stagewise.runtime.torch_order(cls, p, m, v, read="step")``: for the
``_PipelineScheduleRuntime`` classes its compute *and* communication order).
The names pair schedules whose orders can differ (torch's ZBV and DualPipeV
are not stagewise's), so only the ``@torch`` columns compare the two runtimes
on the same order.

Two tables, each saying which order each column ran:

1. *the same order on both runtimes* (torch's): *torch ms*, *gloo@t ms*,
   *shm@t ms* (the median step time: slowest rank, barrier to end); *x gloo*,
   *x shm*: the median, over neighbouring steps, of torch / stagewise (above
   1: stagewise's runtime is faster; neighbours see the same background load);
   *ideal ms* and *eff* for torch's order;
2. *each library's own order*: *torch ms* (torch's order), *gloo ms*, *shm ms*
   (stagewise's), the ratios, and each order's ideal.

*ideal ms*: the larger of the critical path - ``stagewise.simulation`` on the
order, fed each stage's forward / input-grad / weight-grad time - and the
total compute divided by min(ranks, cores). Stage times are medians of CPU
time, measured by each worker between the timed steps on its own stages,
rebuilt outside both libraries, with the backward kernels stagewise runs
(see ``model.RankCompute``); *eff*: ideal / measured step time; *autograd
ideal ms*, *eff shm (autograd)*: the same with PyTorch's own backward as the
stage costs (what torch.distributed.pipelining computes); *CPU ms*: the
busiest rank's process CPU time per step (all threads); *no CPU*: the share of
the step the ranks' main threads were ready to run but had no CPU (another
process or thread had it): on a shared machine, time no runtime can win back.

The header gives the machine and the 1-minute load average before and after
each torchrun job (the benchmark's own ranks count in the latter). A schedule
stagewise (or torch) does not build for the rank and micro-batch counts is
skipped (or its torch-order columns left empty), saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import stagewise as sw

from .._launch import environ, torchrun
from .model import CONFIGS, SCHEDULES, Config, StageCost, torch_schedule

#: per config: schedules run by default, and (warm-up steps, timed steps per library)
DEFAULTS = {
    "overhead": (tuple(SCHEDULES), (2, 10)),
    "compute": (("gpipe", "1f1b", "zb-v"), (1, 4)),
    "small": (tuple(SCHEDULES), (2, 10)),
    "tiny": (tuple(SCHEDULES), (1, 2)),  # a smoke run of every column, not a measurement
}
LIBS = ("torch", "sw-gloo", "sw-shm", "sw-gloo@torch", "sw-shm@torch")
#: the columns that ran torch's order, on each runtime
SAME_ORDER = ("torch", "sw-gloo@torch", "sw-shm@torch")


def ideal(schedule: sw.Schedule, cfg: Config, costs: list[StageCost], cores: int) -> tuple[float, float, float]:
    """(ideal, critical path, compute / cores) in seconds for ``schedule`` under the measured stage costs."""
    model = sw.CostModel.from_dict(
        {
            "num_stages": len(costs),
            "forward": [c.forward for c in costs],
            "backward_input": [c.backward_input for c in costs],
            "backward_weight": [c.backward_weight for c in costs],
        }
    )
    critical = sw.simulate(schedule, model).makespan
    spread = cfg.microbatches * sum(c.total for c in costs) / min(schedule.num_ranks, cores)
    return max(critical, spread), critical, spread


def orders(name: str, p: int, cfg: Config) -> tuple[sw.Schedule, sw.Schedule | None]:
    """stagewise's schedule ``name`` and torch's order of its class (None, saying why, where torch refuses)."""
    ours = sw.build_schedule(name, p, cfg.microbatches, SCHEDULES[name][2])
    try:
        return ours, torch_schedule(name, p, cfg.microbatches)
    except ValueError as err:
        print(f"{cfg.name}: {p} ranks: no torch order for {name}: {err}", file=sys.stderr)
        return ours, None


def run_job(
    cfg: Config, p: int, schedules: list[str], counts: tuple[int, ...], timeout: float, libs: list[str]
) -> dict:
    warmup, steps = counts
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = [f"--config={cfg.name}", f"--schedules={','.join(schedules)}", f"--warmup={warmup}"]
        args += [f"--steps={steps}", f"--out={out}", f"--libs={','.join(libs)}"]
        cmd = torchrun(p, "benchmarks.pipeline_vs_torch.worker", args, options=["--max-restarts=0"])
        env = environ(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if not out.exists():
            raise RuntimeError(f"worker job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        for line in proc.stderr.splitlines():
            if any(f": {lib} " in line for lib in LIBS):
                print("  " + line, file=sys.stderr)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline_vs_torch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--configs", nargs="+", default=["overhead", "small", "compute"], choices=sorted(CONFIGS))
    parser.add_argument("--schedules", nargs="+", help="stagewise names (default: per config)")
    parser.add_argument("--counts", type=int, nargs=2, metavar=("WARMUP", "STEPS"))
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per torchrun job")
    parser.add_argument("--json", type=Path, help="also write every step time here")
    parser.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS, help="what to time (default: all)")
    args = parser.parse_args()

    registered = set(sw.schedule_names())
    started = time.perf_counter()
    loads = [os.getloadavg()[0]]
    rows: list[Row] = []
    raw = []
    for name in args.configs:
        cfg = Config.named(name)
        wanted, counts = DEFAULTS[name]
        wanted = args.schedules or wanted
        missing = [s for s in wanted if s not in registered or s not in SCHEDULES]
        if missing:
            print(f"{name}: skipping {missing} (not registered in stagewise or no torch twin)", file=sys.stderr)
        schedules = [s for s in wanted if s not in missing]
        for p in args.ranks:
            runnable = [s for s in schedules if _supported(s, p, cfg)]
            print(f"{name}: {p} ranks: {', '.join(runnable)} ...", file=sys.stderr, flush=True)
            loads.append(os.getloadavg()[0])
            result = run_job(cfg, p, runnable, tuple(args.counts or counts), args.timeout, args.libs)
            loads.append(os.getloadavg()[0])
            raw.append(result)
            for sched in runnable:
                ours, theirs = orders(sched, p, cfg)
                costs = [StageCost(*c) for c in result["schedules"][sched]["stage_costs"]]
                stock = [StageCost(*c) for c in result["schedules"][sched]["stage_costs_autograd"]]
                ideals = {"stagewise": ideal(ours, cfg, costs, args.cores)}
                if theirs is not None:
                    ideals["torch"] = ideal(theirs, cfg, costs, args.cores)
                autograd = ideal(ours, cfg, stock, args.cores)[0]
                rows.append(Row(name, sched, p, ideals, autograd, result["schedules"][sched]))
    print(f"\n{machine()}, {args.cores} cores; load average {min(loads):.2f}-{max(loads):.2f}; ", end="")
    print(f"{time.perf_counter() - started:.0f} s; torch {torch_version()}\n")
    print("The same order on both runtimes: torch's, as its step() runs it\n")
    print(same_order_table(rows))
    print("\nEach library's own order: torch's class (torch ms) and stagewise's schedule of that name (gloo, shm)\n")
    print(table(rows))
    print("\n" + "\n".join(f"{name}: {Config.named(name).what}" for name in args.configs))
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor() or platform.machine()
    except OSError:
        return platform.processor() or platform.machine()


def torch_version() -> str:
    import torch

    return torch.__version__


def _supported(name: str, p: int, cfg: Config) -> bool:
    """Whether stagewise builds ``name`` for p ranks and the config's micro-batches (else say why)."""
    try:
        sw.build_schedule(name, p, cfg.microbatches, SCHEDULES[name][2])
    except ValueError as err:
        print(f"{cfg.name}: {p} ranks: skipping {name}: {err}", file=sys.stderr)
        return False
    return True


@dataclass
class Row:
    """One schedule at one rank count: each order's bounds, and each library's per-step figures."""

    config: str
    schedule: str
    ranks: int
    ideals: dict[str, tuple[float, float, float]]  # order -> (ideal, critical path, compute / cores)
    autograd: float  # stagewise's order's ideal with PyTorch's own backward as stage costs
    libs: dict

    def ideal(self, order: str) -> float | None:
        return self.ideals[order][0] if order in self.ideals else None

    def median(self, lib: str, key: str = "times") -> float | None:
        values = self.libs.get(lib, {}).get(key)
        return statistics.median(values) if values else None

    def ratio(self, lib: str) -> str:
        a, b = self.libs.get("torch", {}).get("times"), self.libs.get(lib, {}).get("times")
        return f"{statistics.median(x / y for x, y in zip(a, b)):.2f}x" if a and b else "-"

    def no_cpu(self, lib: str) -> str:
        d = self.libs.get(lib, {})
        if not d.get("times"):
            return "-"
        return f"{statistics.median(w / t for w, t in zip(d['waiting'], d['times'])):.0%}"

    def same_order_cells(self) -> list[str]:
        t = self.ideal("torch")
        return [
            self.config,
            self.schedule,
            str(self.ranks),
            *(_ms(self.median(lib)) for lib in SAME_ORDER),
            *(self.ratio(lib) for lib in SAME_ORDER[1:]),
            _ms(t),
            *(_eff(t, self.median(lib)) for lib in SAME_ORDER),
            " / ".join(_ms(self.median(lib, "cpu")) for lib in SAME_ORDER),
            " / ".join(self.no_cpu(lib) for lib in SAME_ORDER),
        ]

    def cells(self) -> list[str]:
        own = ("torch", "sw-gloo", "sw-shm")
        t, ours = self.ideal("torch"), self.ideal("stagewise")
        return [
            self.config,
            self.schedule,
            str(self.ranks),
            *(_ms(self.median(lib)) for lib in own),
            *(self.ratio(lib) for lib in own[1:]),
            _ms(t),
            _ms(ours),
            _eff(t, self.median("torch")),
            _eff(ours, self.median("sw-gloo")),
            _eff(ours, self.median("sw-shm")),
            _ms(self.ideals["stagewise"][1]),
            _ms(self.ideals["stagewise"][2]),
            _ms(self.autograd),
            _eff(self.autograd, self.median("sw-shm")),
            " / ".join(_ms(self.median(lib, "cpu")) for lib in own),
            " / ".join(self.no_cpu(lib) for lib in own),
        ]


def same_order_table(rows: list[Row]) -> str:
    head = (
        "| config | schedule | ranks | torch ms | gloo@t ms | shm@t ms | x gloo | x shm | ideal ms (torch's order) "
        "| eff torch | eff gloo@t | eff shm@t | CPU ms torch / gloo@t / shm@t | no CPU torch / gloo@t / shm@t |"
    )
    lines = [head, "|" + "|".join(["---"] * 3 + ["---:"] * 11) + "|"]
    lines += ["| " + " | ".join(row.same_order_cells()) + " |" for row in rows]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    head = (
        "| config | schedule | ranks | torch ms (torch's order) | gloo ms | shm ms (stagewise's order) | x gloo "
        "| x shm | ideal ms torch's order | ideal ms stagewise's order | eff torch | eff gloo | eff shm "
        "| critical path ms | compute/cores ms | autograd ideal ms | eff shm (autograd) "
        "| CPU ms torch / gloo / shm | no CPU torch / gloo / shm |"
    )
    lines = [head, "|" + "|".join(["---"] * 3 + ["---:"] * 16) + "|"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def _eff(ideal: float, t: float | None) -> str:
    return "-" if t is None else f"{ideal / t:.0%}"


if __name__ == "__main__":
    main()
