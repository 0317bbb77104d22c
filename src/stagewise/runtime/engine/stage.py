"""A stage as the engine runs it: its layers under the calling convention, through the forward it was given.

Calling convention: a layer's output is the next layer's input. A plain ``tuple`` output is unpacked into
positional arguments (``next(*out)``); anything else (a tensor, a dict, a list) is passed as one argument.

What an option changes in a stage's forward (autocast, recompute, aux losses) is composed by the assembly
into the stage's :data:`Forward` (:mod:`stagewise.runtime.assembly.assemble`); the engine knows none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

#: how a stage runs its layers on an input: ``forward(modules, x)``
Forward = Callable[[Sequence[nn.Module], Any], Any]


def call_layer(layer: Callable[..., Any], x: Any) -> Any:
    """Apply ``layer`` to the previous layer's output under the calling convention."""
    return layer(*x) if type(x) is tuple else layer(x)


class Stage:
    """The layers of one stage and how they run: ``forward(modules, x)``, composed by the assembly.

    ``recompute``: whether (and how) the forward checkpoints its segments (``recompute=``); the backward's
    handlers read it, because a checkpointed stage takes another path (:mod:`.backward`).
    """

    def __init__(self, index: int, modules: list[nn.Module], forward: Forward, recompute: Any = None) -> None:
        self.index = index
        self.modules = modules
        self.forward = forward
        self.recompute = recompute

    def __call__(self, x: Any) -> Any:
        return self.forward(self.modules, x)
