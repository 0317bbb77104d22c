"""Stage tags: ``module.pipeline_stage = k`` (MindSpore style) or ``with stage(k):`` (Paddle's device_guard).

A tag says which pipeline stage a module's computation belongs to. Tags are
plain attributes, so a model can be tagged after it is built::

    model.blocks[3].pipeline_stage = 1

or while it is built: every ``nn.Module`` constructed inside ``with stage(k):``
gets ``pipeline_stage = k`` (the innermost block wins)::

    with stage(0):
        self.embed = nn.Embedding(...)
    with stage(1):
        self.head = nn.Linear(...)

To do this, ``stage`` wraps ``nn.Module.__init__`` while (and only while) at
least one block is open; the original is restored when the outermost block
exits. The stack is process-global, so do not build models in two threads
at once inside ``stage`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ...._util import is_count

TAG = "pipeline_stage"

_stack: list[int] = []
_original_init: Any = None


def _tagging_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    if _stack:
        object.__setattr__(self, TAG, _stack[-1])


def _check_stage(k: Any, where: str) -> int:
    if not is_count(k, 0):
        raise ValueError(f"{where}: a pipeline stage is an int >= 0, got {k!r}")
    return k


@contextmanager
def stage(k: int) -> Iterator[None]:
    """Tag every ``nn.Module`` constructed inside the block with ``pipeline_stage = k``."""
    global _original_init
    _check_stage(k, "stage()")
    if not _stack:
        _original_init = nn.Module.__init__
        nn.Module.__init__ = _tagging_init  # type: ignore[method-assign]
    _stack.append(k)
    try:
        yield
    finally:
        _stack.pop()
        if not _stack:
            nn.Module.__init__ = _original_init  # type: ignore[method-assign]
            _original_init = None


def tag_of(module: nn.Module) -> int | None:
    """The stage ``module`` is tagged with, or None."""
    k = getattr(module, TAG, None)
    if k is None:
        return None
    return _check_stage(k, f"{type(module).__name__}.{TAG}")


def collect_tags(model: nn.Module) -> dict[str, int]:
    """Qualified name -> stage for every tagged submodule (the root itself is not a stage tag)."""
    tags: dict[str, int] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        k = tag_of(module)
        if k is not None:
            tags[name] = k
    return tags
