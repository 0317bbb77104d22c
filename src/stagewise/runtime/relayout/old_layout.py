"""The old layout after a successful re-layout: its tensors go at once, not at the next garbage collection.

The user's object takes the new state in place (:func:`.call._become`), and a shell is left holding the old one.
That shell sits in reference cycles (its engine's parts hold each other; a feature's hook on a module holds the
feature, which holds the modules), so dropping it frees nothing until a full collection: the old layout's
parameters, buffers and optimizer state would stay beside the new layout's. :func:`.let_go.let_go` cuts those
cycles, as after a failed generation. A module the new layout holds too (a user's own stage, ``from_stages``)
is taken out of the shell first, so that its tensors stay; stagewise's hooks the old layout put on it are
removed (recorded by :func:`hooks_of` before the new layout was built, which adds its own).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..checkpoint.declared import PipelineState
from .let_go import let_go

#: torch's dicts of a module's hooks, and the dicts that hold more about the same hook ids
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_EXTRA = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")

Hooks = list[tuple[nn.Module, Any]]


def hooks_of(pipe: nn.Module) -> Hooks:
    """Stagewise's own hooks on ``pipe``'s modules (a user's hooks are not listed), by module and hook id."""
    out: Hooks = []
    for module in pipe.modules():
        for name in _HOOKS:
            hooks = getattr(module, name, None)
            if isinstance(hooks, dict):
                out += [(module, key) for key, fn in hooks.items() if _ours(fn)]
    return out


def let_go_old(shell: nn.Module, pipe: nn.Module, old_hooks: Hooks) -> None:
    """Cut the cycles of ``shell`` (the old layout's state) but for the modules ``pipe`` (the new) holds too, from
    which the old layout's hooks ``old_hooks`` (:func:`hooks_of`, before the build) are removed."""
    shared = {id(m) for m in pipe.modules()}
    for module, key in old_hooks:
        if id(module) in shared:
            for name in (*_HOOKS, *_EXTRA):
                hooks = getattr(module, name, None)
                if isinstance(hooks, dict):
                    hooks.pop(key, None)
    for module in [m for m in shell.modules() if id(m) not in shared]:
        for name, child in list(module.named_children()):
            if id(child) in shared:
                module.register_module(name, None)
    if isinstance(shell, PipelineState):
        shell.transport.close()  # (what the shell's own end would do: its guard's threads, its groups' sockets)
    let_go(shell, None)


def _ours(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").startswith("stagewise.")
