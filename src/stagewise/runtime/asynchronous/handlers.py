"""The version-aware handlers: the engine's, each told by the version table which weights to use.

They take the place of F, B, SYNC and STEP in the interpreter's table (:mod:`..engine.interpreter`), registered
by the assembly for an asynchronous schedule; the interpreter runs them as any other.

Roughly, for a train step of an asynchronous schedule (eval steps run as usual, on the live weights):

  F     run the stage on the snapshot of ``table.forward[s][i]`` (made from the current weights if new)
  B     differentiate the snapshot of ``table.backward[s][i]``: through the forward's own graph, or, when the
        table says so (policy ``none``), through the stage recomputed from the saved input at that version;
        the weight gradients go to the micro-batch's mini-batch sum, the input gradient back as usual
  SYNC  the mini-batch's summed gradient becomes ``.grad``; then the usual sync hooks
  STEP  keep the version being replaced if the table says a later action uses it; step; count the version

After each F and B the versions the table says nobody uses again are freed.
No branch here knows a schedule's name: only the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...asynchronous import VersionTable
from ...ir import Action, Kind
from ..engine.compute import Compute, Handler
from ..engine.hooks import StageHooks
from ..engine.run import Run, Saved
from ..engine.tree import flatten
from .versions import StageVersions, VersionedStage


class AsyncHandlers:
    """F, B, SYNC and STEP of an asynchronous schedule's train steps, following the window's
    :class:`~stagewise.asynchronous.versions.VersionTable` (``run.table``); and a part of every run (a
    :class:`~..engine.runner.StepPart`): a train window counts its versions afresh.

    ``compute``: the handlers of the stages ``versioned`` (eval steps run through them, on the live weights);
    ``hooks``: SYNC and STEP as any schedule's.
    """

    def __init__(
        self,
        compute: Compute,
        hooks: StageHooks,
        versioned: dict[int, VersionedStage],
        versions: dict[int, StageVersions],
    ) -> None:
        self.compute = compute
        self.hooks = hooks
        self.versioned = versioned
        self.versions = versions

    def handlers(self) -> dict[Kind, Handler]:
        """What they take the place of in the interpreter's table."""
        return {Kind.F: self.forward, Kind.B: self.backward, Kind.SYNC: self.sync, Kind.STEP: self.step}

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        """A train window starts with its versions counted afresh (from the weights the last one left)."""
        if run.mode == "train":
            for v in self.versions.values():
                v.reset()
        yield

    def after(self, run: Run) -> None:
        """(Nothing after a run.)"""

    def forward(self, run: Run, a: Action) -> None:
        if run.mode != "train":
            self.compute.forward(run, a)
            return
        table: VersionTable = run.table
        assert a.microbatch is not None
        s, i = a.stage, a.microbatch
        stage = self.versioned[s]
        stage.using = self.versions[s].weights(table.forward[s][i])
        try:
            self.compute.forward(run, a)
        finally:
            stage.using = None
        if table.recompute_backward:
            run.kept_inputs[(s, i)] = stage.last_input
        self._release(table, a)

    def backward(self, run: Run, a: Action) -> None:
        table: VersionTable = run.table
        assert a.microbatch is not None
        s, i = a.stage, a.microbatch
        compute = self.compute
        saved = run.saved.pop((s, i))
        weights = self.versions[s].weights(table.backward[s][i])
        if table.recompute_backward:
            saved = self._recomputed(run, s, i, saved, weights)
        grads = compute.output_grads(run, s, i, len(saved.roots))
        run.ready()
        pairs = [(r, g) for r, g in zip(saved.roots, grads) if r.requires_grad]
        trained = [k for k, w in enumerate(weights) if w.requires_grad]
        wanted = list(saved.inputs) + [weights[k] for k in trained]
        got: list[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            got = list(torch.autograd.grad([r for r, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        n_in = len(saved.inputs)
        compute.hand_back(run, s, i, saved.inputs, got[:n_in])
        per_param: list[torch.Tensor | None] = [None] * len(weights)
        for k, g in zip(trained, got[n_in:]):
            per_param[k] = g
        self.versions[s].add(i // table.microbatches, per_param)
        self._release(table, a)

    def _recomputed(self, run: Run, s: int, i: int, saved: Saved, weights: list[torch.Tensor]) -> Saved:
        """The stage's forward again, from the saved input, on ``weights`` (the version current at the backward)."""
        stage = self.versioned[s]
        stage.using = weights
        try:
            with torch.enable_grad(), _statistics_left_alone(stage.holder):  # the F updated them once
                out = stage(run.kept_inputs.pop((s, i)))
        finally:
            stage.using = None
        if s == self.compute.last:
            record = run.record
            reported = record.losses[i]
            loss = self.compute.loss(run, out, i)
            record.losses[i] = reported  # the loss the forward saw is the one reported
            return Saved(saved.inputs, [loss * record.weights[i]])  # type: ignore[index]
        return Saved(saved.inputs, [t for t in flatten(out)[0] if t.requires_grad])

    def sync(self, run: Run, a: Action) -> None:
        versions = self.versions[a.stage]
        versions.load_gradient(versions.current)  # SYNC k closes mini-batch k, before STEP k
        self.hooks.sync(run, a)

    def step(self, run: Run, a: Action) -> None:
        table: VersionTable = run.table
        versions = self.versions[a.stage]
        keep = table.keep_at_step[a.stage]
        versions.before_step(versions.current < len(keep) and keep[versions.current])
        self.hooks.step(run, a)
        versions.after_step()

    def _release(self, table: VersionTable, a: Action) -> None:
        gone = table.release[a.stage].get(str(a))
        if gone:
            self.versions[a.stage].release(gone)


@contextmanager
def _statistics_left_alone(module: nn.Module) -> Iterator[None]:
    """``module``'s BatchNorm layers normalise as in training but leave their running statistics alone (no update,
    none saved for the backward): the recomputed forward of ``stashing=False``, whose F counted already. (Under
    ``"micro"`` the batchnorm feature's hooks would run it as the F did and copy the statistics back, in place,
    under a graph that saved them: its backward failed, "modified by an inplace operation".)"""
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    for bn in layers:
        bn.track_running_stats = False
    try:
        yield
    finally:
        for bn in layers:
            bn.track_running_stats = True
