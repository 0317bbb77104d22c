"""The combination matrix on 4 gloo ranks: every way in x every option, exact or refused (``matrix_spec``).

torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks matrix_checks --out DIR

An exact cell trains two SGD steps through the schedule's STEP actions (float64) and compares, on every rank,
the loss of each step and every parameter (and buffer) it holds with the one-process model trained alike;
for an asynchronous schedule and HetPipe the reference is the one-process replay of their rule. Each column
checks what its option does, besides: BatchNorm's running statistics, a NaN batch raised or skipped, autocast
in the lower precision, the measured activation bytes, a checkpoint loaded into a fresh pipeline. A refused
cell must raise on every rank, naming the combination, before any process group is made.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.distributed_c10d as c10d

from matrix_build import build
from matrix_columns import COLUMNS
from matrix_protocol import PROTOCOL
from matrix_reference import exact
from matrix_spec import AT_USE, EXACT, cells, expected
from worker import Check, Ctx, raises


def checks(world: int) -> dict[str, Check]:
    assert world == 4, "the matrix runs on 4 ranks"
    out = {f"{row}-{column}": cell(row, column) for row, column in cells()}
    out.update(PROTOCOL)
    return out


def cell(row: str, column: str) -> Check:
    def check(ctx: Ctx) -> dict[str, Any] | None:
        want = expected(row, column)
        if column in AT_USE:  # a call on a built pipeline: its column checks the refusal itself
            return COLUMNS[column](row, column, ctx)
        if want != EXACT:
            groups = len(c10d._world.pg_map)
            raises(ValueError, want, lambda: build(row, column, ctx))
            assert len(c10d._world.pg_map) == groups, f"{row} x {column}: refused only after making process groups"
            return {"refused": want}
        if row == "hetpipe":
            from matrix_hetpipe import hetpipe_cell

            return hetpipe_cell(column, ctx)
        return COLUMNS.get(column, exact)(row, column, ctx)

    return check


__all__ = ["checks"]
