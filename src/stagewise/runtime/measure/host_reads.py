"""Counting the host reads of tensor values that stagewise's own code makes (the sync audit: its tests, and
``make gpu-check`` on a machine without CUDA).

A read (``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``.numpy()``, ``.cpu()``) stops the
host until a GPU has caught up; on a CPU nothing waits, but the calls are the same, so counting them on a CPU
finds the waits a GPU would have.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


@contextmanager
def counted_reads() -> Iterator[Counter[str]]:
    """Count the host reads of tensor values that stagewise's modules make (``module:line`` -> calls)."""
    sites: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("stagewise."):
                sites[f"{module}:{caller.f_lineno} {name}"] += 1
            return method(self, *args, **kwargs)

        return counting

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    try:
        yield sites
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
