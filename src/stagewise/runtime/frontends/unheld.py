"""A stage's first forward watched for a parameter its modules use but this rank does not hold.

``from_model`` finds a tie where the model registers one parameter under two modules (``head.weight =
embed.weight``) or reads it in its own forward (``h @ self.embed.weight.T``): the cut gives the stage that
parameter, and its gradient is summed across the ranks using it (:mod:`.ties`). A block that reaches another
block's parameter through a reference kept outside the module tree (``self.__dict__["embed"] = embed``, a list,
a closure) is seen by neither: without a check, the rank running it computes with a freed (``meta``) tensor
and fails at its first backward on a message naming neither (``MmBackward0 returned an invalid gradient ...
expected device meta``), or, with ``free_unused=False``, trains a copy whose gradient no one sums while the
owner trains alone (losses drift from the model's after the first step). Nothing but running the forward
says what it touches, and no input exists before the first step, so the first forward of each stage runs
under a :class:`~torch.overrides.TorchFunctionMode` that sees every parameter an operation receives
(``.T`` of one included), and one this rank's stages do not hold is an error naming it, its owner and its user::

    SplitError: 'head' (stage 1) uses the parameter 'embed.weight' of 'embed' (stage 0), which this rank does
    not hold: ...

Later forwards run as they are (a mode costs a Python call per operation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .split import SplitError


class _Watch(TorchFunctionMode):
    """Raises at the first operation given a trainable (or freed) parameter whose id is in ``unheld``."""

    def __init__(self, unheld: set[int], refuse: Callable[[nn.Parameter, str | None], None]) -> None:
        super().__init__()
        self.unheld, self.refuse = unheld, refuse
        self.running: str | None = None  # the stage's module being called (None: the model's own code)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, nn.Parameter) and id(t) in self.unheld and (t.requires_grad or t.is_meta):
                self.refuse(t, self.running)
        return func(*args, **kwargs)


def _run(gm: fx.GraphModule, watch: _Watch, args: tuple[Any, ...]) -> Any:
    """The stage's graph run node by node (:class:`torch.fx.Interpreter`), so that the watch knows which module is
    being called; fx's note of the node is left out of an error's message."""
    run = fx.Interpreter(gm)
    run.extra_traceback = False
    call = run.call_module

    def call_module(target: Any, args: Any, kwargs: Any) -> Any:
        watch.running = str(target)
        try:
            return call(target, args, kwargs)
        finally:
            watch.running = None

    run.call_module = call_module  # type: ignore[method-assign]
    return run.run(*args)


def watch_first_forward(
    stages: Mapping[int, fx.GraphModule], model: nn.Module, module_stages: Mapping[str, int]
) -> None:
    """The first call of each of this rank's ``stages`` (stage -> module) checked (module docstring) for the
    model's parameters that no stage here holds (two stages of one rank share the parameter itself; one that is
    not the model's is no one's to sum), read then: after the build freed the others' (``free_unused``).
    ``module_stages``: the model's modules (tags or blocks) and their stages, to name the owner."""

    def unheld() -> set[int]:
        held = {id(p) for gm in stages.values() for p in gm.parameters()}
        return {id(p) for p in model.parameters() if id(p) not in held}

    for k, gm in stages.items():
        _watch_once(gm, unheld, lambda p, user, k=k: _refuse(model, module_stages, k, p, user))


def _watch_once(gm: fx.GraphModule, unheld: Callable[[], set[int]], refuse: Callable[..., None]) -> None:
    def first(*args: Any) -> Any:
        del gm.forward  # (this instance's: every later call is the graph's own forward)
        watch = _Watch(unheld(), refuse)
        with watch:
            return _run(gm, watch, args)

    gm.forward = first


def _refuse(model: nn.Module, module_stages: Mapping[str, int], k: int, param: nn.Parameter, user: str | None) -> None:
    name = next(n for n, p in model.named_parameters() if p is param)
    owner = _owner(name, module_stages)
    where = "the model's own code" if user is None else repr(user)
    held_by = "the model itself" if owner is None else f"{owner!r} (stage {module_stages[owner]})"
    state = "has freed it" if param.is_meta else "holds a copy whose gradient no rank would sum with the owner's"
    raise SplitError(
        f"{where} (stage {k}) uses the parameter {name!r} of {held_by}, which this rank does not hold: it reaches "
        f"it through a reference kept outside its module tree (self.__dict__[...], a list, a closure), which "
        f"from_model cannot see, so this rank {state}. Make the owner a submodule of the user "
        f"(self.embed = embed) or tie the weights as PyTorch does (head.weight = embed.weight): from_model then "
        "sums its gradient across the stages using it"
    )


def _owner(name: str, modules: Iterable[str]) -> str | None:
    """The module of ``modules`` whose qualified name is the longest prefix of parameter ``name``."""
    around = [m for m in modules if name.startswith(m + ".")]
    return max(around, key=len, default=None)
