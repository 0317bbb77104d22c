"""Recompute (GPipe's re-materialisation): a stage keeps only the inputs of its checkpointed segments.

``Pipeline(..., recompute="stage")`` wraps each stage's layers in one
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; ``recompute=k``
wraps every ``k`` consecutive layers of a stage. Between a micro-batch's F and
its backward the stage then holds the segment inputs only (for ``"stage"``: its
boundary activation); the segment's internals are recomputed when the backward
(B, or I of a zero-bubble schedule) first needs them, so one micro-batch's
internals are alive at a time, during its backward.

With the I/W split the segment is recomputed once, inside I, and W re-runs
nothing: while I runs, the segment's closure hands the recomputed outputs (and
any aux-loss terms made on the way) to :func:`..engine.backward.note_recomputed`,
which keeps the recomputed input of each deferred weight's op, the tensor the
original op unpacks (a checkpointed tensor may be unpacked once per backward,
so I cannot read it from the op itself). The checkpoint runs without early
stop, so the recompute reaches every op of the segment. Gradients equal those
without recompute (tested). Layers whose forward has other side effects run
them twice; BatchNorm's running statistics are updated by the F action only
(:mod:`.batchnorm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..._util import is_count
from ..engine.backward import capturing, note_recomputed
from ..engine.stage import call_layer
from ..engine.tree import flatten
from .aux_loss import collect_aux_losses

Recompute = Union[None, str, int]  # noqa: UP007
#: a scope per segment (``segment()`` once per segment, in order; the scope it returns entered at each run of the
#: segment, the recompute too): the dropout seeding (:mod:`.dropout`)
Scopes = Callable[[], Callable[[], AbstractContextManager[Any]]]


def check_recompute(recompute: Recompute) -> None:
    if recompute is None or recompute == "stage":
        return
    if not is_count(recompute):
        raise ValueError(f"recompute must be None, 'stage' or a positive layer count, got {recompute!r}")


def segments(n: int, recompute: Recompute) -> list[range]:
    """The runs of layers checkpointed together (one run of all ``n``, unchecked, when ``recompute`` is None)."""
    if recompute is None or recompute == "stage":
        return [range(n)]
    k = int(recompute)
    return [range(a, min(a + k, n)) for a in range(0, n, k)]


def run_layers(modules: Sequence[nn.Module], x: Any, recompute: Recompute, segment: Scopes | None = None) -> Any:
    """Apply ``modules`` in order under the calling convention, checkpointing segments when training; each segment's
    run (and its recompute) inside its ``segment()`` scope."""

    if recompute is None or not torch.is_grad_enabled():
        return _chain(modules, segment)(*(x if type(x) is tuple else (x,)))
    for seg in segments(len(modules), recompute):
        x = checkpointed(_chain([modules[k] for k in seg], segment), *(x if type(x) is tuple else (x,)))
    return x


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` checkpointed as the runtime's recompute does: non-reentrant, no early stop, and its
    recompute inside an I handing the deferred ops' inputs to W (see the module docstring)."""

    def run(*inner: Any) -> Any:
        if not capturing():  # the forward, or a recompute inside B
            return fn(*inner)
        with collect_aux_losses() as terms:  # (aux terms hang off the segment's graph too)
            out = fn(*inner)
        note_recomputed([*flatten(out)[0], *(t for _, t in terms)])
        return out

    return checkpoint(run, *args, use_reentrant=False, early_stop=False)


def _chain(part: Sequence[nn.Module], segment: Scopes | None) -> Callable[..., Any]:
    """The layers ``part`` applied in order, inside the segment's scope (entered again by its recompute)."""
    scope = segment() if segment is not None else nullcontext

    def run(*args: Any) -> Any:
        y: Any = args[0] if len(args) == 1 else args
        with scope():
            for m in part:
                y = call_layer(m, y)
        return y

    return run
