"""Dump torch's own orders into the CSV files here (needs torch; run by hand when torch changes).

``python tests/golden/torch/generate.py`` rewrites every ``<Class>-p<p>-m<m>-v<v>.csv`` here with
``stagewise.runtime.torch_order(...).save_csv(...)`` - exactly what torch's own ``_dump_csv`` writes of the
class's ``pipeline_order`` table - for p in {2, 4, 8} and m in {p, 2p, 4p}, and ``index.json`` (which
stagewise schedule each class is compared with, at which v and placement). tests/core/test_orders_vs_torch.py
and benchmarks/orders_vs_torch.py read the files with ``stagewise.from_torch``, so neither needs torch.

Schedule1F1B's table numbers the last rank's forwards one too high (B0 before any F0: refused by the
validator), so it is read as its ``step()`` runs it (``read="step"``), which torch executes. Idle slots,
REDUCE_GRAD (read as SYNC) and OVERLAP_F_B (read as its forward, then its full backward) are
``from_torch``'s to read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stagewise.runtime import torch_order

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the CSV files (default: this one)")
    args = parser.parse_args()
    index = {}
    for name, (schedule, v, placement) in CLASSES.items():
        index[name] = {"schedule": schedule, "virtual_stages": v, "placement": placement}
        for p, m in SIZES:
            try:
                order = torch_order(name, p, m, v, read="step" if name == "1F1B" else "pipeline_order")
            except ValueError:  # torch refuses the size (DualPipeV needs m >= 2p)
                continue
            order.save_csv(args.out / f"{name}-p{p}-m{m}-v{v}.csv")
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
