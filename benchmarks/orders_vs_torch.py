"""Our schedules' orders against torch's orders of the same schedules, in stagewise's simulator.

For every order stored in tests/golden/torch (torch 2.13's own ``pipeline_order`` tables, written by its
generate.py; index.json names the stagewise schedule each one is compared with) this simulates ours and torch's
with uniform stage costs at transfer times 0, F/4, F/2 and F, and prints one markdown table per cost setting:
per schedule, at each transfer time, the makespan ratio ours / torch's over the grid (p in {2, 4, 8}, m in
{p, 2p, 4p}) as "worst (best)", and the largest peak activations in micro-batches (F until I or B, the busiest
rank), ours / torch's. ``--full`` prints every size's makespans instead (``*`` where ours is slower). Pure
simulation: no torch, no processes, a few seconds. A benchmark, not a test (tests/core/test_orders_vs_torch.py
checks the grid); results go to benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.orders_vs_torch [--costs uniform i-heavy w-heavy] [--transfers 0 0.25 0.5 1]
        [--schedules zb-v dualpipe-v] [--full]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import stagewise as sw
from stagewise.ir import Schedule, loop_placement, v_placement
from stagewise.simulation import CostModel, simulate

TORCH = Path(__file__).resolve().parents[1] / "tests" / "golden" / "torch"
#: name -> (I, W) with F = 1
COSTS = {"uniform": (1.0, 1.0), "i-heavy": (1.5, 0.5), "w-heavy": (0.5, 1.5)}
Row = tuple[str, str, int, int, int, Schedule]  # schedule, torch class, p, m, v, torch's order
LABEL = {"uniform": "F = I = W", "i-heavy": "I = 1.5F, W = F/2", "w-heavy": "I = F/2, W = 1.5F"}


def stored_orders(schedules: list[str] | None) -> list[Row]:
    """(stagewise schedule, torch class, p, m, v, torch's order) for every stored order, in table order."""
    index = json.loads((TORCH / "index.json").read_text())
    found = []
    for path in TORCH.glob("*.csv"):
        name, p_, m_, v_ = path.stem.rsplit("-", 3)
        p, m, v = int(p_[1:]), int(m_[1:]), int(v_[1:])
        entry = index[name]
        if schedules and entry["schedule"] not in schedules:
            continue
        placement = loop_placement(p, v) if entry["placement"] == "loop" else v_placement(p, v)
        order = sw.from_torch(path, name=f"torch {name}", placement=placement, num_microbatches=m)
        found.append((entry["schedule"], name, p, m, v, order))
    rank = {name: i for i, name in enumerate(sw.schedule_names())}
    return sorted(found, key=lambda row: (rank[row[0]], row[2], row[3]))


def makespan(schedule: Schedule, costs: tuple[float, float], transfer: float) -> float:
    model = CostModel.uniform(
        schedule.num_stages, backward_input=costs[0], backward_weight=costs[1], comm_time=transfer
    )
    return simulate(schedule, model).makespan


def full_table(rows: list[Row], costs: str, transfers: list[float]) -> list[str]:
    head = " | ".join(f"c = {c:g}F" for c in transfers)
    lines = [
        f"#### {LABEL[costs]} (B = I + W): makespan ours / torch's, `*` where ours is slower",
        "",
        f"| schedule | p | m | {head} | peak ours / torch's |",
        "|---|---|---|" + "---|" * len(transfers) + "---|",
    ]
    for schedule, _, p, m, v, theirs in rows:
        ours = sw.schedules.generate(schedule, p, m, v)
        cells = []
        for c in transfers:
            a, b = makespan(ours, COSTS[costs], c), makespan(theirs, COSTS[costs], c)
            cells.append(f"{a:g} / {b:g}" + (" *" if a > b + 1e-9 else ""))
        lines.append(f"| `{schedule}` | {p} | {m} | " + " | ".join(cells) + f" | {peaks(ours, theirs)} |")
    return lines


def summary_table(rows: list[Row], costs: str, transfers: list[float]) -> list[str]:
    head = " | ".join(f"c = {c:g}F" for c in transfers)
    lines = [
        f"#### {LABEL[costs]} (B = I + W): makespan ours / torch's over the grid, worst (best)",
        "",
        f"| schedule | {head} | largest peak ours / torch's |",
        "|---|" + "---|" * len(transfers) + "---|",
    ]
    names = list(dict.fromkeys(row[0] for row in rows))
    for schedule in names:
        mine = [row for row in rows if row[0] == schedule]
        ratios: list[list[float]] = [[] for _ in transfers]
        peak_ours = peak_theirs = 0.0
        for _, _, p, m, v, theirs in mine:
            ours = sw.schedules.generate(schedule, p, m, v)
            for j, c in enumerate(transfers):
                ratios[j].append(makespan(ours, COSTS[costs], c) / makespan(theirs, COSTS[costs], c))
            peak_ours = max(peak_ours, max(simulate(ours).peak_activations))
            peak_theirs = max(peak_theirs, max(simulate(theirs).peak_activations))
        cells = " | ".join(f"{max(r):.3f} ({min(r):.3f})" for r in ratios)
        lines.append(f"| `{schedule}` | {cells} | {peak_ours:g} / {peak_theirs:g} |")
    return lines


def peaks(ours: Schedule, theirs: Schedule) -> str:
    return f"{max(simulate(ours).peak_activations):g} / {max(simulate(theirs).peak_activations):g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", nargs="+", choices=sorted(COSTS), default=["uniform", "i-heavy", "w-heavy"])
    parser.add_argument("--transfers", nargs="+", type=float, default=[0.0, 0.25, 0.5, 1.0], help="in units of F")
    parser.add_argument("--schedules", nargs="+", help="only these stagewise schedules (default: every one stored)")
    parser.add_argument("--full", action="store_true", help="every size's makespans, not the summary")
    args = parser.parse_args()
    rows = stored_orders(args.schedules)
    for costs in args.costs:
        lines = (full_table if args.full else summary_table)(rows, costs, args.transfers)
        print("\n".join(lines), end="\n\n")


if __name__ == "__main__":
    main()
