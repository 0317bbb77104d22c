"""Layers: lazy layer specs, the calling convention between layers, and cutting a model into stages.

A model is an ordered list of layers. Each layer is an ``nn.Module`` (eager:
fine for small models, every rank holds the whole model) or a :class:`Layer`
spec (lazy: built only on the rank that holds its stage, so no rank allocates
another stage's weights).

Calling convention: a layer's output is the next layer's input. A plain
``tuple`` output is unpacked into positional arguments (``next(*out)``);
anything else (a tensor, a dict, a list) is passed as one argument. The model's
inputs follow the same rule for the first layer.

Determinism: layer ``k`` (0-based position in the model) is built with the CPU
generator seeded to ``seed + k``, so :func:`build_model` with the same seed
builds, in one process, exactly the model a :class:`~stagewise.Pipeline`
spreads over its ranks (eager modules are used as they are).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Union

import torch
from torch import nn

from ...partition import LayerProfile, PartitionSpec, counts_to_ranges, stage_counts
from ..engine.stage import call_layer

LayerLike = Union[nn.Module, "Layer"]
Layers = Union[nn.Sequential, nn.ModuleList, Sequence[LayerLike], Mapping[str, LayerLike]]  # noqa: UP007


class Layer:
    """A recipe for one layer, ``factory(*args, **kwargs)``, built only where it is needed.

    The arguments are plain values: a module or parameter among them (``Layer(nn.Sequential, nn.Linear(16, 32))``)
    would be built once, where the spec is written, and shared by every model built from it, so it is refused;
    build it inside the factory: ``Layer(lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh()))``.

    >>> spec = Layer(nn.Linear, 4, 8, bias=False)
    >>> spec.build(seed=0).weight.shape
    torch.Size([8, 4])
    """

    def __init__(self, factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if isinstance(factory, nn.Module):
            raise TypeError(
                f"Layer needs a callable that builds an nn.Module, got the module {type(factory).__name__} itself: "
                f"put a built module in the list as it is, or pass its class and arguments "
                f"(sw.Layer({type(factory).__name__}, ...))"
            )
        if not callable(factory):
            raise TypeError(f"Layer needs a callable that returns an nn.Module, got {factory!r}")
        _refuse_built_modules(factory, args, kwargs)
        self.factory = factory
        self.args = args
        self.kwargs = kwargs

    def build(self, seed: int | None = None) -> nn.Module:
        """Call the factory, with the CPU generator seeded to ``seed`` if given (global RNG state is kept)."""
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.random.default_generator.manual_seed(seed)
            module = self.factory(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self!r} returned {type(module).__name__}, not an nn.Module")
        return module

    def __repr__(self) -> str:
        name = getattr(self.factory, "__qualname__", repr(self.factory))
        args = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Layer({name}{''.join(', ' + a for a in args)})"


def _refuse_built_modules(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A module or parameter among a spec's arguments was built once, when the spec was written: every model
    built from the spec would share it (two Pipelines, ``build_model`` and its reference alike), and ``seed=``
    could not reach it. Refused, with the way to build it inside the factory."""
    where = [*(f"argument {i}" for i in range(1, len(args) + 1)), *(f"argument {k}=" for k in kwargs)]
    for place, value in zip(where, [*args, *kwargs.values()]):
        found = _built(value, place)
        if found is None:
            continue
        place, kind = found
        name = getattr(factory, "__qualname__", type(factory).__qualname__)
        name = f"nn.{name}" if getattr(factory, "__module__", "").startswith("torch.nn") else name
        raise TypeError(
            f"Layer({name}, ...): {place} is an {kind} built once, here, when the Layer was written, and would be "
            f"shared by every model built from this list (each Pipeline and sw.build_model alike; seed= cannot "
            f"reach it). Build it inside the factory instead: sw.Layer(lambda: {name}(...)) - for example "
            f"sw.Layer(lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh())), "
            f"not sw.Layer(nn.Sequential, nn.Linear(16, 32), nn.Tanh())"
        )


def _built(value: Any, place: str, depth: int = 0) -> tuple[str, str] | None:
    """(where, what) of the first module or parameter in ``value``, looking into lists, tuples, sets and dicts."""
    if isinstance(value, nn.Parameter):
        return place, "nn.Parameter"
    if isinstance(value, nn.Module):
        return place, f"nn.Module ({type(value).__name__})"
    if depth > 8:
        return None
    items: list[tuple[str, Any]] = []
    if isinstance(value, (list, tuple)):
        items = [(f"{place}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, (set, frozenset)):
        items = [(f"{place} (a member)", v) for v in value]
    elif isinstance(value, Mapping):
        items = [(f"{place}[{k!r}]", v) for k, v in value.items()]
    for where, item in items:
        found = _built(item, where, depth + 1)
        if found is not None:
            return found
    return None


def named_layers(layers: Layers) -> list[tuple[str, LayerLike]]:
    """The model's layers in order, named as in the original model (``"0"``, ``"embed"``, ...)."""
    named: list[tuple[str, LayerLike]]
    if isinstance(layers, nn.Sequential):
        named = list(layers.named_children())
    elif isinstance(layers, Mapping):
        named = [(str(k), v) for k, v in layers.items()]
    elif isinstance(layers, (nn.ModuleList, Sequence)):
        named = [(str(k), v) for k, v in enumerate(layers)]
    else:
        raise TypeError(
            f"layers must be an nn.Sequential, a list of modules or Layer specs, or a dict of them; "
            f"got {type(layers).__name__}"
        )
    for name, layer in named:
        if not isinstance(layer, (nn.Module, Layer)):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Module or a stagewise.Layer")
        if "." in name:
            raise ValueError(f"layer name {name!r} contains '.', which parameter names use as separator")
    if not named:
        raise ValueError("the model has no layers")
    return named


def build_layer(layer: LayerLike, index: int, seed: int) -> nn.Module:
    """Layer ``index`` of the model: a spec is built seeded with ``seed + index``; a module is returned as is."""
    return layer.build(seed + index) if isinstance(layer, Layer) else layer


_empty = ContextVar("stagewise_build_empty", default=False)
#: ``lend(index)``: the tensors this process holds already for layer ``index``, by name within the layer
Lend = Callable[[int], Mapping[str, torch.Tensor]]
_lent: ContextVar[Lend | None] = ContextVar("stagewise_build_lent", default=None)


@contextmanager
def built_empty(lend: Lend | None = None) -> Iterator[None]:
    """The stages built under it hold uninitialised tensors (specs built on ``meta``, then given storage): for
    a caller that fills every tensor itself (a re-layout, from the old layout), so no initialisation is computed
    only to be overwritten. ``lend``: a layer's tensor that this process holds already (same name, shape, dtype
    and device) takes that storage from ``meta`` directly: a tensor staying on its process is never allocated
    twice."""
    token, lent = _empty.set(True), _lent.set(lend)
    try:
        yield
    finally:
        _empty.reset(token)
        _lent.reset(lent)


def building_empty() -> bool:
    """Whether the stages built now are filled by their caller (inside :func:`built_empty`)."""
    return _empty.get()


def build_stage_layer(layer: LayerLike, index: int, seed: int, device: Any) -> nn.Module:
    """:func:`build_layer` for a stage held here, on ``device``. Under :func:`built_empty` a spec is built on
    ``meta`` and given storage (lent, or empty), unless it cannot be (its factory fails on meta) or its state
    would not be whole (a non-persistent buffer or a plain tensor attribute, which no state_dict carries): then
    as usual."""
    module = _on_meta(layer) if _empty.get() and isinstance(layer, Layer) else None
    if module is not None:
        lend = _lent.get()
        return _given_storage(module, {} if lend is None else lend(index), device if device is not None else "cpu")
    module = build_layer(layer, index, seed)
    return module if device is None else module.to(device)


def _given_storage(module: nn.Module, lent: Mapping[str, torch.Tensor], device: Any) -> nn.Module:
    """Every ``meta`` tensor of ``module`` gets storage on ``device``: the lent tensor of its name where it is a
    plain tensor of its shape and dtype there, else empty (a tensor held twice in the module stays one)."""
    device = torch.device(device)
    made: dict[int, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    data = _lent_or_empty(lent.get(f"{prefix}.{name}" if prefix else name), t, device)
                    made[id(t)] = nn.Parameter(data, t.requires_grad) if isinstance(t, nn.Parameter) else data
                store[name] = made[id(t)]
    return module


def _lent_or_empty(old: torch.Tensor | None, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    if old is not None and type(old) is torch.Tensor and old.device == device:
        if (old.shape, old.dtype) == (like.shape, like.dtype):
            return old
    return torch.empty_like(like, device=device)


def _on_meta(layer: Layer) -> nn.Module | None:
    try:
        with torch.device("meta"):
            module = layer.build()
    except Exception:  # a factory that needs real values: built as usual
        return None
    for m in module.modules():
        if m._non_persistent_buffers_set or any(isinstance(v, torch.Tensor) for v in vars(m).values()):
            return None
    return module


class Chain(nn.Sequential):
    """Layers applied in order under the calling convention (an ``nn.Sequential`` that unpacks tuples)."""

    def __init__(self, named: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__(OrderedDict(named))

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        for layer in self.children():
            x = call_layer(layer, x)
        return x


def parameter_count(layer: LayerLike) -> int:
    """Parameters of a layer; a spec is built on the meta device, so no memory is used."""
    if isinstance(layer, Layer):
        with torch.device("meta"):
            layer = layer.build()
    return sum(p.numel() for p in layer.parameters())


def partition(
    named: Sequence[tuple[str, LayerLike]],
    num_stages: int,
    how: PartitionSpec = "uniform",
    *,
    profile: LayerProfile | None = None,
    speeds: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    in_flight: int = 1,
) -> list[range]:
    """Which layers each stage holds: contiguous ranges, one per stage, none empty.

    ``how`` is ``"uniform"`` (equal layer counts, the first stages take the
    remainder), ``"parameters"`` (the least possible largest parameter count
    per stage, by :func:`stagewise.partition.cut.partition_costs`), ``"time"`` or
    ``"memory"`` (balance a :class:`~stagewise.LayerProfile` of the layers,
    see :func:`stage_counts`) or explicit layer counts per stage such as
    ``[3, 2, 2, 1]``. ``speeds`` and ``memory_caps`` are per stage.
    """
    counts = stage_counts(
        len(named),
        num_stages,
        how,
        parameters=lambda: [parameter_count(layer) for _, layer in named],
        profile=profile,
        speeds=speeds,
        memory_caps=memory_caps,
        in_flight=in_flight,
    )
    return counts_to_ranges(counts)
