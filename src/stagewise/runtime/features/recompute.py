"""Recompute (GPipe's re-materialisation): a stage keeps only the inputs of its checkpointed segments.

``Pipeline(..., recompute="stage")`` wraps each stage's layers in one
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; ``recompute=k``
wraps every ``k`` consecutive layers of a stage. Between a micro-batch's F and
its backward the stage then holds the segment inputs only (for ``"stage"``: its
boundary activation); the segment's internals are recomputed when the backward
(B, or I of a zero-bubble schedule) first needs them, so one micro-batch's
internals are alive at a time, during its backward.

With the I/W split the non-reentrant checkpoint recomputes what I unpacks and
W, restarted on the retained graph, gets the same values: gradients equal those
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
from ..engine.stage import call_layer

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

    def chain(part: Sequence[nn.Module]) -> Any:
        scope = segment() if segment is not None else nullcontext

        def run(*args: Any) -> Any:
            y: Any = args[0] if len(args) == 1 else args
            with scope():
                for m in part:
                    y = call_layer(m, y)
            return y

        return run

    if recompute is None or not torch.is_grad_enabled():
        return chain(modules)(*(x if type(x) is tuple else (x,)))
    for seg in segments(len(modules), recompute):
        args = x if type(x) is tuple else (x,)
        x = checkpoint(chain([modules[k] for k in seg]), *args, use_reentrant=False)
    return x
