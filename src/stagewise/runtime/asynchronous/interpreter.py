"""The version-aware interpreter: the engine's handlers, each told by the version table which weights to use.

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

from typing import Any

import torch

from ...asynchronous import VersionTable
from ...ir import Action
from ..engine.interpreter import Interpreter, _Saved
from ..engine.tree import flatten
from .versions import StageVersions, VersionedStage


class AsyncInterpreter(Interpreter):
    """An :class:`Interpreter` whose train steps follow a :class:`~stagewise.asynchronous.versions.VersionTable`."""

    def __init__(self, base: Interpreter, stages: dict[int, VersionedStage], versions: dict[int, StageVersions]):
        super().__init__(
            rank=base.rank,
            placement=base.placement,
            stages=dict(stages),
            loss_fn=base.loss_fn,
            transport=base.transport,
            mailbox=base.mailbox,
            hooks=base.hooks,
        )
        self.slowdown = base.slowdown
        self.versioned = stages
        self.versions = versions
        self.table: VersionTable | None = None
        self.recompute_inputs: dict[tuple[int, int], Any] = {}

    def start_window(self, table: VersionTable) -> None:
        self.table = table
        self.recompute_inputs = {}
        for v in self.versions.values():
            v.reset()

    def _forward(self, a: Action) -> None:
        if self.step.mode != "train":
            super()._forward(a)
            return
        assert self.table is not None and a.microbatch is not None
        s, i = a.stage, a.microbatch
        stage = self.versioned[s]
        stage.using = self.versions[s].weights(self.table.forward[s][i])
        try:
            super()._forward(a)
        finally:
            stage.using = None
        if self.table.recompute_backward:
            self.recompute_inputs[(s, i)] = stage.last_input
        self._release(a)

    def _backward(self, a: Action) -> None:
        assert self.table is not None and a.microbatch is not None
        s, i = a.stage, a.microbatch
        saved = self.saved.pop((s, i))
        weights = self.versions[s].weights(self.table.backward[s][i])
        if self.table.recompute_backward:
            saved = self._recomputed(s, i, saved, weights)
        grads = self._output_grads(s, i, len(saved.roots))
        self._ready()
        pairs = [(r, g) for r, g in zip(saved.roots, grads) if r.requires_grad]
        trained = [k for k, w in enumerate(weights) if w.requires_grad]
        wanted = list(saved.inputs) + [weights[k] for k in trained]
        got: list[torch.Tensor | None] = [None] * len(wanted)
        if pairs and wanted:
            got = list(torch.autograd.grad([r for r, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        n_in = len(saved.inputs)
        self._hand_back(s, i, saved.inputs, got[:n_in])
        per_param: list[torch.Tensor | None] = [None] * len(weights)
        for k, g in zip(trained, got[n_in:]):
            per_param[k] = g
        self.versions[s].add(i // self.table.microbatches, per_param)
        self._release(a)

    def _recomputed(self, s: int, i: int, saved: _Saved, weights: list[torch.Tensor]) -> _Saved:
        """The stage's forward again, from the saved input, on ``weights`` (the version current at the backward)."""
        stage = self.versioned[s]
        stage.using = weights
        try:
            with torch.enable_grad():
                out = stage(self.recompute_inputs.pop((s, i)))
        finally:
            stage.using = None
        if s == self.last:
            reported = self.step.losses[i]
            loss = self._loss(out, i)
            self.step.losses[i] = reported  # the loss the forward saw is the one reported
            return _Saved(saved.inputs, [loss * self.step.weights[i]])  # type: ignore[index]
        return _Saved(saved.inputs, [t for t in flatten(out)[0] if t.requires_grad])

    def _sync(self, a: Action) -> None:
        versions = self.versions[a.stage]
        versions.load_gradient(versions.current)  # SYNC k closes mini-batch k, before STEP k
        super()._sync(a)

    def _step(self, a: Action) -> None:
        assert self.table is not None
        versions = self.versions[a.stage]
        keep = self.table.keep_at_step[a.stage]
        versions.before_step(versions.current < len(keep) and keep[versions.current])
        super()._step(a)
        versions.after_step()

    def _release(self, a: Action) -> None:
        assert self.table is not None
        gone = self.table.release[a.stage].get(str(a))
        if gone:
            self.versions[a.stage].release(gone)
