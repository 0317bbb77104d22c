"""Proof that a seam is a seam (issue 47): a feature written only for this test registers in one line, takes part
in every run through the run value, sees each action the table handles as it runs, and leaves training exactly
as it was, without the interpreter knowing it (tests/core/test_seams.py holds the interpreter to that).

The feature, an action log: around each run it notes the run value; each handler it wraps checks that the run
it is given is that value and that ``run.current`` is the action being handled, then logs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.ir import Action, Kind
from stagewise.runtime.engine.compute import Handler
from stagewise.runtime.engine.run import Run


class ActionLog:
    """Every action a run handles, in order, seen through the run value; and the runs it took part in."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.runs: list[tuple[str, bool]] = []  # (mode, whether the run only accumulated)
        self.seen: list[Action] = []

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        self.run = run
        yield
        self.run = None

    def after(self, run: Run) -> None:
        self.runs.append((run.mode, run.accumulate))

    def wrap(self, kind: Kind, handler: Handler) -> Handler:
        def logged(run: Run, action: Action) -> None:
            assert run is self.run and run.current == action and action.kind is kind
            self.seen.append(action)
            handler(run, action)

        return logged


def _pipe(schedule: str, v: int) -> sw.Pipeline:
    layers = [sw.Layer(nn.Linear, 6, 6, dtype=torch.float64) for _ in range(4)]
    sgd = lambda params: torch.optim.SGD(params, lr=0.25)  # noqa: E731
    return sw.Pipeline(layers, loss_fn=F.mse_loss, schedule=schedule, microbatches=2, virtual_stages=v, seed=3,
                       optimizer=sgd)  # fmt: skip


@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_a_feature_registers_in_one_line_and_sees_every_action_through_the_run(one_rank, schedule, v) -> None:
    g = torch.Generator().manual_seed(0)
    draw = lambda: torch.randn(4, 6, dtype=torch.float64, generator=g)  # noqa: E731
    batches = [(draw(), draw()) for _ in range(3)]
    plain, logged = _pipe(schedule, v), _pipe(schedule, v)
    log = ActionLog()
    logged._engine.add_part(log, wrap=log.wrap)  # the one line
    start = [p.detach().clone() for p in logged.parameters()]
    for x, y in batches[:2]:
        with plain.no_sync(), logged.no_sync():
            assert plain.train_step(x, y) == logged.train_step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(logged.parameters(), start))  # the runs only accumulated
    assert plain.train_step(*batches[2]) == logged.train_step(*batches[2])
    logged.eval_step(batches[0][0])
    handled = [a for a in logged.schedule.ranks[0] if not a.kind.is_comm]
    evaluated = [a for a in logged._engine.eval_schedule.ranks[0] if not a.kind.is_comm]
    assert log.seen == 3 * handled + evaluated  # every action the table handles, in the order run
    assert log.runs == [("train", True), ("train", True), ("train", False), ("eval", False)]
    assert {a.kind for a in log.seen} >= {Kind.F, Kind.STEP} and (v == 2 or Kind.W in {a.kind for a in log.seen})
    for (name, p), q in zip(plain.named_parameters(), logged.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)  # crossed the step, changed nothing
