"""``stagewise plan``: plan from a profile JSON or a synthetic transformer, print the top plans, write JSON / PNG."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..partition import LayerProfile
from ..planning import Calibration, Link, Plan, PlanSearch
from ..planning.units import in_unit, parse_bytes, unit_for
from .common import Subparsers

_HELP = """\
Search layouts (pp x dp x sharding x tp), schedules, virtual stages,
micro-batch counts, partitions and recompute for the fastest plans that fit
memory, and print them best first. The profile is per-layer times and sizes of
one micro-batch (LayerProfile.to_json, e.g. from stagewise.profile, which
records the micro-batch's samples; --profile-batch for a file that does not),
or --synthetic, a GPT-like stack:
"blocks=32,hidden=4096,seq=2048,vocab=50000,heads=32,flops=4e14" (flops=,
the device's FLOP/s, is required: every predicted time scales with it),
or --hf, a transformers config built here and profiled per decoder layer
(what Pipeline.from_hf and Pipeline.from_plan(plan, model) cut), e.g.
"llama:num_hidden_layers=8,hidden_size=256,num_attention_heads=4" or a
local config.json.
Links and the runtime's own costs come from --calibration, a file saved with
sw.calibrate(...).save(path) on the group that will run the plan; without it
(or --intra) every transfer and collective is free, which flatters data
parallelism and sharding.
Without --memory no plan is dropped for its memory: the output then says how
much the top plan needs per process.
Columns: step = predicted seconds per training step, run back to back (see
stagewise.Plan); bubble = simulated idle share of the pipeline ranks; peak =
the largest predicted per-rank memory (in the unit the why column uses); why =
what the plan gains over the next one. A top plan whose pipeline ranks idle
over 30% of the step gets a notice saying why.
"""


def add_command(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "plan",
        help="plan layout, schedule and partition",
        description=_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", metavar="PATH", help="LayerProfile JSON")
    src.add_argument("--synthetic", metavar="SPEC", help="a synthetic transformer, key=value pairs")
    src.add_argument(
        "--hf",
        metavar="CONFIG",
        help="a transformers causal LM, built locally (no download) and profiled per decoder layer as from_hf cuts "
        "it: a config.json path (or its folder), or MODEL_TYPE:key=value,... (e.g. llama:num_hidden_layers=8)",
    )
    parser.add_argument(
        "--seq", type=int, default=128, metavar="S", help="--hf: tokens per sample of the profiled micro-batch"
    )
    parser.add_argument("-n", "--processes", type=int, required=True, metavar="N", help="number of processes")
    parser.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes the processes are packed on")
    parser.add_argument("--global-batch", type=int, required=True, metavar="B", help="samples per step")
    parser.add_argument(
        "--profile-batch",
        type=int,
        default=None,
        metavar="B",
        help="samples in the profiled micro-batch (default: what the profile records; required when it does not)",
    )
    parser.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help="memory per process with its unit, e.g. 16GiB or 512MiB (as sw.plan(memory=...) takes it): plans that "
        "need more are dropped (default: no cap, every plan fits)",
    )
    parser.add_argument("--optimizer-state", type=float, default=2.0, metavar="K", help="state bytes per param byte")
    parser.add_argument(
        "--calibration",
        metavar="PATH",
        help="a calibration saved from sw.calibrate() (Calibration.save): links, the runtime's costs, cores",
    )
    parser.add_argument(
        "--intra", default=None, metavar="LAT:BW", help="intra-node link: seconds:bytes/s (default: calibrated)"
    )
    parser.add_argument("--inter", default=None, metavar="LAT:BW", help="inter-node link (default: --intra)")
    parser.add_argument("--tp-layers", default="", metavar="LIST", help="layers that support tp: all, or 1-8,10")
    parser.add_argument("--schedules", default=None, metavar="A,B", help="schedules to try (default: all sync)")
    parser.add_argument("--overhead", type=float, default=0.0, metavar="S", help="seconds per F/I/W not scaling")
    parser.add_argument(
        "--action-overhead", type=float, default=0.0, metavar="S", help="runtime seconds per stage F and per B"
    )
    parser.add_argument(
        "--cores", type=float, default=None, metavar="N", help="cores per node, when fewer than its processes"
    )
    parser.add_argument(
        "--compute-scale",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="K",
        help="the runtime's compute over the plan's: one factor, or F B [I+W] (sw.runtime.measure_compute_scale)",
    )
    parser.add_argument("--top", type=int, default=5, metavar="K", help="plans to keep (default 5)")
    parser.add_argument(
        "--best-per-layout",
        action="store_true",
        help="list the best plan of each layout (the top K layouts) rather than the top K plans",
    )
    parser.add_argument("--json", metavar="PATH", help="write the plans and the search summary as JSON")
    parser.add_argument("--png", metavar="PATH", help="draw the best plan's simulated timeline")
    parser.set_defaults(handler=run_plan)


def _link(text: str, flag: str) -> Link:
    try:
        lat, bw = text.split(":")
        return Link(float(lat), float(bw))
    except ValueError as err:
        raise ValueError(f"{flag} must be LATENCY:BANDWIDTH (seconds:bytes per second), got {text!r} ({err})") from None


def _tp_layers(text: str, n: int) -> list[int]:
    if not text:
        return []
    if text == "all":
        return list(range(n))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"--tp-layers: expected 'all' or ranges like 1-8,10, got {part!r}") from None
    return out


def _synthetic(spec: str) -> LayerProfile:
    from ..planning import transformer_profile

    kwargs: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in ("blocks", "hidden", "seq", "vocab", "heads", "flops"):
            raise ValueError(f"--synthetic: unknown key {key!r}; known: blocks, hidden, seq, vocab, heads, flops")
        try:
            kwargs[key] = float(value) if key == "flops" else int(value)
        except ValueError:
            raise ValueError(f"--synthetic: {key} must be a number, got {value!r}") from None
    if "flops" not in kwargs:
        raise ValueError(
            "--synthetic: give flops=, the FLOP/s one process's device sustains (every predicted time scales with "
            "it): e.g. flops=4e14 for a recent GPU in bf16, flops=5e10 for a CPU core; or profile the real model "
            "on the machine (sw.profile, --profile, or --hf for a transformers config)"
        )
    return transformer_profile(**kwargs)


def _load(args: argparse.Namespace) -> LayerProfile:
    if args.synthetic is not None:
        return _synthetic(args.synthetic)
    if args.hf is not None:
        from ..runtime.frontends.hf.profile import profile_config

        return profile_config(args.hf, seq=args.seq, batch=args.profile_batch or 1)
    try:
        text = Path(args.profile).read_text()
    except OSError as err:
        raise ValueError(f"--profile {args.profile}: {err}") from None
    profile = LayerProfile.from_json(text)
    given, recorded = args.profile_batch, profile.batch
    if recorded is None and given is None:
        raise ValueError(
            f"--profile {args.profile} does not record the samples it was measured on: pass --profile-batch B "
            "(every predicted time scales with it; sw.profile records it)"
        )
    if recorded is not None and given is not None and given != recorded:
        raise ValueError(
            f"--profile-batch {given}, but --profile {args.profile} was measured on micro-batches of {recorded} "
            "samples; leave --profile-batch out"
        )
    return profile


def _memory(args: argparse.Namespace) -> float:
    """``--memory``: a size with its unit (a bare number is refused: the API's is bytes, the old CLI's GiB)."""
    return math.inf if args.memory is None else parse_bytes(args.memory, "--memory", bare=False)


def _calibration(args: argparse.Namespace) -> Calibration | None:
    return None if args.calibration is None else Calibration.load(args.calibration)


def _warnings(args: argparse.Namespace, cal: Calibration | None) -> list[str]:
    """What makes these plans less trustworthy than they look, one line each."""
    out = []
    if args.intra is None and (cal is None or not cal.links_measured):
        out.append(
            "links are not calibrated: every transfer and collective is free in these plans, which favours "
            "data parallelism and sharding. Measure the group with sw.calibrate(...).save(path) and pass "
            "--calibration PATH (or give --intra LATENCY:BANDWIDTH)."
        )
    if cal is not None and cal.processes is not None and cal.processes != args.processes:
        out.append(
            f"--calibration {args.calibration} was measured on {cal.processes} processes, the plans are for "
            f"{args.processes}: its per-layout costs and cores hold for {cal.processes} only."
        )
    if cal is not None and args.nodes > 1 and cal.inter is None and args.inter is None:
        out.append(f"--nodes {args.nodes}, but the calibration has no link between nodes: they cost as one node's.")
    return out


def run_plan(args: argparse.Namespace) -> int:
    from ..planning import search

    profile = _load(args)
    cal = _calibration(args)
    result = search(
        profile,
        args.processes,
        nodes=args.nodes,
        global_batch=args.global_batch,
        profile_batch=args.profile_batch,
        memory=_memory(args),
        optimizer_state=args.optimizer_state,
        intra=None if args.intra is None else _link(args.intra, "--intra"),
        inter=None if args.inter is None else _link(args.inter, "--inter"),
        tp_layers=_tp_layers(args.tp_layers, len(profile)),
        schedules=None if args.schedules is None else args.schedules.split(","),
        overhead=args.overhead,
        action_overhead=args.action_overhead,
        compute_scale=args.compute_scale[0] if len(args.compute_scale) == 1 else args.compute_scale,
        calibration=cal,
        cores=args.cores,
        top=args.top,
        best_per_layout=args.best_per_layout,
    )
    warnings = _warnings(args, cal)
    _print_table(result, warnings, args.best_per_layout)
    for line in _notices(args, result.plans[0]):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(_report(result, warnings), indent=1))
    if args.png:
        _draw(result.plans[0], args.png)
    return 0


def _report(result: PlanSearch, warnings: list[str]) -> dict[str, Any]:
    return {
        "warnings": warnings,
        "plans": [p.to_dict() for p in result.plans],
        "search": {
            "layouts": result.layouts,
            "candidates": result.candidates,
            "groups_expanded": result.groups_expanded,
            "simulated": result.simulated,
            "dropped": len(result.dropped),
        },
    }


def _print_table(result: PlanSearch, warnings: list[str], per_layout: bool) -> None:
    """The plans as a table on stdout; each warning loud on stderr, before it and again under it."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    loud = Console(stderr=True, width=120)
    for text in warnings:
        loud.print(f"[bold yellow]warning:[/] {escape(text)}", highlight=False)
    what = "layouts, each with its best plan" if per_layout else "plans"
    table = Table(
        title=f"top {len(result.plans)} {what} ({result.candidates} candidates, {result.simulated} simulated)"
    )
    for col in (
        "#",
        "pp x dp x tp x sh",
        "schedule",
        "v",
        "m",
        "partition",
        "recompute",
        "step s",
        "bubble",
        "peak",
        "why",
    ):
        table.add_column(col)
    unit = unit_for(max((p.peak_memory for p in result.plans if not math.isinf(p.peak_memory)), default=0.0))
    for k, p in enumerate(result.plans, 1):
        c = p.layout
        part = " ".join(map(str, p.partition))
        table.add_row(
            str(k),
            f"{c.pp} x {c.dp} x {c.tp} x {c.sharding}",
            p.schedule,
            str(p.virtual_stages),
            str(p.microbatches),
            part if len(part) <= 24 else part[:21] + "...",
            p.recompute or "off",
            f"{p.step_time:.4g}",
            f"{p.bubble:.1%}",
            in_unit(p.peak_memory, unit),  # one unit for the column, the why column's too
            p.why,
        )
    Console(width=200).print(table)
    if warnings:
        loud.print(f"[bold yellow]{len(warnings)} warning(s) above: these predictions may mislead.[/]")


_LARGE_BUBBLE = 0.30  # a top plan idling its pipeline ranks more than this gets a notice


def _notices(args: argparse.Namespace, best: Plan) -> list[str]:
    """What the defaults hide about the top plan, one line each: no memory cap, a large bubble and why."""
    out = []
    if math.isinf(_memory(args)):
        need = in_unit(best.peak_memory, unit_for(best.peak_memory))
        out.append(
            f"note: no memory cap was set (--memory): the top plan needs {need} per process; pass --memory SIZE "
            "(e.g. 16GiB) to keep to what a device holds"
        )
    if best.layout.pp > 1 and best.bubble > _LARGE_BUBBLE:
        out.append(
            f"notice: the top plan leaves its pipeline ranks idle {best.bubble:.0%} of the step: {_why_idle(best)}"
        )
    return out


def _why_idle(plan: Plan) -> str:
    """Why a plan's pipeline ranks idle: uneven stages (the busiest rank's work over the average), or the fill and
    drain of a pipeline with few micro-batches ((p - 1) / (v m + p - 1) with equal stages)."""
    p, v, m = plan.layout.pp, plan.virtual_stages, plan.microbatches
    fill = (p - 1) / (v * m + p - 1)
    drain = f"the pipeline fills and drains once a step, about {fill:.0%} of it with {m} micro-batches over {p} ranks"
    load = _rank_loads(plan)
    uneven = max(load) / (sum(load) / len(load)) if load and sum(load) > 0 else 1.0
    if uneven > 1.25:
        return (
            f"its stages are uneven - the busiest pipeline rank computes {uneven:.1f}x the average "
            f"(partition {' '.join(map(str, plan.partition))}), and the others wait for it; {drain}. "
            "It is still the fastest plan found"
        )
    return f"{drain}; more micro-batches (a larger --global-batch) or fewer pipeline ranks would shrink it"


def _rank_loads(plan: Plan) -> list[float]:
    """Each pipeline rank's compute per micro-batch (forward and backward of its stages), from the plan's costs."""
    costs = plan.costs
    if costs is None:
        return []
    from ..ir import loop_placement, v_placement
    from ..schedules import schedule_info

    p, v = plan.layout.pp, plan.virtual_stages
    if plan.synthesized is not None:
        placement = tuple(plan.synthesized.placement)
    else:
        loop = schedule_info(plan.schedule).placement == "loop"
        placement = tuple(loop_placement(p, v) if loop else v_placement(p, v))
    load = [0.0] * p
    for s, rank in enumerate(placement[: costs.num_stages]):
        load[rank] += costs.forward[s] + costs.backward_input[s] + costs.backward_weight[s]
    return load


def _draw(plan: Plan, path: str) -> None:
    """The best plan's simulated timeline; a plan's costs are seconds, so the axis says seconds."""
    from dataclasses import replace

    from ..passes import add_grad_sync
    from ..render import render_png
    from ..schedules import generate
    from ..simulation import simulate

    schedule = add_grad_sync(generate(plan.schedule, plan.layout.pp, plan.microbatches, plan.virtual_stages))
    timeline = replace(simulate(schedule, plan.costs).timeline, unit="s")
    render_png(timeline, path, title=f"{plan.describe()}: {plan.step_time:.4g} s")
