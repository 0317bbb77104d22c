"""A stage of a transformers causal LM: the model's own forward, run for a contiguous range of its decoder layers.

Roughly: stage ``[a, b)`` calls ``model(...)`` with layers ``< a`` skipped (each returns the hidden states the
stage received, so layer ``a`` starts from them) and layer ``b`` stopping the forward (what it would have
taken is the stage's output). So every operation around the layers is the model's own code, whatever the
family: the embedding's scale and learned positions, ALiBi and positions derived from the mask, the masks
and rotary embeddings of each layer type, the layers' extra arguments, the final norm, the logit scaling and
soft-capping. Nothing about a family is written here; :mod:`.check` verifies the result once per model.

What crosses a cut: ``(hidden_states, attention_mask, position_ids)``, the last two as the user gave them
(None, a 2-D padding mask or a 4-D mask; positions restarting per packed document). A stage after the first
runs the part of the forward before the layers again on a placeholder ``inputs_embeds`` (zeros: the token
embedding itself is not called), which rebuilds what its layers take from the mask and the positions.

The forward runs without a cache (``use_cache=False``), as training does: with a cache transformers reads a
call as generation and does not isolate packed documents, so ``model(..., use_cache=False)`` is the one-process
reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from .discover import Layout, decoder_layers, skipped


class Reached(Exception):
    """Raised by the first layer after a stage's range: carries the hidden states that layer was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("the stage's last layer ran")
        self.hidden = hidden


class HFStage(nn.Module):
    """Decoder layers ``layer_ids`` (contiguous) of a causal LM; with ``first`` the embedding and what runs before
    the layers, with ``last`` what runs after them and the head.

    Takes ``input_ids`` (a tensor, a tuple ``(input_ids, attention_mask[, position_ids])`` or a dict of those
    names) on the first stage and ``(hidden_states, attention_mask, position_ids)`` after; returns the same
    triple, or the logits on the last stage.
    """

    model: nn.Module  # (not submodules: held in __dict__, so that only the stage's own parts are registered)
    layout: Layout
    decoder: nn.ModuleList
    #: where the stage sits, not what it does (its layers and flags say that): the counting's key leaves them out
    position_attributes: ClassVar[frozenset[str]] = frozenset({"start", "stop", "names"})

    def __init__(self, model: nn.Module, layout: Layout, layer_ids: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        ids = list(layer_ids)
        if not ids or ids != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"an HF stage holds a contiguous, non-empty range of decoder layers, got {ids}")
        if first != (ids[0] == 0):
            raise ValueError(f"the first stage holds decoder layer 0 (first={first}, layers {ids})")
        layers = decoder_layers(model, layout)
        if last != (ids[-1] == len(layers) - 1):
            raise ValueError(f"the last stage holds the last decoder layer (last={last}, layers {ids})")
        self.__dict__["model"] = model
        self.__dict__["layout"] = layout
        self.__dict__["decoder"] = layers
        self.first, self.last = first, last
        self.start, self.stop = ids[0], ids[-1] + 1
        self.names: list[tuple[str, str]] = []  # (attribute here, name in the model)
        self.parts = nn.ModuleDict()
        for name in layout.first if first else ():
            self._hold(name)
        self.layers = nn.ModuleList([layers[i] for i in ids])
        self.names += [(f"layers.{k}", f"{layout.layers}.{i}") for k, i in enumerate(ids)]
        for name in layout.last if last else ():
            self._hold(name)

    def _hold(self, name: str) -> None:
        attr = name.replace(".", "__")
        self.parts[attr] = self.model.get_submodule(name)
        self.names.append((f"parts.{attr}", name))

    @property
    def kept(self) -> list[nn.Module]:
        """Modules this stage's forward runs without owning them (kept on its rank, trained by the first stage)."""
        layout = self.layout
        return [] if self.first else [self.model.get_submodule(n) for n in layout.shared]

    def forward(self, *args: Any) -> Any:
        model, layout = self.model, self.layout
        if self.first:
            ids, mask, positions = read_inputs(args)
            call: dict[str, Any] = {"input_ids": ids}
            hidden = None
        else:
            hidden, mask, positions = args
            call = {"inputs_embeds": self._placeholder(hidden)}
        call["attention_mask"] = mask
        if positions is not None:
            if not layout.takes_positions:
                raise ValueError(
                    f"{layout.kind}'s forward takes no position_ids (its positions come from the attention mask); "
                    "pass (input_ids, attention_mask)"
                )
            call["position_ids"] = positions
        with routed(self.decoder, self.start, self.stop, hidden, layout.tuple_layers):
            try:
                out = model(**call, use_cache=False, return_dict=True)
            except Reached as reached:
                return reached.hidden, mask, positions
        return out.logits

    def _placeholder(self, hidden: torch.Tensor) -> torch.Tensor:
        """Zeros shaped as the token embedding's output: the forward's part before the layers runs on them."""
        weight: Any = getattr(self.model.get_submodule(self.layout.embed), "weight")  # noqa: B009
        return torch.zeros(*hidden.shape[:-1], self.layout.embed_dim, dtype=weight.dtype, device=hidden.device)


@contextmanager
def routed(decoder: nn.ModuleList, start: int, stop: int, hidden: torch.Tensor | None, boxed: bool) -> Iterator[None]:
    """Inside the block, layers ``< start`` return ``hidden`` (as a one-tuple where the forward unpacks layer
    outputs) and layer ``stop`` raises :class:`Reached` with what it was given."""

    def skip(*args: Any, **kwargs: Any) -> Any:
        return (hidden,) if boxed else hidden

    def reach(*args: Any, **kwargs: Any) -> Any:
        raise Reached(args[0] if args else kwargs["hidden_states"])

    forwards: dict[int, Any] = {}
    if hidden is not None:
        forwards.update(dict.fromkeys(range(start), skip))
    if stop < len(decoder):
        forwards[stop] = reach
    with skipped(decoder, forwards):
        yield


def read_inputs(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``input_ids``, ``attention_mask``, ``position_ids`` from the first stage's arguments."""
    if len(args) == 1 and isinstance(args[0], dict):
        d = dict(args[0])
        unknown = sorted(set(d) - {"input_ids", "attention_mask", "position_ids"})
        if "input_ids" not in d or unknown:
            raise ValueError(
                f"from_hf inputs as a dict take input_ids (required), attention_mask and position_ids; got {sorted(d)}"
            )
        return d["input_ids"], d.get("attention_mask"), d.get("position_ids")
    if not 1 <= len(args) <= 3 or not isinstance(args[0], torch.Tensor):
        raise ValueError(
            "from_hf inputs are input_ids, or a tuple (input_ids, attention_mask[, position_ids]), or a dict of "
            f"those; got {len(args)} values"
        )
    return args[0], args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None


def decoder_units(model: nn.Module, layout: Layout, *, named: bool = False) -> list[tuple[str, HFStage]]:
    """The units ``from_hf`` cuts among: one decoder layer each, the embedding with the first and the final norm
    and head with the last. Named by index (what a cut's counts index), or ``named``: after the decoder layer
    (``model.layers.3``), the first and the last saying what they also hold (a profile's rows)."""
    n = len(decoder_layers(model, layout))
    names = [f"{layout.layers}.{i}" if named else str(i) for i in range(n)]
    if named and n:
        names[0] += f" (+{layout.embed})"
        names[-1] += f" (+{layout.head})"
    return [(names[i], HFStage(model, layout, [i], first=i == 0, last=i == n - 1)) for i in range(n)]
