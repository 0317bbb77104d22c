"""Dropout that every layout draws alike: each mask from a generator seeded by (seed, step, micro-batch, module).

A pipeline's forwards run micro-batch by micro-batch, stage by stage, in the schedule's order, and on other
ranks: drawn from the global generator, a dropout mask would depend on the layout, the schedule and what
ran before it on that rank, and no one-process run could give the same masks. So, while a stage's forward
runs in training, each module that can drop (an ``nn.Dropout`` of any kind with ``p > 0``; a module with a
float attribute named ``*dropout*`` or ``*pdrop*`` above 0, or a module, not a container, with such a dropout
child: an attention calling ``F.dropout`` or ``scaled_dot_product_attention(dropout_p=...)`` itself) runs
with the CPU generator, and the stage's device's, seeded by :func:`key` (a forward pre-hook on the module, put
there for the forward's time only)::

    key(seed, replica, step, micro-batch, the module's name in the one-process model, the call's number)

and put back after it, so that the global generators go on as if nothing had run (the user's own draws
do not depend on the layout either). ``step`` counts the train steps of the pipeline (mini-batches, in an
asynchronous stream), ``micro-batch`` is the index in its mini-batch, ``replica`` the data-parallel replica
(0 without ``parallel=``; tensor-parallel ranks of one replica draw alike), the call's number counts the
module's calls within one micro-batch's forward on its stage (a module called twice draws two masks). The
seed is the pipeline's ``dropout_seed`` option (default: ``seed``); a checkpoint saves it with the step and a
load restores both (``Pipeline.dropout_seed``, ``train_steps``). So pp 2 and pp 4, 1F1B and ZB-V give the
same losses, and a recomputed forward (``recompute=``) draws the same masks again: the seeding is inside the
checkpointed segment, each segment re-entered with the call counts its first run started from.

Torch draws a mask in its input's memory order, and a stage's received input is contiguous where the
one-process tensor may not be (a transpose's output): a seeded module's positional tensor inputs are therefore
made contiguous first (a copy only for those that are not), so the masks do not depend on where the cut falls.

One process draws the same masks under :func:`seeded_dropout`, micro-batch by micro-batch (the reference
loop of the tests). A stage with no such module is not touched (no cost); one with them pays, per forward,
two hooks put on and taken off each such module and, per seeded call, one save, seed and restore of each
generator (measured by ``python -m benchmarks.dropout_cost``).

Not covered: randomness outside such modules (``torch.rand`` in a forward), evaluation steps (they draw
from the global generator, as in one process; call ``pipe.eval()`` for no dropout), a dropout module
shared by blocks on different stages (its call numbers are counted per stage, so its masks depend on the
cut), a non-contiguous tensor handed to such a module by keyword, and a dropout inside a tensor-parallel
layer's split activations (every piece draws the same pattern, unlike the one-process mask).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from ..engine.run import Run

_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    """One round of splitmix64 (Steele, Lea and Flood 2014): a bijection of 64-bit integers that mixes every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def name_code(name: str) -> int:
    """A module name as 64 bits (BLAKE2b: alike in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def key(seed: int, replica: int, step: int, microbatch: int, name: str, call: int) -> int:
    """The seed of one dropout call's generator (63 bits): the words above folded one by one through splitmix64."""
    return _folded((seed, replica, step, microbatch, name_code(name), call))


def _folded(words: tuple[int, ...]) -> int:
    h = 0
    for word in words:
        h = _splitmix(h ^ (word & _MASK))
    return h >> 1


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def drops(module: nn.Module, root: bool = False) -> bool:
    """Whether ``module`` itself may drop: a dropout layer with ``p > 0``, a float ``*dropout*`` / ``*pdrop*``
    attribute above 0 (an attention that calls the functional dropout with it), or a dropout child with ``p > 0``
    of a module that is neither a container nor the ``root`` (the pipeline, or the model, holding the layers):
    an attention that hands the child's ``p`` to ``scaled_dot_product_attention`` and never calls the child
    (transformers' GPT-2)."""
    if isinstance(module, _DropoutNd):
        return module.p > 0
    if any(isinstance(v, float) and v > 0 and ("dropout" in k or "pdrop" in k) for k, v in vars(module).items()):
        return True
    return (
        not root
        and not isinstance(module, _CONTAINERS)
        and any(isinstance(c, _DropoutNd) and c.p > 0 for c in module._modules.values())
    )


def random_modules(named: Iterator[tuple[str, nn.Module]]) -> dict[int, tuple[str, nn.Module]]:
    """id -> (name, module) of every module that may drop, among ``named`` (a module seen twice: its first name;
    ``""``, the root's)."""
    out: dict[int, tuple[str, nn.Module]] = {}
    for name, module in named:
        if id(module) not in out and drops(module, root=name == ""):
            out[id(module)] = (name, module)
    return out


def _generators(device: torch.device | None) -> list[torch.Generator]:
    """The generators a dropout may draw from: the CPU's, and the accelerator's of ``device``."""
    out = [torch.default_generator]
    if device is not None and device.type == "cuda":
        out.append(torch.cuda.default_generators[device.index if device.index is not None else 0])
    return out


class Seeding:
    """Seeds ``modules`` (``codes``: id -> :func:`name_code` of each one's one-process name) while a scope is open;
    ``base``: the (seed, replica, step, micro-batch) words; ``calls``: each module's calls so far in this
    micro-batch's forward."""

    def __init__(
        self,
        modules: list[nn.Module],
        codes: Mapping[int, int],
        base: tuple[int, int, int, int],
        generators: list[Any],
    ) -> None:
        self.modules, self.codes, self.base, self.generators = modules, codes, base, generators
        self.calls: dict[int, int] = {}
        self.saved: list[list[torch.Tensor]] = []

    def before(self, module: nn.Module, args: Any) -> tuple[Any, ...] | None:
        code = self.codes.get(id(module))
        if code is None or not module.training:
            self.saved.append([])
            return None
        n = self.calls.get(id(module), 0)
        self.calls[id(module)] = n + 1
        self.saved.append([g.get_state() for g in self.generators])
        seed = _folded((*self.base, code, n))
        for g in self.generators:
            g.manual_seed(seed)
        return _contiguous(args)

    def after(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self.saved:
            return
        for g, state in zip(self.generators, self.saved.pop()):
            g.set_state(state)

    def open(self, calls: dict[int, int]) -> list[RemovableHandle]:
        """Seed from now on, counting calls on from ``calls``; the hooks to close it with (:func:`_close`).

        The hooks go on the modules that may drop only, for the scope's time: the others keep torch's fast call
        path, and no hook stays on a user's module between forwards."""
        self.calls = dict(calls)
        hooks = []
        for module in self.modules:
            hooks.append(module.register_forward_pre_hook(self.before))
            hooks.append(module.register_forward_hook(self.after, always_call=True))
        return hooks

    @contextmanager
    def scope(self, calls: dict[int, int]) -> Iterator[None]:
        """Seed inside the block, counting calls on from ``calls``."""
        hooks = self.open(calls)
        try:
            yield
        finally:
            _close(hooks)


def _contiguous(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``args`` with their tensors made contiguous (None: all were): torch draws a mask in the input's memory
    order, and a stage's received input is contiguous where the one-process tensor (a transpose's output) may
    not be, so the masks would depend on the cut."""
    if all(not isinstance(a, torch.Tensor) or a.is_contiguous() for a in args):
        return None
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _close(hooks: list[RemovableHandle]) -> None:
    for h in hooks:
        h.remove()


class Segments:
    """The scopes of one micro-batch's forward on a stage: :meth:`segment` is called once per checkpointed segment
    (or once, without ``recompute=``), in order; each scope re-entered (the recompute) counts calls from where its
    first run started, so it draws the same masks."""

    def __init__(self, seeding: Seeding) -> None:
        self.seeding = seeding
        self.calls: dict[int, int] = {}

    def segment(self) -> Callable[[], Any]:
        return _Segment(self)


class _Segment:
    """One segment's scope (a context manager, and the factory :func:`.recompute.run_layers` calls for it)."""

    def __init__(self, segments: Segments) -> None:
        self.segments = segments
        self.start: dict[int, int] | None = None  # the call counts its first run started from
        self.hooks: list[list[RemovableHandle]] = []

    def __call__(self) -> _Segment:
        return self

    def __enter__(self) -> None:
        if self.start is None:
            self.start = dict(self.segments.calls)
        self.hooks.append(self.segments.seeding.open(self.start))

    def __exit__(self, kind: Any, *rest: Any) -> None:
        _close(self.hooks.pop())
        if kind is None:
            self.segments.calls = dict(self.segments.seeding.calls)


class DropoutSeeds:
    """This rank's seeding: the random modules of its stages, and where the running forward stands.

    A part of every step (:class:`~..engine.runner.StepPart`): it keeps the train run's value, which says
    which mini-batch of the stream the run starts at (``run.first``, the train steps before it), how many
    micro-batches a mini-batch has, and the action running (``run.current``), whose micro-batch ``i`` is
    micro-batch ``i % m`` of the run's mini-batch ``i // m`` (several in an asynchronous window). ``stages``: the
    stages holding a module that may drop; the others' forwards are left alone (no cost).
    """

    def __init__(
        self,
        found: Mapping[int, tuple[str, nn.Module]],
        stages: frozenset[int],
        seed: int,
        replica: int,
        device: torch.device | None,
    ) -> None:
        self.modules = [m for _, m in found.values()]
        self.codes = {i: name_code(n) for i, (n, _) in found.items()}
        self.stages = stages
        self.seed, self.replica = seed, replica
        self.generators = _generators(device)
        self.run: Run | None = None  # the train run running (or the last one)

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        if run.mode == "train":
            self.run = run
        yield

    def after(self, run: Run) -> None:
        """Nothing after a step."""

    def where(self) -> tuple[int, int]:
        """The (step, micro-batch) of the forward running now."""
        run = self.run
        if run is None:
            return 0, 0
        action = run.current
        i = action.microbatch if action is not None and action.microbatch is not None else 0
        return run.first + i // run.per_minibatch, i % run.per_minibatch

    def segments(self, stage: int) -> Callable[[], Any] | None:
        """A training forward of ``stage`` starts: the factory of its segments' scopes (None: it cannot drop)."""
        if stage not in self.stages:
            return None
        step, microbatch = self.where()
        seeding = Seeding(self.modules, self.codes, (self.seed, self.replica, step, microbatch), self.generators)
        return Segments(seeding).segment


def dropout_seeds(
    named: Iterator[tuple[str, nn.Module]],
    stage_modules: Mapping[int, list[nn.Module]],
    seed: int,
    replica: int,
    device: torch.device | None,
) -> DropoutSeeds:
    """The seeding of the stages (index -> their layers) holding a module that may drop (none, for a model
    without dropout: it then only keeps the seed); ``named``: this rank's modules under their one-process
    names."""
    found = random_modules(named)
    stages = frozenset(
        s for s, layers in stage_modules.items() if any(id(m) in found for root in layers for m in _modules_of(root))
    )
    return DropoutSeeds(found, stages, seed, replica, device)


def _modules_of(root: nn.Module) -> Iterator[nn.Module]:
    """``root``'s modules, and those of a tied module it uses without holding (a later use)."""
    yield from root.modules()
    for m in root.modules():
        shared = m.__dict__.get("shared")
        if isinstance(shared, nn.Module):
            yield from shared.modules()


@contextmanager
def seeded_dropout(
    model: nn.Module, *, seed: int = 0, step: int = 0, microbatch: int = 0, replica: int = 0
) -> Iterator[None]:
    """Inside the block, ``model``'s dropouts draw the masks a pipeline built with ``seed=seed`` draws for
    micro-batch ``microbatch`` of train step ``step`` (0-based), replica ``replica``: the one-process reference.

    Run one micro-batch's forward (and its backward) per block. ``model``'s module names must be the
    pipeline's (``sw.build_model(layers)`` for a layer list; the model itself for ``from_model`` /
    ``from_hf``)::

        for i, (x, y) in enumerate(zip(x.tensor_split(m), y.tensor_split(m))):
            with sw.runtime.seeded_dropout(model, seed=0, step=step, microbatch=i):
                (loss_fn(model(x), y) * len(y) / batch).backward()
    """
    found = random_modules(model.named_modules())
    codes = {i: name_code(n) for i, (n, _) in found.items()}
    modules = [m for _, m in found.values()]
    seeding = Seeding(modules, codes, (seed, replica, step, microbatch), _generators(_device_of(model)))
    with seeding.scope({}):
        yield


def _device_of(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None
