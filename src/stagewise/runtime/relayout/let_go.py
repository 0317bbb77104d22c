"""A failed generation's pipeline let go at once: its tensors freed where nothing else holds them.

An in-place recovery drops the failed pipeline (:class:`.generation.InPlace`), but dropping the
last name of it frees nothing: the pipeline and its engine refer to each other (the snapshotter and the hooks
hold the pipeline; the failure's traceback holds the failed step's frames, their activations and the pipeline),
so only a full garbage collection would free its parameters, gradients, optimizer state and buffers - a walk of
the whole heap the recovery path does not take (:mod:`..comm.release`). Meanwhile the old state and the new
layout's would both be alive: twice the memory on a GPU. So the references are cut here, where they are known:
the failure's frames cleared, and the pipeline's own holders of tensors emptied. What the take-over kept
(:func:`.takeover.hold`: detached aliases of the live tensors) stays alive through those aliases, and the new
layout takes them; a module the user still holds keeps its own tensors (it is the user's).
"""

from __future__ import annotations

import traceback
from typing import Any

from torch import nn

from ..assembly.assemble import Engine
from ..checkpoint.declared import PipelineState


def let_go(pipe: Any, err: BaseException | None) -> None:
    """Cut the references ``pipe`` and the failure ``err`` hold to the failed generation's tensors."""
    forget_frames(err)
    if pipe is not None:
        empty(pipe)


def forget_frames(err: BaseException | None) -> None:
    """Clear the locals of the frames ``err`` (and the exceptions it was raised from) passed through: the failed
    step's activations and the pipeline (a frame still running is left as it is)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def empty(pipe: Any) -> None:
    """Drop what the pipeline holds of tensors: its optimizers' state and parameters, its snapshots' buffers, its
    modules' gradients and stagewise's own hooks on them (a hook of a feature holds the feature, which holds the
    modules: a cycle), then its own attributes and its engine's. A module's own tensors stay in it: a module the
    user still holds (``from_model``) keeps them; one nothing holds goes with them. The engine is found among the
    pipeline's attributes by its type (:class:`..assembly.assemble.Engine`): every attribute is emptied alike, so
    no private name of the Pipeline is read here."""
    declared = isinstance(pipe, PipelineState)
    for opt in list(pipe.optimizers.values()) if declared else []:
        opt.state.clear()
        opt.param_groups.clear()
    if declared and pipe.snapshots is not None:
        pipe.snapshots.forget()  # (its capture, marks and buffers)
    for module in list(pipe.modules()):
        for p in module.parameters(recurse=False):
            p.grad = None
        for hooks in _hook_dicts(module):
            for key in [k for k, fn in hooks.items() if _ours(fn)]:
                del hooks[key]
    engines = [v for v in vars(pipe).values() if isinstance(v, Engine)]  # (found by its type, not its name)
    vars(pipe).clear()
    parts = [v for engine in engines for v in vars(engine).values() if _internal(v)]
    inner = [w for part in parts for w in vars(part).values() if _internal(w)]  # (the runner's interpreter...)
    for obj in [*inner, *parts, *engines]:
        vars(obj).clear()  # the engine's parts: their cycles held the run's values, whose graph holds the params


def _internal(obj: Any) -> bool:
    """One of the engine's own objects (not a module, a tensor or a user's object; not one the exit still asks to
    let go of its resources, :mod:`..comm.lifecycle`). An instance of a public class may be the user's own (a
    ``MetricsConfig`` given to every generation's build): it is never emptied."""
    ours = type(obj).__module__.startswith("stagewise.runtime.") and hasattr(obj, "__dict__")
    return ours and not isinstance(obj, nn.Module) and not hasattr(obj, "release_at_exit") and not _public(obj)


def _public(obj: Any) -> bool:
    """A class the user can name (``stagewise`` or ``stagewise.runtime`` exports it)."""
    import stagewise
    from stagewise import runtime

    name = type(obj).__name__
    return any(name in mod.__all__ and getattr(mod, name, None) is type(obj) for mod in (stagewise, runtime))


def _hook_dicts(module: nn.Module) -> list[dict[Any, Any]]:
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    return [d for d in (getattr(module, n, None) for n in names) if isinstance(d, dict)]


def _ours(fn: Any) -> bool:
    """A hook stagewise installed (a user's own hooks stay)."""
    return str(getattr(fn, "__module__", "") or "").startswith("stagewise.")
