"""Dump torch's own compute orders as stagewise compute-only CSV files (needs torch; run by hand).

``python tests/golden/torch/generate.py`` rewrites every ``<Class>-p<p>-m<m>-v<v>.csv`` here from torch's
``pipeline_order`` tables (torch.distributed.pipelining.schedules, torch 2.13), for p in {2, 4, 8} and
m in {p, 2p, 4p}, and ``index.json`` (which stagewise schedule each class is compared with, at which v and
placement). tests/core/test_orders_vs_torch.py and benchmarks/orders_vs_torch.py read the files, so neither
needs torch.

To be switched to ``Schedule.from_torch`` when that lands: this script reads torch's tables itself. A torch
schedule class only asks its stage objects for their sizes and indices, so plain namespaces stand in for
them (as torch's own tests do with their mock stages); the tables are pure arithmetic on (p, v, m).

How a table is read:

* ``None`` slots (torch's picture of idle time) are dropped: stagewise's simulator times the order itself;
* ``REDUCE_GRAD`` (GPipe, 1F1B) is dropped: stagewise's lowering adds its own gradient sync;
* an ``OVERLAP_F_B`` (DualPipeV) becomes its forward, then its full backward: stagewise runs actions one
  after the other;
* Schedule1F1B's table numbers the last rank's forwards from 1 (B0 comes before any F0, and F<m> is out of
  range): they are moved back by one micro-batch. Its run loop, not the table, is what torch executes.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).parent
SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
#: torch class name -> (the stagewise schedule of the same design, virtual stages per rank, placement);
#: written to index.json, which the readers use. InterleavedZeroBubble at one stage per rank is ZB-H1
#: (its rank r runs r input gradients before its first W); at two it has no stagewise counterpart.
CLASSES = {
    "GPipe": ("gpipe", 1, "loop"),
    "1F1B": ("1f1b", 1, "loop"),
    "Interleaved1F1B": ("interleaved-1f1b", 2, "loop"),
    "LoopedBFS": ("looped-bfs", 2, "loop"),
    "InterleavedZeroBubble": ("zb-h1", 1, "loop"),
    "ZBVZeroBubble": ("zb-v", 2, "v"),
    "DualPipeV": ("dualpipe-v", 2, "v"),
}
_COMPUTE = {"F", "B", "I", "W"}


def _stages(p: int, v: int) -> list[SimpleNamespace]:
    """Rank 0's stand-in stages: all that a schedule's constructor reads of them."""
    n = p * v
    return [
        SimpleNamespace(
            num_stages=n, group_size=p, group_rank=0, stage_index=s, is_first=s == 0, is_last=s == n - 1, submod=None
        )
        for s in range(v)
    ]


def torch_order(name: str, p: int, m: int, v: int) -> list[list[str]] | None:
    """Each rank's compute actions in torch's text form, or None where torch's class refuses the size."""
    from torch.distributed.pipelining import schedules

    cls = schedules.get_schedule_class(name)
    stages = _stages(p, v)
    try:
        sched: Any = cls(stages[0], m) if v == 1 and name in ("GPipe", "1F1B") else cls(stages, m)
    except ValueError:
        return None
    rows = []
    for rank in range(p):
        acts = []
        for a in sched.pipeline_order[rank]:
            if a is None:
                continue
            parts = a.sub_actions if a.sub_actions else (a,)
            acts += [b for b in parts if b.computation_type.value in _COMPUTE]
        if name == "1F1B" and rank == p - 1:  # the table's off-by-one (see the module docstring)
            acts = [
                type(b)(b.stage_index, b.computation_type, b.microbatch_index - 1)
                if b.computation_type.value == "F"
                else b
                for b in acts
            ]
        rows.append([str(b) for b in acts])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the CSV files (default: this one)")
    args = parser.parse_args()
    index = {}
    for name, (schedule, v, placement) in CLASSES.items():
        index[name] = {"schedule": schedule, "virtual_stages": v, "placement": placement}
        for p, m in SIZES:
            rows = torch_order(name, p, m, v)
            if rows is None:  # DualPipeV needs m >= 2p
                continue
            with open(args.out / f"{name}-p{p}-m{m}-v{v}.csv", "w", newline="") as f:
                csv.writer(f, lineterminator="\n").writerows(rows)
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
