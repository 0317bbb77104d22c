"""sw.calibrate() on the actual group: measured values are positive and finite, and the planner uses them.

torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks calibrate_checks --out DIR

No timing is asserted: only that each measurement is a usable number and that
a plan made with the calibration carries exactly those numbers in its costs.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import stagewise as sw
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Calibration, search
from worker import Ctx


def _usable(x: float) -> bool:
    return 0 < x < math.inf


def _profile() -> LayerProfile:
    layer = lambda k: LayerCost(f"l{k}", 1e-3, 1e-3, 1e-3, 2e-3, 64.0, 32.0, 4096.0 * (k + 1), 64.0)  # noqa: E731
    return LayerProfile(tuple(layer(k) for k in range(4)), "synthetic", 1, 0)


def _groups() -> int:
    """The process groups this process holds (every group it made or joined stays until exit)."""
    import torch.distributed.distributed_c10d as c10d

    return len(c10d._world.pg_map)


def calibrated(ctx: Ctx) -> dict[str, Any]:
    before = _groups()
    shown = io.StringIO()
    with contextlib.redirect_stderr(shown):  # (one pass: what is measured and kept, not how well: that is
        cal = sw.calibrate(timeout=60, passes=1)  # benchmarks.calibration's; the passes' medians: `again` below)
    made = _groups() - before
    # rank 0 draws the progress (finished: the last state of the bar), the others none (torch may warn on any)
    drawn = shown.getvalue()
    assert ("calibrate ━" in drawn and "done" in drawn) if ctx.rank == 0 else "━" not in drawn, drawn
    # the group it was measured on, and a file that gives the same calibration back
    assert (cal.processes, cal.nodes) == (ctx.world, 1), cal
    assert Calibration.from_json(cal.to_json()) == cal
    assert cal.intra is not None and cal.inter is None and cal.link_cpu == 0.0, cal  # (one node: no link between)
    assert _usable(cal.intra.latency) and _usable(cal.intra.bandwidth), cal.intra
    assert 0 <= cal.action < math.inf and 0 <= cal.step < math.inf and cal.message == 0, cal
    assert cal.cores is not None and _usable(cal.cores), cal
    # idle, a process still spends CPU: its process groups' transport threads wake 100 times a second
    assert 0 < cal.background < 1, cal.background
    assert cal.sharding_fixed is not None and cal.sharding_per_byte is not None and cal.sharding_group == ctx.world
    assert 0 <= cal.sharding_fixed < math.inf and 0 <= cal.sharding_per_byte < math.inf, cal
    assert cal.sharding_fixed + cal.sharding_per_byte > 0, cal
    # FSDP2's hooks per unit and micro-batch, measured on their own: no layout fit carries them as a cross term
    assert cal.sharding_hooks is not None and 0 <= cal.sharding_hooks < math.inf, cal
    # one fitted cost per factorisation of the world (tp = 1), slopes never negative, used by step_for
    layouts = {(r.pp, r.dp, r.tp, r.sharding): r for r in cal.layouts}
    assert set(layouts) == {(1, 2, 1, 1), (1, 1, 1, 2), (2, 1, 1, 1)}, layouts
    for r in layouts.values():
        assert min(r.per_unit, r.per_microbatch) >= 0 and math.isfinite(r.fixed), r
        assert r.per_unit_microbatch == 0 == r.cpu[3], r
        assert cal.step_for(r.pp, r.dp, 1, r.sharding, 3, 5) == r.at(3, 5)
        # the CPU beside the compute actions, measured in the same probes (a process always spends some: gloo's
        # threads, the step's bookkeeping), its slopes never negative either
        assert any(x != 0.0 for x in r.cpu) and min(r.cpu[1:]) >= 0 and all(map(math.isfinite, r.cpu)), r
        assert cal.cpu_for(r.pp, r.dp, 1, r.sharding, 3, 5) == r.cpu_at(3, 5)
    # the planner uses them: the link, the cost per action, FSDP2's cost (the same plan without: the difference)
    profile = _profile()
    kw: dict[str, Any] = {"global_batch": 4, "recompute": (None,), "schedules": ["1f1b"], "top": 400}
    with_cal = {p.describe(): p for p in search(profile, 2, calibration=cal, **kw).plans}
    bare = {p.describe(): p for p in search(profile, 2, **kw).plans}
    piped = next(p for d, p in with_cal.items() if p.layout.pp == 2)
    assert piped.costs is not None and piped.costs.latency == cal.intra.latency
    assert piped.costs.bandwidth == cal.intra.bandwidth
    base = bare[piped.describe()].costs
    assert base is not None
    for got, ref in zip(piped.costs.forward, base.forward):
        assert abs(got - (ref + cal.action)) <= 1e-12 * (1 + ref), (got, ref, cal.action)
    sharded = next(p for p in with_cal.values() if p.layout.sharding == 2)
    assert sharded.costs is not None
    expected = cal.sharding_time(sum(lay.parameter_bytes for lay in profile.layers), 4, 2)
    assert expected is not None
    assert abs(sharded.costs.sync_time[0] - expected) <= 1e-12 * (1 + expected), (sharded.costs.sync_time, expected)
    # the layout probes leave one mesh's groups per layout, not one per probe pipeline (idle gloo groups poll:
    # a mesh per probe left ~500 threads per process at 8 ranks that took 89 % of a core from later steps)
    from stagewise.runtime.hybrid.mesh import build_mesh

    start = _groups()
    calls = []  # the shared cores measured on the caller's own work: rank 0 runs it alone and together, 9 rounds per
    # pass and a warm-up round
    work = lambda: calls.append(sum(k * k for k in range(20_000)))  # noqa: E731
    again = sw.calibrate(timeout=60, layouts=False, passes=2, workload=work)
    without_layouts = _groups() - start
    assert len(calls) == (38 if ctx.rank == 0 else 19), len(calls)
    assert again.cores is not None and 0 < again.cores <= ctx.world, again.cores
    start = _groups()
    for r in cal.layouts:
        build_mesh(sw.ParallelConfig(pp=r.pp, dp=r.dp, tp=r.tp, sharding=r.sharding))
    per_layout_mesh = _groups() - start
    assert per_layout_mesh > 0 and made == without_layouts + per_layout_mesh, (made, without_layouts, per_layout_mesh)
    return {"latency": cal.intra.latency, "bandwidth": cal.intra.bandwidth, "action": cal.action}


def across_nodes(ctx: Ctx) -> dict[str, Any]:
    """A nodes x processes shape of 2 x 1: the only pair crosses nodes, so inter is measured, intra is not; and a
    message's CPU between the nodes is probed between node 0's first rank and node 1's (the probe itself, a
    stream beside a compute loop, is tests/runtime/test_link_cpu_probe.py's: here it answers at once)."""
    import stagewise.runtime.calibration.calibrate as calibrate_module

    probe, asked = calibrate_module.link_cpu, []

    def answered(a: int, b: int, **_: Any) -> float:
        asked.append((a, b))
        return 0.25

    calibrate_module.link_cpu = answered  # type: ignore[assignment]
    try:
        cal = sw.calibrate(nodes=ctx.world, sharding=False, layouts=False, timeout=60)
    finally:
        calibrate_module.link_cpu = probe
    assert asked == [(0, 1)] and cal.link_cpu == 0.25, (asked, cal.link_cpu)
    assert cal.layouts == ()
    intra, inter = cal.intra, cal.inter
    assert intra is None and inter is not None and _usable(inter.latency) and _usable(inter.bandwidth), cal
    assert cal.sharding_fixed is None
    try:
        sw.calibrate(nodes=3, timeout=60)
    except ValueError as err:
        assert "nodes" in str(err), err
    else:
        raise AssertionError("nodes=3 on 2 processes was accepted")
    for bad in (0, 1.5, True):
        try:
            sw.calibrate(passes=bad, timeout=60)  # type: ignore[arg-type]
        except ValueError as err:
            assert "passes" in str(err) and repr(bad) in str(err), err
        else:
            raise AssertionError(f"passes={bad!r} was accepted")
    assert isinstance(cal, Calibration)
    return {"inter": [inter.latency, inter.bandwidth]}


def sharded_meter(ctx: Ctx) -> dict[str, Any]:
    """measure_memory on an FSDP2 layout counts the same activations as the unsharded layout (no parameters)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    layers = [sw.Layer(nn.Linear, 8, 16), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 16, 3)]
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    peaks = {}
    for name, config in (("dp", sw.ParallelConfig(dp=ctx.world)), ("sharding", sw.ParallelConfig(sharding=ctx.world))):
        pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, parallel=config, measure_memory=True)
        pipe.train_step(*pipe.local_batch(x, y))
        peaks[name] = pipe.memory_report()["peak_bytes"]
    assert peaks["sharding"] == peaks["dp"] > 0, peaks
    return peaks


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (a wall-clock bound would count the time others hold the core)."""
    import time

    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def _spin_layer(forward: float, backward: float) -> Any:
    """A layer whose forward spends ``forward`` CPU seconds and whose backward ``backward``, whatever the batch."""
    import torch
    from torch import nn

    class Burn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            _burn(forward)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            _burn(backward)
            return grad

    class Spin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Burn.apply(x * self.w)

    return Spin()


def compute_scale(ctx: Ctx) -> dict[str, Any]:
    """Layers that spend 12 ms of CPU per forward and 18 ms per backward, profiled as 3 and 3: the probes find the
    runtime's F at 4x and its B, fused or split, at 6x the plans' costs (the runtime's own CPU per action, a few
    hundred microseconds, is left room up to 2 ms), and the layers given are left untouched (the probes train a
    copy)."""
    import torch
    import torch.nn.functional as F

    per = LayerCost("spin", 3e-3, 1.5e-3, 1.5e-3, 3e-3, 64.0, 32.0, 4.0, 64.0)
    profile = LayerProfile((per, per), "synthetic", 2, 0)
    layers = [_spin_layer(12e-3, 18e-3), _spin_layer(12e-3, 18e-3)]
    before = [p.detach().clone() for layer in layers for p in layer.parameters()]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    from stagewise.runtime.calibration.compute_scale import probe_plan

    plan = probe_plan(profile, ctx.world, global_batch=8, profile_batch=2)
    assert (plan.layout.pp, plan.schedule, plan.microbatches) == (ctx.world, "1f1b", 2 * ctx.world), plan
    split = probe_plan(profile, ctx.world, "zb-h1", global_batch=8, profile_batch=2)
    assert (split.layout.pp, split.schedule, split.microbatches) == (ctx.world, "zb-h1", 2 * ctx.world), split
    calls = []
    real = sw.Pipeline.train_step

    def counted(self: Any, *args: Any) -> Any:
        calls.append(self.schedule.name)
        return real(self, *args)

    sw.Pipeline.train_step = counted  # type: ignore[method-assign]
    shown = io.StringIO()
    try:
        with contextlib.redirect_stderr(shown):
            kf, kb, ks = sw.runtime.measure_compute_scale(
                profile, layers, F.mse_loss, x, y, global_batch=8, profile_batch=2, steps=2, passes=2
            )
    finally:
        sw.Pipeline.train_step = real  # type: ignore[method-assign]
    drawn = shown.getvalue()
    assert ("measure_compute_scale ━" in drawn and "5/5" in drawn) if ctx.rank == 0 else "━" not in drawn, drawn
    # two passes, the probes taking turns: 2 untimed + 2 timed steps each, then 1 + 2 each
    assert [(n, len(list(g))) for n, g in itertools.groupby(calls)] == [
        ("1f1b", 4),
        ("zb-h1", 4),
        ("1f1b", 3),
        ("zb-h1", 3),
    ], calls
    assert 3.9 < kf < 4.7 and 5.85 < kb < 6.7 and 5.85 < ks < 6.7, (kf, kb, ks)
    after = [p.detach() for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and all(p.grad is None for p in after), "touched"
    # planned with it, the stages cost what the probe measured
    got = sw.plan(profile, ctx.world, global_batch=8, profile_batch=2, compute_scale=(kf, kb, ks), top=1000)
    scaled = next(p for p in got if p.describe() == plan.describe())
    assert scaled.costs is not None and plan.costs is not None
    assert abs(scaled.costs.forward[0] - kf * plan.costs.forward[0]) < 1e-12
    for bad in ({"steps": 0}, {"passes": 0}):
        with_bad = None
        try:
            sw.runtime.measure_compute_scale(profile, layers, F.mse_loss, x, y, global_batch=8, profile_batch=2, **bad)
        except ValueError as err:
            with_bad = str(err)
        (name,) = bad
        assert with_bad is not None and f"{name} must be an int >= 1, got 0" in with_bad, with_bad
    return {"scale": [round(kf, 1), round(kb, 1), round(ks, 1)]}


def from_the_run(ctx: Ctx) -> dict[str, Any]:
    """RunCalibrator on a running pipeline: after 2 warm-up and 3 steps it records one "recalibrated" event
    (a prediction inside its interval, every rank the same figures); then the same plan with rank 1 emulated
    4x slower (``emulate_slowdown``) is watched: rank 1 alone is named, once, within 5 steps, with a cut that
    moves layers off it; the steps since calibration are reported against the prediction. No time is asserted
    beyond the emulated factor (a sleep of 3x each action's own time, against a threshold of 0.8)."""
    import torch
    import torch.nn.functional as F

    from stagewise.runtime.calibration.from_run import RunCalibrator

    layers = [_spin_layer(2e-3, 3e-3) for _ in range(8)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def pipe(**kw: Any) -> sw.Pipeline:
        return sw.Pipeline(layers, loss_fn=F.mse_loss, schedule="1f1b", microbatches=4, group=ctx.group, **kw)

    events: list[dict[str, Any]] = []
    calibrator = RunCalibrator(pipe(), cores=ctx.world, on_event=events.append)
    for _ in range(5):
        calibrator.pipe.train_step(x, y)
        calibrator.observe()
    assert [e["event"] for e in events] == ["recalibrated"], events
    low, high = events[0]["interval_s"]
    assert 0 < low < events[0]["predicted_s"] < high < math.inf, events[0]
    slow = pipe(emulate_slowdown=[1.0] + [4.0] * (ctx.world - 1))
    named_at = None
    for step in range(5):
        slow.train_step(x, y)
        calibrator.observe(slow.timeline(gather=True))
        if named_at is None and any(e["event"] == "straggler named" for e in events):
            named_at = step
    named = [e for e in events if e["event"] == "straggler named"]
    assert [e["rank"] for e in named] == list(range(1, ctx.world)), named
    assert named_at is not None and named_at < 5
    assert sum(named[0]["cut"][1:]) < 4 * (ctx.world - 1), named[0]  # layers moved off the slow ranks
    report = calibrator.report()
    assert report["steps"] == 5 and report["measured_s"] > 0 and report["error"] is not None, report
    return {"named": [e["rank"] for e in named], "at step": named_at, "cut": named[0]["cut"]}


def replicas_link(ctx: Ctx) -> dict[str, Any]:
    """pp 1 x dp ``world``: the replicas' SYNC and STEP gathered on one clock give the link fit the all-reduce's
    messages (a stage of 4 float64 Linear(4, 4) and spin layers: its gradients' bytes over dp per message), every rank
    the same; the waits are left to the pure test (tests/core/test_link_fit.py). An optimizer is given: its
    STEP is where a replica waits for the reduction (without one the wait is at the step's end, not timed). No cores
    given: the calibrator gathers every rank's CPU affinity (all of the world's, the replicas' too)."""
    import torch
    import torch.nn.functional as F

    from stagewise.runtime.calibration.from_run import RunCalibrator

    pipe = sw.Pipeline(
        [_linear_spin(1e-3, 1e-3) for _ in range(4)], loss_fn=F.mse_loss, schedule="1f1b", microbatches=2,
        parallel=sw.ParallelConfig(pp=1, dp=ctx.world), seed=0, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
    )  # fmt: skip
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    calibrator = RunCalibrator(pipe, processes=ctx.world)  # the cores from every rank's affinity, gathered
    assert calibrator._replicas.dp == ctx.world
    while calibrator.calibration is None:
        pipe.train_step(*pipe.local_batch(x, y))
        calibrator.observe()
    pairs = calibrator._replicas.pairs()
    reduced = sum(p.numel() * p.element_size() for p in pipe.parameters())  # the one stage's gradients
    assert pairs and all(b == reduced / ctx.world and d > 0 for b, d in pairs), (pairs, reduced)
    record = calibrator.records[0]
    link = record["link"]
    assert f"({len(pairs)} of them all-reduce messages)" in link, link
    cpus = set().union(*map(set, record["affinity"]))  # every rank of the world: one per pp 1 x dp replica
    assert len(record["affinity"]) == ctx.world and record["cores"] == len(cpus), record
    return {"link": link.split(":")[0]}  # (the bias is each replica's own: its timeline is its pipeline's)


def _linear_spin(forward: float, backward: float) -> Any:
    """A float64 Linear followed by a layer that burns ``forward`` / ``backward`` CPU seconds (numbers and cost)."""
    import torch
    from torch import nn

    return nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), _spin_layer(forward, backward).double())


def _simulated_step(pipe: Any, prior: LayerProfile, speeds: list[float]) -> Any:
    """The simulator's timeline of ``pipe``'s running plan (schedule and cut) with ``prior``'s layer costs, each
    rank's compute divided by its speed: what the Replanner decides on in ``replan_live``, so that its decisions
    are the same on any machine at any load (the real timeline's numbers are checked by ``straggler``)."""
    from dataclasses import replace

    edges = [0] + [r.stop for r in pipe.layer_ranges]
    costs = prior.cost_model(edges)
    placement = pipe.schedule.placement

    def slowed(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x / speeds[placement[s]] for s, x in enumerate(values))

    kinds = ("forward", "backward_input", "backward_weight", "backward_full")
    return sw.simulate(pipe.schedule, replace(costs, **{k: slowed(getattr(costs, k)) for k in kinds})).timeline


def replan_live(ctx: Ctx) -> dict[str, Any]:
    """Replanner on a running pipeline: calibrated at full speed, then rank 1 4x slower from step 5 until step 18:
    the straggler is named, a re-partition that moves layers off rank 1 is applied live with ``pipe.relayout``
    and holds while rank 1 is slow; when the slowdown lifts, rank 1 is cleared and layers move back to it; every
    rank logs the same decisions, the log replays to itself, and the float64 losses of the whole run equal a
    replay of the logged changes, each segment a fresh pipeline of its layout loaded from a checkpoint saved at
    the change. The steps train for real; the timelines the Replanner reads are the simulator's for the running
    plan at the ranks' stated speeds (``_simulated_step``), so no decision hangs on this machine's load."""
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from stagewise.planning.replan import replay
    from stagewise.runtime import Replanner, RunCalibrator

    steps, slow_from, lift = 34, 5, 18
    prior = LayerProfile(
        layers=tuple(LayerCost(str(k), 4e-3, 4e-3, 4e-3, 8e-3, 0.0, 0.0, 0.0, 1.0) for k in range(8)),
        device="cpu",
        repeats=1,
        warmup=0,
    )

    def build(**layout: Any) -> sw.Pipeline:
        torch.manual_seed(0)
        layers = [_linear_spin(0.0, 0.0) for _ in range(8)]
        opts: dict[str, Any] = {"schedule": "1f1b", "microbatches": 4, "partition": "uniform", **layout}
        return sw.Pipeline(layers, loss_fn=F.mse_loss, group=ctx.group, timeout=60, **opts)

    def batch(step: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(500 + step)
        return torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)

    def train(pipe: sw.Pipeline, start: int, stop: int) -> list[Any]:
        return [pipe.train_step(*pipe.local_batch(*batch(s))) for s in range(start, stop)]

    def speeds(step: int) -> list[float]:
        return [1.0] + [0.25 if slow_from <= step < lift else 1.0] * (ctx.world - 1)

    shared = [tempfile.mkdtemp(prefix="replan") if ctx.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, group=ctx.group)
    root = Path(str(shared[0]))
    pipe = build()
    events: list[dict[str, Any]] = []
    replanner = Replanner(
        pipe,
        RunCalibrator(pipe, prior, cores=ctx.world, on_event=events.append),
        steps=200,
        margin_s=0.2,
        cooldown=4,
        log_path=root / "replan.jsonl",
        probe_every=0,  # the slowdown is simulated as a speed, which the steps show; a probe reads the real CPU
    )
    live = []
    for step in range(steps):
        if step == lift:
            counts_at_lift = [len(r) for r in pipe.layer_ranges]
        live += train(pipe, step, step + 1)
        replanner.observe(_simulated_step(pipe, prior, speeds(step)))
    named = [e["rank"] for e in events if e["event"] == "straggler named"]
    assert 1 in named, events
    changes = [r for r in replanner.log if r["taken"]]
    assert changes, replanner.log
    first = changes[0]["best"]["counts"]
    assert changes[0]["step"] <= slow_from + 10, replanner.log  # re-cut within 10 steps of the slowdown
    assert sum(first[1:]) < 4 * (ctx.world - 1), changes[0]  # layers moved off the slow rank
    assert [len(r) for r in pipe.layer_ranges] == changes[-1]["best"]["counts"]  # applied, not only logged
    slowed = [r["best"]["counts"][1] for r in changes if r["step"] <= lift]
    assert max(slowed[1:], default=0) <= slowed[0], replanner.log  # no layers back onto rank 1 while it is slow
    recovered = [r for r in replanner.log if r["step"] > lift and r["taken"]]
    assert any(e["event"] == "straggler recovered" and e["rank"] == 1 for e in events), events
    assert recovered and recovered[0]["best"]["counts"][1] > counts_at_lift[1], replanner.log  # moved back
    assert replay(replanner.log) == replanner.log
    if ctx.rank == 0:
        lines = [json.loads(t) for t in (root / "replan.jsonl").read_text().splitlines()]
        assert lines == replanner.log, lines
    # the replay: each segment a fresh pipeline of its layout, loaded from a checkpoint saved at the change
    fresh, start, want = build(), 0, []
    for k, change in enumerate(changes):
        want += train(fresh, start, change["step"])
        sw.checkpoint.save(root / f"seg{k}", fresh, step=change["step"])
        dist.barrier(group=ctx.group)
        best = change["best"]
        fresh = build(schedule=best["schedule"], partition=list(best["counts"]))
        sw.checkpoint.load(root / f"seg{k}", fresh)
        start = change["step"]
    want += train(fresh, start, steps)
    assert live == want, f"live {live} != replayed {want}"
    return {
        "named": named,
        "recovered": [e["rank"] for e in events if e["event"] == "straggler recovered"],
        "changes": [(r["step"], r["best"]["schedule"], r["best"]["counts"]) for r in changes],
        "decisions": [(r["step"], r["reason"]) for r in replanner.log],
    }


def watched_by_a_lead(ctx: Ctx) -> dict[str, Any]:
    """The Replanner with a lead (rank 0 watches; the others send their steps and do what it says) decides what
    every rank watching alike decides, step for step: the same decisions, probes and events on every rank, every
    re-layout applied everywhere. Rank 1 runs 4x slower from step 5 to step 18 under a quarter core's quota: its
    loop probe and its cgroup quota are scripted, so every word of the lead's protocol is said (a loop probe, the
    quota read with the steps, a re-layout, the step's last word) and the decisions do not hang on the load. Once
    settled, both watch the same steps, one in three (the lead's last word says the next one to the others)."""
    import torch
    import torch.nn.functional as F

    import stagewise.runtime.calibration.lead as lead_module
    import stagewise.runtime.calibration.probe as probe_module
    from stagewise.runtime import Replanner, RunCalibrator

    steps, slow_from, lift = 45, 5, 18
    prior = LayerProfile(
        tuple(LayerCost(str(k), 4e-3, 4e-3, 4e-3, 8e-3, 0.0, 0.0, 0.0, 1.0) for k in range(8)), "cpu", 1, 0
    )
    at = [0]
    held = lambda: ctx.rank > 0 and slow_from <= at[0] < lift  # noqa: E731
    share = lambda *_, **__: 0.25 if held() else 1.0  # noqa: E731
    saved = probe_module.core_share, probe_module.quota_share, lead_module.quota_share
    probe_module.core_share, probe_module.quota_share, lead_module.quota_share = share, share, share

    def run(leader: bool) -> tuple[Any, list[dict[str, Any]], Any, list[int]]:
        pipe = sw.Pipeline([_linear_spin(0.0, 0.0) for _ in range(8)], loss_fn=F.mse_loss, group=ctx.group,
                           timeout=60, schedule="1f1b", microbatches=4, partition="uniform")  # fmt: skip
        events: list[dict[str, Any]] = []
        calibrator = RunCalibrator(pipe, prior, cores=ctx.world, on_event=events.append)
        replanner = Replanner(pipe, calibrator, steps=200, margin_s=0.2, cooldown=4, leader=leader)
        x = torch.zeros(8, 4, dtype=torch.float64)
        watched = []
        for step in range(steps):
            at[0] = step
            pipe.train_step(*pipe.local_batch(x, x))
            speeds = [1.0] + [0.25 if slow_from <= step < lift else 1.0] * (ctx.world - 1)
            if replanner.cadence.due(pipe.train_steps):
                watched.append(pipe.train_steps)
            replanner.observe(_simulated_step(pipe, prior, speeds))
        return replanner, events, pipe, watched

    try:
        led, led_events, led_pipe, led_watched = run(True)
        alike, alike_events, _, alike_watched = run(False)
    finally:
        probe_module.core_share, probe_module.quota_share, lead_module.quota_share = saved
    assert led.lead is not None and alike.lead is None
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731
    timed = lambda log: [{k: v for k, v in r.items() if k != "relayout_s"} for r in log]  # noqa: E731  (measured)
    assert same(timed(led.log), timed(alike.log)), (led.log, alike.log)
    assert same(led.probes, alike.probes), (led.probes, alike.probes)
    assert same(led_events, alike_events), (led_events, alike_events)
    assert led_watched == alike_watched and len(led_watched) < steps, (led_watched, alike_watched)
    changes = [r for r in led.log if r["taken"]]
    assert changes and [len(r) for r in led_pipe.layer_ranges] == changes[-1]["best"]["counts"], led.log
    by = sorted({p["by"] for p in led.probes})
    assert by == ["a quota moved", "due"], led.probes  # the loop probed, and the quota read with the steps
    return {
        "decisions": [(r["step"], r["reason"]) for r in led.log],
        "probes": [(p["step"], p["by"], p["lifted"]) for p in led.probes],
        "events": [(e["event"], e.get("rank")) for e in led_events],
        "watched": led_watched,
    }


def one_way_messages(ctx: Ctx) -> dict[str, Any]:
    """The lead's one-way messages carry every byte: a gather to the first rank and a broadcast from it, of
    messages shorter than the first part, exactly its size, and longer (the rest sent apart), on every rank."""
    import random

    from stagewise.runtime.comm import collectives

    first = collectives.FIRST_PART - 8
    sizes = [0, 1, 100, first, first + 1, 3 * collectives.FIRST_PART + 5]
    for k, size in enumerate(sizes):
        mine = random.Random(1000 * k + ctx.rank).randbytes(size if ctx.rank % 2 else sizes[-1 - k])
        got = collectives.gather_to_first(mine, ctx.group)
        if ctx.rank == 0:
            assert got is not None and len(got) == ctx.world
            want = [random.Random(1000 * k + r).randbytes(size if r % 2 else sizes[-1 - k]) for r in range(ctx.world)]
            assert got == want, [len(g) for g in got]
        else:
            assert got is None
        said = random.Random(k).randbytes(size)
        heard = collectives.from_first(said if ctx.rank == 0 else None, ctx.group)
        assert heard == said, (len(heard), size)
    return {"sizes": sizes}


def priced_at_first_batch(ctx: Ctx) -> dict[str, Any]:
    """A layer list cut by hand and watched by a RunCalibrator built before its first step: the first batch's
    first micro-batch is counted on rank 0 and handed to every rank, which keeps it as the pipeline's profile and
    the calibration's prior (the wide layers priced above the narrow ones); the calibration then spreads each
    stage's measured cost over its layers as that profile does. A pipeline nobody calibrates is not priced."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from stagewise.runtime.calibration.from_run import RunCalibrator

    widths = [(64, 64), (64, 4096), (4096, 64), (64, 64)] * ctx.world
    layers = [sw.Layer(nn.Linear, a, b, dtype=torch.float64) for a, b in widths]
    x, y = torch.randn(32, 64, dtype=torch.float64), torch.randn(32, 64, dtype=torch.float64)

    def pipe() -> sw.Pipeline:
        return sw.Pipeline(layers, loss_fn=F.mse_loss, schedule="1f1b", microbatches=4, group=ctx.group,
                           partition=[4] * ctx.world)  # fmt: skip

    plain = pipe()
    plain.train_step(x, y)
    assert plain.layer_profile is None and not plain.prior_wanted
    watched = pipe()
    calibrator = RunCalibrator(watched, cores=ctx.world, warmup=1, after=2)
    for _ in range(3):
        watched.train_step(x, y)
        calibrator.observe()
    profile = watched.layer_profile
    assert profile is not None and calibrator.prior is profile
    times = profile.times()
    assert all(min(times[k + 1], times[k + 2]) > 3 * max(times[k], times[k + 3]) for k in range(0, len(times), 4))
    assert calibrator.calibration is not None
    scaled = calibrator.calibration.profile(profile).layers
    ratios = [a.forward / b.forward for a, b in zip(scaled, profile.layers)]
    for stage in range(ctx.world):  # one factor per stage and kind: its layers keep the priced proportions
        mine = ratios[4 * stage : 4 * stage + 4]
        assert max(mine) <= min(mine) * (1 + 1e-9), ratios
    model = torch.nn.Sequential(*[nn.Linear(a, b, dtype=torch.float64) for a, b in widths])
    whole = sw.Pipeline.from_model(model, loss_fn=F.mse_loss, schedule="1f1b", microbatches=4, group=ctx.group)
    assert whole.layer_profile is None  # cut by parameters: no sample inputs
    RunCalibrator(whole, cores=ctx.world)
    whole.train_step(x, y)
    blocks = whole.layer_profile
    assert blocks is not None and blocks.names == list(whole.model_cut.blocks), blocks
    assert blocks.times() == times  # the same layers counted the same, block to block
    return {"times": [round(t, 12) for t in times]}


def checks(world: int) -> dict[str, Callable[[Ctx], Any]]:
    return {
        "priced_at_first_batch": priced_at_first_batch,
        "from_the_run": from_the_run,
        "replicas_link": replicas_link,
        "replan_live": replan_live,
        "calibrated": calibrated,
        "across_nodes": across_nodes,
        "sharded_meter": sharded_meter,
        "compute_scale": compute_scale,
        "watched_by_a_lead": watched_by_a_lead,
        "one_way_messages": one_way_messages,
    }
