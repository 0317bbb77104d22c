"""The compute handlers: F, B, I and W of a rank's stages, each ``handler(run, action)`` (:mod:`.interpreter`).

Roughly:

  F  take the stage's input (data, a local stage's output, or a posted receive), run the stage; the last
     stage applies the loss, weighted by its micro-batch's share of the batch
  B  one backward for the stage and micro-batch; hand the input gradient on
  I  one backward pass that frees the graph: the input gradient and every parameter gradient but the deferred
     weights', whose op inputs and output gradients it stashes (see :mod:`.backward`)
  W  the deferred weight gradients, from I's stash

Which backward path a stage takes is a fact decided when the pipeline is assembled (:class:`StageFacts`):
the handlers never look inside a stage.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...ir import Action, Kind, Message
from .backward import backward_full, backward_input, backward_weight
from .hints import crossed_batches, unequal_batches, unlike_inputs
from .run import Run, Saved
from .tree import flatten, unflatten

#: the elements of a stage's largest 2-D weight from which its B runs as I then W at once (see :class:`StageFacts`)
FUSE_B_MIN_WEIGHTS = 1 << 20

#: what the interpreter calls for an action: ``handler(run, action)``
Handler = Callable[[Run, Action], None]


def fuses_b(params: Iterable[torch.Tensor]) -> bool:
    """Whether B of a stage (not recomputed) with these parameters runs as I then W at once (:class:`StageFacts`)."""
    return max((p.numel() for p in params if p.dim() == 2), default=0) >= FUSE_B_MIN_WEIGHTS


@dataclass(frozen=True)
class StageFacts:
    """What the backward handlers need to know of a stage, decided at assembly.

    ``fused_backward``: B runs as I then W at once (:mod:`.backward`) rather than one engine pass. Not for a
    recomputed stage (its B is the engine's, recompute included). I then W saves, per linear layer, the
    engine's temporary weight gradient and its add into ``.grad`` (a pass over a weight-sized matrix, freshly
    allocated), and pays I's graph walk and hooks and W's second read of each layer's input and output
    gradient: it pays where a stage has a weight of :data:`FUSE_B_MIN_WEIGHTS` elements or more. Measured (one
    thread, 2-core CPU; benchmarks/split_backward.py): two 1024 x 1024 linear layers 2.8 ms against the
    engine's 3.6 (8 rows), 14.9 against 16.4 (128 rows); a GPT stage of four d 256 blocks (largest weight
    256 x 1024), 128 rows: 28-32 ms either way, the engine 2-4 % ahead.

    ``checkpointed``: the parameters a recomputed stage uses inside its checkpointed segments (all of its
    layers'), which I leaves to the recompute; empty for a stage not recomputed.
    """

    fused_backward: bool = False
    checkpointed: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, modules: Iterable[torch.nn.Module], recomputed: bool) -> StageFacts:
        """The facts of a stage of ``modules``, checkpointed in segments or not."""
        params = tuple(p for m in modules for p in m.parameters())
        if recomputed:
            return cls(fused_backward=False, checkpointed=params)
        return cls(fused_backward=fuses_b(params))


class StashMeter(Protocol):
    """What the handlers tell a memory meter (``measure_memory=``, :mod:`..features.memory`): the bytes each I
    leaves for its W, until that W ends."""

    def hold(self, at: tuple[int, int], nbytes: int) -> None: ...

    def drop(self, at: tuple[int, int]) -> None: ...


class Compute:
    """The F, B, I and W handlers of the stages ``stages`` (index -> callable) of one rank."""

    def __init__(
        self,
        stages: Mapping[int, Callable[[Any], Any]],
        loss_fn: Callable[..., torch.Tensor] | None,
        last: int,
        facts: Mapping[int, StageFacts] | None = None,
        meter: StashMeter | None = None,
    ) -> None:
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.last = last  # the pipeline's last stage (it applies the loss)
        self.facts = dict(facts or {})
        self.meter = meter  # the memory meter, if on: charged what W holds
        self._plain = StageFacts()
        self._shapes_seen = False  # the first loss's output and targets looked at (:func:`.hints.crossed_batches`)

    def handlers(self) -> dict[Kind, Handler]:
        """This part of the interpreter's table."""
        return {Kind.F: self.forward, Kind.B: self.backward, Kind.I: self.backward_input, Kind.W: self.backward_weight}

    def forward(self, run: Run, a: Action) -> None:
        s, i = a.stage, a.microbatch
        assert i is not None
        record = run.record
        train = run.mode == "train"
        if s == 0:
            assert record.inputs is not None
            x, leaves = record.inputs[i], list[torch.Tensor]()
        else:
            x = run.take(Message("F", s - 1, i))
            x, leaves = _as_leaves(x) if train else (x, [])
        run.ready()
        with torch.set_grad_enabled(train):
            try:
                out = self.stages[s](x)
            except RuntimeError as err:
                said = unlike_inputs(self.stages[s], x) if s == 0 else ""
                if not said:
                    raise
                raise RuntimeError(f"{said} ({err})") from err
        if s == self.last:
            if train:
                loss = self.loss(run, out, i)
                run.saved[(s, i)] = Saved(leaves, [loss * record.weights[i]])  # type: ignore[index]
            else:
                record.outputs[i] = out
            return
        if train:
            run.saved[(s, i)] = Saved(leaves, [t for t in flatten(out)[0] if t.requires_grad])
        run.deliver(Message("F", s, i), out)

    def loss(self, run: Run, out: Any, i: int) -> torch.Tensor:
        """Micro-batch ``i``'s loss (recorded detached) as a 0-dim tensor."""
        if self.loss_fn is None:
            raise ValueError("train_step needs a loss: build the Pipeline with loss_fn=...")
        assert run.record.targets is not None
        targets = run.record.targets[i]
        if not self._shapes_seen:
            self._shapes_seen = True
            crossed = crossed_batches(out, targets)
            if crossed:
                warnings.warn(f"stage {self.last}: {crossed}", stacklevel=2)
        try:
            loss = self.loss_fn(out, targets)
        except (RuntimeError, ValueError, IndexError) as err:
            said = unequal_batches(out, targets, run.per_minibatch, self.last, i)
            if not said:
                raise
            raise type(err)(f"{said} ({type(err).__name__}: {err})") from err
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (the micro-batch's mean loss), got {shape}")
        if not loss.requires_grad and any(t.requires_grad for t in flatten(out)[0] if isinstance(t, torch.Tensor)):
            raise ValueError(
                f"stage {self.last}, micro-batch {i}: loss_fn's result does not depend on the model's output (no "
                "gradient reaches it: a .detach(), .item() or a new tensor inside loss_fn?): every gradient would "
                "stay None"
            )
        run.record.losses[i] = loss.detach()
        return loss.reshape(())

    def output_grads(self, run: Run, s: int, i: int, n: int) -> list[torch.Tensor | None]:
        """The gradients of stage ``s``'s ``n`` outputs for micro-batch ``i`` (None on the last stage)."""
        if s == self.last:
            return [None]
        grads = list(run.take(Message("B", s + 1, i)))
        if len(grads) != n:
            raise RuntimeError(f"stage {s} micro-batch {i}: got {len(grads)} output gradients for {n} outputs")
        return grads

    def hand_back(self, run: Run, s: int, i: int, inputs: list[torch.Tensor], grads: list[Any]) -> None:
        """Hand the input gradient of stage ``s`` (none for stage 0) to the stage before."""
        if s > 0:
            value = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads))
            run.deliver(Message("B", s, i), value)

    def backward(self, run: Run, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = self.saved_for(run, a)
        del run.saved[(s, i)]  # type: ignore[arg-type]
        grads = self.output_grads(run, s, i, len(saved.roots))  # type: ignore[arg-type]
        run.ready()
        fused = self.facts.get(s, self._plain).fused_backward
        got = backward_full(saved.roots, grads, saved.inputs, fused=fused)
        self.hand_back(run, s, i, saved.inputs, got)  # type: ignore[arg-type]

    def saved_for(self, run: Run, a: Action) -> Saved:
        """What the forward of ``a``'s stage and micro-batch saved, not differentiated yet."""
        saved = run.saved.get((a.stage, a.microbatch))  # type: ignore[arg-type]
        if saved is None:
            raise RuntimeError(f"{a}: stage {a.stage} has no forward of micro-batch {a.microbatch} to differentiate")
        if saved.weight_work is not None:
            raise RuntimeError(
                f"{a}: the input gradient of stage {a.stage} micro-batch {a.microbatch} was made already"
            )
        return saved

    def backward_input(self, run: Run, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = self.saved_for(run, a)
        grads = self.output_grads(run, s, i, len(saved.roots))  # type: ignore[arg-type]
        run.ready()
        checkpointed = self.facts.get(s, self._plain).checkpointed
        input_grads, work = backward_input(saved.roots, grads, saved.inputs, checkpointed=checkpointed)
        saved.roots = []  # the graph goes: only W's stash is left
        self.hand_back(run, s, i, saved.inputs, input_grads)  # type: ignore[arg-type]
        saved.inputs = []
        saved.weight_work = work
        if self.meter is not None:
            self.meter.hold((s, i), work.held_bytes())  # type: ignore[arg-type]

    def backward_weight(self, run: Run, a: Action) -> None:
        s, i = a.stage, a.microbatch
        saved = run.saved.get((s, i))  # type: ignore[arg-type]
        if saved is None or saved.weight_work is None:
            raise RuntimeError(
                f"{a}: W of stage {s} micro-batch {i} before its I (or after its W): "
                "there are no stashed weight-gradient inputs for it"
            )
        del run.saved[(s, i)]  # type: ignore[arg-type]
        backward_weight(saved.weight_work)
        if self.meter is not None:
            self.meter.drop((s, i))  # type: ignore[arg-type]


def _as_leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each tensor that requires grad replaced by a fresh leaf that does (the stage's own graph).

    Tensors that needed no gradient on the sending stage (masks, ids, frozen or detached values; flagged in the
    message meta) stay as they are: no gradient is computed or sent back for them.
    """
    tensors, spec = flatten(value)
    leaves = [t.detach().requires_grad_(True) if t.requires_grad else t for t in tensors]
    return unflatten(spec, leaves), [t for t in leaves if t.requires_grad]
