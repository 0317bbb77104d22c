"""stagewise vs ``torch.distributed.pipelining``: same model, schedule and rank count, one invocation.

    .venv/bin/python -m benchmarks.pipeline_vs_torch                 # both configs, 2 and 4 ranks
    .venv/bin/python -m benchmarks.pipeline_vs_torch --ranks 2 --configs overhead --schedules 1f1b

For each config and rank count one torchrun job (gloo, one thread per
process) times every schedule both libraries have, torch and stagewise on
each of its transports (``gloo``: torch.distributed point-to-point;
``shm``: same-host shared memory) taking turns step by step (see
``worker.py``). Then, per schedule:

* *torch ms*, *gloo ms*, *shm ms*: the median step time (slowest rank, barrier to end);
* *x gloo*, *x shm*: the median, over neighbouring steps, of torch / stagewise
  (above 1: stagewise is faster; neighbours see the same background load);
* *ideal ms*: the larger of the critical path - ``stagewise.simulation.arrays`` on the
  schedule, fed each stage's forward / input-grad / weight-grad time - and the
  total compute divided by min(ranks, cores). Stage times are medians of CPU
  time, measured by each worker between the timed steps on its own stages,
  rebuilt outside both libraries, with the backward kernels stagewise runs
  (see ``model.RankCompute``);
* *eff*: ideal / measured step time, for each;
* *autograd ideal ms*, *eff shm (autograd)*: the same with PyTorch's own
  backward as the stage costs (what torch.distributed.pipelining computes; the
  ideal before stagewise fused its weight-gradient accumulation);
* *CPU ms*: the busiest rank's process CPU time per step (all threads), torch / gloo / shm;
* *no CPU*: the share of the step the ranks' main threads were ready to run
  but had no CPU (another process or thread had it): on a shared machine,
  time no runtime can win back.

The header gives the machine and the 1-minute load average before and after
each torchrun job (the benchmark's own ranks count in the latter).

Both libraries run the same schedule *name*; the ideal is the stagewise
schedule's. A schedule stagewise does not build for the rank and micro-batch
counts is skipped, saying why.
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
from .model import CONFIGS, SCHEDULES, Config, StageCost

#: per config: schedules run by default, and (warm-up steps, timed steps per library)
DEFAULTS = {
    "overhead": (tuple(SCHEDULES), (2, 10)),
    "compute": (("gpipe", "1f1b", "zb-v"), (1, 4)),
    "small": (tuple(SCHEDULES), (2, 10)),
}
LIBS = ("torch", "sw-gloo", "sw-shm")


def ideal(name: str, p: int, cfg: Config, costs: list[StageCost], cores: int) -> tuple[float, float, float]:
    """(ideal, critical path, compute / cores) in seconds for schedule ``name`` on ``p`` ranks."""
    v = SCHEDULES[name][2]
    schedule = sw.build_schedule(name, p, cfg.microbatches, v)
    model = sw.CostModel.from_dict(
        {
            "num_stages": len(costs),
            "forward": [c.forward for c in costs],
            "backward_input": [c.backward_input for c in costs],
            "backward_weight": [c.backward_weight for c in costs],
        }
    )
    critical = sw.simulate(schedule, model).makespan
    spread = cfg.microbatches * sum(c.total for c in costs) / min(p, cores)
    return max(critical, spread), critical, spread


def run_job(cfg: Config, p: int, schedules: list[str], counts: tuple[int, ...], timeout: float) -> dict:
    warmup, steps = counts
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = [f"--config={cfg.name}", f"--schedules={','.join(schedules)}", f"--warmup={warmup}"]
        args += [f"--steps={steps}", f"--out={out}"]
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
            result = run_job(cfg, p, runnable, tuple(args.counts or counts), args.timeout)
            loads.append(os.getloadavg()[0])
            raw.append(result)
            for sched in runnable:
                costs = [StageCost(*c) for c in result["schedules"][sched]["stage_costs"]]
                best, critical, spread = ideal(sched, p, cfg, costs, args.cores)
                stock = [StageCost(*c) for c in result["schedules"][sched]["stage_costs_autograd"]]
                autograd = ideal(sched, p, cfg, stock, args.cores)[0]
                rows.append(Row(name, sched, p, best, critical, spread, autograd, result["schedules"][sched]))
    print(f"\n{machine()}, {args.cores} cores; load average {min(loads):.2f}-{max(loads):.2f}; ", end="")
    print(f"{time.perf_counter() - started:.0f} s; torch {torch_version()}\n")
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
    """One schedule at one rank count: the bounds, and each library's per-step figures."""

    config: str
    schedule: str
    ranks: int
    ideal: float
    critical: float
    spread: float
    autograd: float  # the ideal with PyTorch's own backward as stage costs
    libs: dict

    def median(self, lib: str, key: str = "times") -> float | None:
        values = self.libs.get(lib, {}).get(key)
        return statistics.median(values) if values else None

    def ratio(self, lib: str) -> float | None:
        a, b = self.libs["torch"].get("times"), self.libs.get(lib, {}).get("times")
        return statistics.median(x / y for x, y in zip(a, b)) if a and b else None

    def no_cpu(self, lib: str) -> str:
        d = self.libs.get(lib, {})
        if not d.get("times"):
            return "-"
        return f"{statistics.median(w / t for w, t in zip(d['waiting'], d['times'])):.0%}"

    def cells(self) -> list[str]:
        ratios = [self.ratio(lib) for lib in LIBS[1:]]
        return [
            self.config,
            self.schedule,
            str(self.ranks),
            *(_ms(self.median(lib)) for lib in LIBS),
            *("-" if r is None else f"{r:.2f}x" for r in ratios),
            *(_eff(self.ideal, self.median(lib)) for lib in LIBS[::-1]),
            _ms(self.ideal),
            _ms(self.critical),
            _ms(self.spread),
            _ms(self.autograd),
            _eff(self.autograd, self.median("sw-shm")),
            " / ".join(_ms(self.median(lib, "cpu")) for lib in LIBS),
            " / ".join(self.no_cpu(lib) for lib in LIBS),
        ]


def table(rows: list[Row]) -> str:
    head = (
        "| config | schedule | ranks | torch ms | gloo ms | shm ms | x gloo | x shm | eff shm | eff gloo | eff torch "
        "| ideal ms | critical path ms | compute/cores ms | autograd ideal ms | eff shm (autograd) "
        "| CPU ms torch / gloo / shm | no CPU torch / gloo / shm |"
    )
    lines = [head, "|" + "|".join(["---"] * 3 + ["---:"] * 15) + "|"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def _eff(ideal: float, t: float | None) -> str:
    return "-" if t is None else f"{ideal / t:.0%}"


if __name__ == "__main__":
    main()
