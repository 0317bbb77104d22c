"""``stagewise.checkpoint``: save and load pipelines under any layout (the torch side is imported on first use).

    sw.checkpoint.save("ckpt", pipe, step=100, extra={"batch": 100})
    info = sw.checkpoint.load("ckpt", pipe)          # the newest complete checkpoint under ckpt/
    sw.checkpoint.load(sw.checkpoint.latest("ckpt"), sw.build_model(layers))  # in one process
    info = sw.checkpoint.resume("ckpt", pipe)        # None on a fresh start; after a restart, the newest

See :mod:`stagewise.runtime.checkpoint`.
"""

from __future__ import annotations

from typing import Any

_NAMES = ("CheckpointError", "CheckpointInfo", "latest", "load", "resume", "save")


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        from .runtime import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'stagewise.checkpoint' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_NAMES)


__all__ = list(_NAMES)
