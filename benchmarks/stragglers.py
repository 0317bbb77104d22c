"""A rank slowed mid-run: named, re-partitioned live, and the share of the best static cut recovered (issue 49
item 4), with the oracle of static cuts swept under the same throttle.

    sudo OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.stragglers --out out/stragglers   # cgroup v1, root
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.stragglers --emulate --out out/stragglers  # no root

Two ranks of one thread train the demo GPT (d 64, 10 layers) with 1F1B, 8 micro-batches, under a
:class:`~stagewise.runtime.Replanner` (its :class:`~stagewise.runtime.RunCalibrator` calibrates in the first
steps, names a slow rank, and the Replanner re-cuts live when the predicted gain clears the re-layout's cost
and the steps' noise; a rank it holds slow is probed every 5 steps, :mod:`stagewise.runtime.calibration.probe`,
so that the lift of a quota it no longer meets shows). Rank 1 is held to 50 % of a core, then 25 %, then (with
``--partial-steps``) 50 % again, a partial lift judged against the 50 % sweep, then released
(``--released-steps``, 24: the move back waits for a probe and a fresh calibration): cgroup v1, a group made for
this run (``cpu.cfs_quota_us`` of ``cpu.cfs_period_us = 10000``, a 10 ms period, so the slow rank is slower
rather than bursty), released by moving the process back to the group the run was started in (the throttle
group is its child: a run inside a high ``cpu.shares`` group stays there; ``--cgroup DIR`` names another),
deleted at the end;
``--emulate``: the running interpreter's ``slowdown`` (what ``emulate_slowdown`` sets) at 2 and 4 instead.
The oracle: every static cut ``[c, 10 - c]`` (built once at the start, idle until swept) timed under each
throttle and released - a warm-up round, then ``--oracle-steps`` rounds of one step per cut, the cuts in turn -
right after that phase's live steps (``--oracle phase``, the default: seconds, not minutes, between a phase and
its oracle; ``--oracle end``: all after the live phases, as before 2026-12-04).
Per phase, the recovered share: the best static cut's median step over the live step
reached by step 10 (the median of steps 8 to 10; goal: at least 90 %), and over the steady state after the last
change; beside it the live cut's own static step (a re-laid-out pipeline slower than a fresh one of its cut
shows there). Since 2026-12-04 07:30 the live pipeline also steps in its phase's sweep, in the same rounds, so
that the share can be read without the drift between a phase and its sweep, and each live step's cost of watching
the run (calibration, probes, decisions, until every rank is done) is timed beside it (:func:`shares`). Writes
``stragglers.json`` (each step's timeline too, gathered apart, unless ``--no-timelines``: the watch's lead then
gathers the steps itself, as a run does), prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ._launch import run_as_rank, timed_step

#: where cgroup v1's cpu controller is mounted (alone, or with cpuacct)
CPU_MOUNTS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"))
PERIOD_US = 10_000
LAYERS = 10
#: the partial lift (``--partial-steps``): back to 50 % after the 25 % phase, judged against the 50 % sweep
PARTIAL = "25 % -> 50 %"
SWEPT_AS = {PARTIAL: "50 %"}
#: the phases whose live steps are judged against a sweep of their own (``--oracle phase``: right after them)
SWEPT = ("50 %", "25 %", PARTIAL, "released")

#: the steps of a throttled phase (1-based) whose live median was compared with the best static cut until
#: 2026-12-02 (an average over the move and its warm-up, not the step reached)
WINDOW = (6, 10)
#: the steps (1-based) whose median is the step reached by step 10 of a phase (the issue's "within 10 steps")
BY_STEP_10 = (8, 10)


def cpu_group_of(proc_cgroup: str) -> str:
    """The cpu controller's group path in ``/proc/<pid>/cgroup``'s text (cgroup v1: ``id:cpu[,cpuacct]:/path``)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    raise RuntimeError(f"no cgroup v1 cpu controller in /proc/self/cgroup ({proc_cgroup!r}); run with --emulate")


def own_cpu_group(parent: Path | None = None) -> Path:
    """The cgroup this benchmark runs in (``parent`` if given): the straggler's group is made as its child, so a
    run started inside a group of its own (a high ``cpu.shares`` group on a shared machine) stays inside it."""
    if parent is not None:
        return parent
    mount = next((m for m in CPU_MOUNTS if (m / "cgroup.procs").exists()), CPU_MOUNTS[0])
    return mount / cpu_group_of(Path("/proc/self/cgroup").read_text()).lstrip("/")


class Throttle:
    """Rank 1's share of a core: a cgroup v1 group of its own, a child of the group the run was started in
    (made on first use, deleted by :meth:`close`), or the interpreter's emulated slowdown."""

    def __init__(self, emulate: bool, rank: int, parent: Path | None = None) -> None:
        self.emulate, self.rank = emulate, rank
        self.home = Path() if emulate else own_cpu_group(parent)
        self.group = self.home / f"stagewise_straggler_{os.getppid()}"
        self.factor = 1.0

    def set(self, share: float | None, pipe: Any = None) -> None:
        if self.rank != 1:
            return
        if self.emulate:
            self.factor = 1.0 if share is None else 1.0 / share
            self.apply(pipe)
            return
        if share is None:  # lifted: back to the group the run was started in
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            return
        self.group.mkdir(exist_ok=True)
        (self.group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.group / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))
        (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def apply(self, pipe: Any) -> None:
        """The emulated slowdown on the running interpreter (a re-layout builds a new one)."""
        if self.emulate and self.rank == 1 and pipe is not None:
            pipe._engine.runner.interpreter.slowdown = self.factor

    def close(self) -> None:
        if self.rank == 1 and not self.emulate and self.group.exists():
            (self.home / "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(100):  # the threads' move can trail the write (EBUSY: 2026-12-04 11:11)
                try:
                    self.group.rmdir()
                    return
                except OSError:  # a thread left behind (every time on the 13:30 VM): each moved on its own
                    for task in (self.group / "tasks").read_text().split():
                        with contextlib.suppress(OSError):  # gone since
                            (self.home / "tasks").write_text(task)
                    time.sleep(0.01)
            self.group.rmdir()


def start_rank(pin: bool) -> tuple[int, Any, Any, Any]:
    """This rank started as the stragglers and watch_cost benchmarks run it (pinned to a core of its own with
    ``pin``, one thread, gloo): its rank, the demo GPT's workload and a batch of 8 micro-batches."""
    import torch
    import torch.distributed as dist

    from .fidelity.workloads import workloads

    if pin:
        # internal: the pinning stagewise run --pin-cores does (the benchmark launches torchrun itself)
        from stagewise.runtime.measure.cores import pin_local_rank

        pin_local_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    work = workloads()["gpt64"]
    return dist.get_rank(), work, *work.data(work.microbatch * 8)


def measured_prior(work: Any, x: Any) -> Any:
    """The workload's layers timed on rank 0 on one micro-batch, as ``partition="time"`` times them, handed to every
    rank: the prior the run's calibration scales (without one, the flat prior: each stage's measured cost spread
    evenly over its layers)."""
    # internal: the timing and hand-over partition="time" does (the benchmark cuts by hand)
    from stagewise.runtime.frontends.balance import on_first_rank
    from stagewise.runtime.frontends.default_cut import timed_profile
    from stagewise.runtime.frontends.layers import named_layers

    named = named_layers(work.layers())
    return on_first_rank(None, lambda: timed_profile(named, x[: work.microbatch], seed=0, device="cpu"), "the prior")


def flat_prior() -> Any:
    """Every layer alike: each stage's measured cost spread evenly over its layers (a pipeline cut by hand's
    prior before the first batch priced one, 2026-12-04 16:30)."""
    # internal: the calibration's even prior (no public name: a run gets it only where nothing prices its layers)
    from stagewise.runtime.calibration.from_run import flat_profile

    return flat_profile([LAYERS])


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import stagewise as sw
    from stagewise.runtime import Replanner, RunCalibrator

    rank, work, x, y = start_rank(args.pin)

    def pipe(partition: Any = "balanced") -> Any:
        return sw.Pipeline(work.layers(), loss_fn=work.loss, schedule="1f1b", microbatches=8, partition=partition,
                           seed=0, emulate_slowdown=[1.0, 1.0] if args.emulate else None)  # fmt: skip

    throttle = Throttle(args.emulate, rank, args.cgroup)
    events: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    all_phases: list[tuple[str, float | None, int]] = [
        ("calibrate", None, 5), ("full speed", None, 5), ("50 %", 0.5, args.steps), ("25 %", 0.25, args.steps),
        (PARTIAL, 0.5, args.partial_steps), ("released", None, args.released_steps)]  # fmt: skip
    phases = [p for p in all_phases if p[2] > 0]
    live = pipe()
    prior = {"run": lambda: None, "flat": lambda: flat_prior(), "timed": lambda: measured_prior(work, x)}[args.prior]()
    calibrator = RunCalibrator(live, prior, on_event=lambda e: events.append({**e, "step": len(steps)}))
    quota = None if args.quota else (lambda: [None] * live.num_ranks)  # --no-quota: the loop alone, as before 08:00
    replanner = Replanner(live, calibrator, steps=sum(n for *_, n in phases) + args.horizon, cooldown=args.cooldown,
                          quota_probe=quota, leader=False if args.every_rank else None,
                          **({} if args.settled_every is None else {"settled_every": args.settled_every}))  # fmt: skip
    oracle: dict[str, dict[int, float]] = {}
    swept: dict[str, list[float]] = {}  # per phase: the sweep's start and end (seconds since the first step)
    in_sweep: dict[str, dict[str, Any]] = {}  # per phase: the live pipeline's median step in its sweep, its cut

    static = {c: pipe([c, LAYERS - c]) for c in range(1, LAYERS)} if args.oracle != "none" else {}
    # (built once, before the live steps: idle, they cost the live pipeline nothing - 2026-12-04, 67.7 ms a step
    # alone, 66.8 beside the nine - and a sweep builds nothing)

    def sweep(name: str, share: float | None) -> None:
        """Every static cut under ``share``, and the live pipeline at the cut it ended the phase on (held: no
        observation, so no re-plan): a warm-up round, then ``--oracle-steps`` rounds of one step per pipeline,
        in turn (each round starting one later), so that the machine's drift over the sweep falls on every cut
        and on the live pipeline alike; each one's median."""
        begun = time.monotonic()
        throttle.set(share, live)
        runs: dict[int | str, Any] = {**static, "live": live}
        order = list(runs)
        times: dict[int | str, list[float]] = {c: [] for c in order}
        for r in range(args.oracle_steps + 1):
            for c in order[r % len(order) :] + order[: r % len(order)]:
                throttle.apply(runs[c])
                took = timed_step(runs[c], x, y)
                if r:
                    times[c].append(took)
        oracle[name] = {int(c): statistics.median(times[c]) for c in static}
        in_sweep[name] = {"s": statistics.median(times["live"]), "counts": [len(r) for r in live.layer_ranges],
                          "steps": {str(c): t for c, t in times.items()}}  # fmt: skip
        swept[name] = [begun - start, time.monotonic() - start]

    start = time.monotonic()
    try:
        for phase, share, n in phases:
            throttle.set(share, live)
            for _ in range(n):
                throttle.apply(live)
                took = timed_step(live, x, y)
                timeline = live.timeline(gather=True) if args.timelines else None  # the benchmark's record
                watched = time.perf_counter()
                record = replanner.observe(timeline)  # (given the timeline, the lead gathers no events again)
                dist.barrier()  # until every rank is done watching: a held rank's share of it counts
                watched = time.perf_counter() - watched  # the run's own cost of watching: calibrate, probe, decide
                steps.append({"phase": phase, "seconds": took, "counts": [len(r) for r in live.layer_ranges],
                              "observe": watched,
                              "at": time.monotonic() - start, "replan": None if record is None else record["reason"],
                              "timeline": timeline.to_json() if timeline is not None else None})  # fmt: skip
            if args.oracle == "phase" and phase in SWEPT:
                sweep(phase, share)  # the machine as the phase's live steps just met it
        if args.oracle == "end":
            for name, share in (("50 %", 0.5), ("25 %", 0.25), ("released", None)):
                sweep(name, share)
            throttle.set(None)
    finally:
        throttle.close()
    if rank == 0:
        out = {"steps": steps, "events": events, "decisions": replanner.log, "probes": replanner.probes,
               "oracle": oracle, "oracle at": args.oracle, "swept": swept, "live in sweep": in_sweep,
               "load": os.getloadavg(),
               "mode": "emulate_slowdown" if args.emulate else "cgroup v1",
               "prior": calibrator.prior.to_json(), "cores": calibrator.cores}  # fmt: skip
        out["shares"] = shares(steps, oracle, in_sweep)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stragglers.json").write_text(json.dumps(out, default=str))
        for e in events:
            print(e)
        for r in replanner.log:
            print(r["step"], r["reason"], r["current"]["counts"], "->", (r["best"] or {}).get("counts"))
        for p in replanner.probes:
            print("probe", p)
        for line in table(out["shares"]):
            print(line)
    dist.destroy_process_group()


def shares(
    steps: list[dict[str, Any]], oracle: dict[str, dict[int, float]], in_sweep: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Per phase with an oracle: the best static cut and its median step; the live step reached by step 10 (the
    median of the phase's steps :data:`BY_STEP_10`, the issue's "within 10 steps") and its share; the steps 6 to
    10 (:data:`WINDOW`, the page's figure before 2026-12-02 07:50); the steady state (the phase's steps after its
    last change and one warm-up step); and the live cut's own static step, so that a re-laid-out pipeline slower
    than a fresh one of its cut shows (``left behind``: live steady over that cut's static step).

    The same shares without the drift between a phase and its sweep (seconds to minutes apart, ±10-30 % on this VM):
    ``share by step 10, same sweep`` is the best cut over the cut reached by step 10, both timed in the one sweep (a
    re-laid-out pipeline steps as a fresh one of its cut: ``benchmarks.relaid_vs_fresh``), and with ``in_sweep``
    (the live pipeline timed in that sweep too, at the cut it ended the phase on) ``share live in sweep`` (its step
    there plus the phase's mean cost of watching the run, ``observe s``: the Replanner's ``observe`` until every
    rank is done with it, a barrier after it, since 2026-12-04 11:20) and ``live / static in sweep`` (the live
    pipeline's step over its cut's static one, interleaved)."""
    out = []
    for name in dict.fromkeys(s["phase"] for s in steps):
        by_cut = oracle.get(name, oracle.get(SWEPT_AS.get(name, name)))  # its own sweep, else the one it is judged by
        if by_cut is None:
            continue
        static = {int(c): t for c, t in by_cut.items()}  # int keys again after a round trip through JSON
        phase = [s for s in steps if s["phase"] == name]
        if not phase:
            continue
        c = min(static, key=static.__getitem__)
        at10 = phase[min(len(phase), BY_STEP_10[1]) - 1]["counts"]
        changed = [k for k, s in enumerate(phase) if k and s["counts"] != phase[k - 1]["counts"]]
        steady = [s["seconds"] for s in phase[(changed[-1] + 2 if changed else 1) :]]
        by10 = _median([s["seconds"] for s in phase[BY_STEP_10[0] - 1 : BY_STEP_10[1]]])
        own = static.get(phase[-1]["counts"][0])  # the cut the steady state ran
        before = [s for s in steps if s["phase"] != name and steps.index(s) < steps.index(phase[0])]
        out.append({"throttle": name, "best cut": [c, LAYERS - c], "best s": static[c],
                    "cut at step 10": at10, "by step 10 s": by10, "share by step 10": static[c] / by10,
                    "live s": _median([s["seconds"] for s in phase[WINDOW[0] - 1 : WINDOW[1]]]),
                    "steady s": _median(steady), "share steady": static[c] / _median(steady),
                    "that cut static s": own, "left behind": None if own is None else _median(steady) / own,
                    "even cut s": static.get(LAYERS // 2),
                    "moved back": moved_back(before[-1]["counts"] if before else None, phase)})  # fmt: skip
        reached = static.get(at10[0])
        row = out[-1]
        row["share by step 10, same sweep"] = None if reached is None else static[c] / reached
        # a mean (the probes come every few steps) over the steps that did not re-lay out (a move's cost is paid
        # once, over the steps the job has left, not over a phase of 14)
        watching = [s["observe"] for s in phase if "observe" in s and s.get("replan") != "re-plan"]
        row["observe s"] = statistics.fmean(watching) if watching else 0.0
        live = (in_sweep or {}).get(name)
        if live is not None:
            row["live in sweep s"], row["live in sweep cut"] = live["s"], live["counts"]
            row["share live in sweep"] = static[c] / (live["s"] + row["observe s"])
            own_cut = static.get(live["counts"][0])
            row["live / static in sweep"] = None if own_cut is None else live["s"] / own_cut
    return out


def moved_back(entered: list[int] | None, phase: list[dict[str, Any]]) -> str:
    """What a phase did with the cut it ``entered`` with: "moved back to [5, 5] at step k" (k: the phase's step
    that moved) when it ends on a cut nearer the even one (the throttle lifted, layers back on the rank), else
    "kept" or "re-cut"."""
    if entered is None or not phase:
        return "-"
    last = phase[-1]["counts"]
    if last == entered:
        return f"kept {entered}"
    k = next(k for k, s in enumerate(phase) if s["counts"] == last) + 1  # the phase's step (1-based) that moved
    even = LAYERS // 2
    if abs(last[0] - even) < abs(entered[0] - even):
        return f"moved back to {last} at step {k}"
    return f"re-cut to {last} at step {k}"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| phase | best static cut | its step ms | live cut at step 10 | live ms (steps 8-10) | share by step 10 "
             "| same sweep: share by step 10 | live in the sweep: cut, share with watching | watching ms a step "
             "| live / static, same cut, in the sweep "
             "| live steady ms | share steady | its cut static ms | live / static, same cut "
             "| the cut it entered with |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    for r in rows:
        own = "-" if r["that cut static s"] is None else f"{r['that cut static s'] * 1e3:.1f}"
        left = "-" if r["left behind"] is None else f"{r['left behind']:.2f}"
        live = "-" if "live in sweep cut" not in r else f"{r['live in sweep cut']}, {pct(r['share live in sweep'])}"
        same = r.get("live / static in sweep")
        same_text = "-" if same is None else f"{same:.2f}"
        lines.append(f"| {r['throttle']} | {r['best cut']} | {r['best s'] * 1e3:.1f} | {r['cut at step 10']} "
                     f"| {r['by step 10 s'] * 1e3:.1f} | {r['share by step 10']:.0%} "
                     f"| {pct(r.get('share by step 10, same sweep'))} | {live} | {r.get('observe s', 0) * 1e3:.1f} "
                     f"| {same_text} "
                     f"| {r['steady s'] * 1e3:.1f} | {r['share steady']:.0%} | {own} | {left} "
                     f"| {r.get('moved back', '-')} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/stragglers"))
    parser.add_argument("--steps", type=int, default=14, help="steps per throttled phase")
    parser.add_argument(
        "--released-steps",
        type=int,
        default=24,
        help="steps after the throttle lifts (the held rank is probed every 5, then a calibration of 4 steps)",
    )
    parser.add_argument(
        "--partial-steps",
        type=int,
        default=0,
        help="steps of a partial lift (25 %% back to 50 %%) between the 25 %% phase and the release (0: none)",
    )
    parser.add_argument("--cooldown", type=int, default=4, help="the Replanner's cooldown (steps)")
    parser.add_argument("--horizon", type=int, default=200, help="steps the job is said to run on after these")
    parser.add_argument("--oracle-steps", type=int, default=3, help="timed steps per static cut")
    parser.add_argument("--emulate", action="store_true", help="emulate_slowdown instead of a cgroup (no root)")
    parser.add_argument(
        "--cgroup",
        type=Path,
        default=None,
        help="the cpu cgroup (v1 directory) to make the straggler's group in; default: this run's own",
    )
    parser.add_argument(
        "--no-timelines",
        dest="timelines",
        action="store_false",
        help="keep no step's timeline in stragglers.json (kept: the model can be re-fitted offline)",
    )
    parser.add_argument(
        "--oracle",
        choices=("phase", "end", "none"),
        default="phase",
        help="when the static cuts are swept: right after each throttled phase's live steps, under its throttle "
        "(phase), or all after the live phases (end: the page's runs before 2026-12-04, which the machine's drift "
        "between the two moved by as much as the misses)",
    )
    parser.add_argument(
        "--no-quota",
        dest="quota",
        action="store_false",
        help="watch a held rank by the busy loop alone, never by reading its cgroup quota (before 2026-12-04 08:00)",
    )
    parser.add_argument(
        "--every-rank",
        action="store_true",
        help="every rank watches the run alike (leader=False), as before 2026-12-04 11:00; default: rank 0 watches",
    )
    parser.add_argument(
        "--settled-every",
        type=int,
        default=None,
        help="once settled, one step in this many is watched (default: the Replanner's, 3; 1: every step, as before "
        "2026-12-04 14:00)",
    )
    parser.add_argument(
        "--prior",
        choices=("run", "flat", "timed"),
        default="run",
        help="the layers' costs the calibration scales: the run's own (default: counted at the first batch, since "
        "2026-12-04 16:30), flat (each stage's cost spread evenly over its layers, before), timed (on one "
        "micro-batch, as partition='time' times them)",
    )
    parser.add_argument("--profile", dest="prior", action="store_const", const="timed", help="--prior timed")
    parser.add_argument("--no-oracle", dest="oracle", action="store_const", const="none", help="--oracle none")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each rank on a core of its own (what stagewise run --pin-cores does): left to the kernel, a rank held "
        "by its quota and its free peer were seen sharing one core at half a core each (2026-12-03 03:31)",
    )
    return run_as_rank(2, "benchmarks.stragglers", rank_main, parser.parse_args(argv), argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
