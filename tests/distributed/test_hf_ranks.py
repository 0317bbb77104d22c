"""``Pipeline.from_hf`` on 2 and 4 gloo ranks (issues 15 and 31): tests/distributed/workers/hf_checks.py in the
shared 2-rank job and a 4-rank job of its own; each test asserts one check on every rank.

CI runs ``checks(ranks)``: every family once (but those that differ from Llama only inside its decoder layers,
``LAYERS_ONLY``, and those it trains in another check, ``ELSEWHERE``), the tied sum under one schedule per placement
and backward split (``TIED_CI``), padding, packing and inputs at 2 ranks; the parallel axes and the checkpoint at
4. ``make hf-grid`` sets STAGEWISE_HF_GRID to a file: the module then runs the whole grid (every family x 1f1b and
zb-v x tied and untied, and the tied sum under every schedule, 2 and 4 ranks) and writes the table of measured
errors there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers.torchrun import Share, suites_by_ranks
from hf_checks import checks

GRID = os.environ.get("STAGEWISE_HF_GRID")
SUITE = "grid" if GRID else "ci"
CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks, SUITE)]


#: 2 ranks in the shared 2-rank job; 4 ranks alone: its meshes come first (a tied group made by some ranks only
#: leaves gloo's later groups over all ranks hanging), and the grid runs jobs of its own
SHARE = () if GRID else (Share("hf_checks", tuple(checks(2, SUITE)), 480, ranks=2),)
suites = suites_by_ranks(
    "hf_checks", "hf", timeout=2400 if GRID else 480, suite=None if SUITE == "ci" else SUITE, shared=SHARE
)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_check(suites, ranks: int, name: str) -> None:
    suites(ranks).get(name)


@pytest.mark.skipif(not GRID, reason="make hf-grid writes the grid's table")
def test_grid_table(suites) -> None:
    """The worst errors of each family over the grid, as a markdown table in STAGEWISE_HF_GRID: the loss, the
    gradients against the model run on the pipeline's micro-batches, and against the model on the whole batch."""
    keys = ("loss_err", "grad_err", "whole_batch_grad_err")
    rows: dict[str, dict[str, float]] = {}
    for ranks in (2, 4):
        for by_rank in suites(ranks).by_check.values():
            infos = [res["info"] for res in by_rank.values() if res["ok"] and res["info"]]
            if len(infos) < ranks or "family" not in infos[0]:
                continue  # a failed cell fails its own test
            row = rows.setdefault(infos[0]["family"], dict.fromkeys((*keys, "cells"), 0.0))
            for key in keys:
                row[key] = max(row[key], *(info[key] for info in infos))
            row["cells"] += 1
    lines = [
        "| family | cells | loss error | gradient error (micro-batches) | gradient error (whole batch) |",
        "|---|---:|---:|---:|---:|",
    ]
    for family, r in sorted(rows.items()):
        lines.append(f"| {family} | {r['cells']:.0f} | {r['loss_err']:.1e} | {r['grad_err']:.1e} | "
                     f"{r['whole_batch_grad_err']:.1e} |")  # fmt: skip
    Path(GRID).write_text("\n".join(lines) + "\n")
