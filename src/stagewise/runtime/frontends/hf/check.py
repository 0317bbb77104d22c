"""The equivalence check: a model is pipelined only if its stage pieces, chained, give the model's own outputs.

Before anything is cut, every decoder layer is made a piece of its own (the first with the embedding, the last
with the head: every boundary a pipeline could cut at), the pieces are chained in one process on a tiny batch
(two rows of eight tokens, the second right-padded), in the model's dtype, in eval mode (dropout off: the
pipeline's masks are not the one-process forward's, :mod:`stagewise.runtime.features.dropout`, and are
tested apart), and each piece's output is compared with what the same layer gave inside
``model(..., use_cache=False)``; the last with its logits.
Each piece after the first is run once more with the weights of the modules before the layers changed: it
runs that part of the forward on its own copy of them, which only the first stage trains, so its output must
not depend on them. The first that differs refuses the model, naming the family, the piece, and by how much::

    from_hf refuses Gemma2ForCausalLM (model_type 'gemma2'): chained on a 2x8 batch in eval mode (no dropout), its
    stage pieces do not
    give the model's own outputs: at the logits (piece 3 of 4: decoder layer 3, then model.norm, lm_head) they
    are off by 0.074 (relative to the largest value, 0.22; 3.6e-15 allowed). ...

(a piece that forgets Gemma 2's logit soft-capping: tests/runtime/test_hf.py's mutants).

It costs one forward of the model on 16 tokens plus one or two of its pieces, on every rank (each holds the
whole model at this point; the verdict is the same everywhere, so no rank waits for another). For a model too
big to run once per rank, ``Pipeline.from_hf(model, check=False)`` skips it (see :class:`~.FromHF`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .discover import Layout, decoder_layers

#: how far a piece may stray, in units of the dtype's epsilon relative to the largest value compared: the pieces
#: run the model's own operations in its order, so they agree exactly; a few ulps leave room for a kernel that
#: picks another order for another shape
ULPS = 16


def check_model(model: nn.Module, layout: Layout, pieces: Sequence[nn.Module] | None = None) -> float:
    """Chain ``pieces`` (default: one :class:`~.stage.HFStage` per decoder layer) on a tiny batch and compare with
    the model; returns the largest relative difference, or raises ValueError at the first piece that strays."""
    from .stage import HFStage

    layers = decoder_layers(model, layout)
    n = len(layers)
    if pieces is None:
        pieces = [HFStage(model, layout, [i], first=i == 0, last=i == n - 1) for i in range(n)]
    ids, mask = tiny_batch(model, layout)
    with evaluating(model, *pieces), torch.no_grad():
        expected = _reference(model, layers, ids, mask)
        worst = 0.0
        x: Any = (ids, mask)
        for k, piece in enumerate(pieces):
            what = _what(layout, k, len(pieces), n)
            try:
                out = piece(*x)
            except Exception as err:
                raise ValueError(
                    f"{_prefix(layout, ids.shape)}, computing {what} raised {type(err).__name__}: {err}"
                ) from err
            got = out if k == len(pieces) - 1 else out[0]
            worst = max(worst, _compare(layout, got, expected[k], ids.shape, what))
            if k > 0:
                _kept_weights_unused(model, layout, piece, x, got, what)
            x = out
    return worst


def _kept_weights_unused(model: nn.Module, layout: Layout, piece: nn.Module, x: Any, got: Any, what: str) -> None:
    """A stage after the first runs the forward's part before the layers on its own copy of those modules, which
    only the first stage trains: what it gives must not depend on their weights (it does not where they only
    make the hidden states the stage replaces). Checked by running the piece again with them changed."""
    weights = [p for name in layout.shared for p in model.get_submodule(name).parameters()]
    if not weights:
        return
    saved = [w.detach().clone() for w in weights]
    try:
        for w in weights:
            w.mul_(1.5).add_(0.25)
        again = piece(*x)
    finally:
        for w, old in zip(weights, saved):
            w.copy_(old)
    again = again if isinstance(again, torch.Tensor) else again[0]
    if not torch.equal(again.nan_to_num(), got.nan_to_num()):
        raise ValueError(
            f"from_hf refuses {layout.kind} (model_type {layout.family!r}): {what} depends on the weights of "
            f"{list(layout.shared)}, which run before the decoder layers: only the first stage would train them"
        )


def tiny_batch(model: nn.Module, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of up to eight tokens (fewer if the model's positions end sooner), the second right-padded."""
    config: Any = getattr(model, "config")  # noqa: B009
    embedding: Any = model.get_submodule(layout.embed)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 8
    seq = max(2, min(8, int(limit)))
    vocab, device = int(embedding.num_embeddings), embedding.weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, seq), generator=g).to(device)
    mask = torch.ones(2, seq, dtype=torch.long, device=device)
    mask[1, seq - max(1, seq // 4) :] = 0
    return ids, mask


def _reference(model: nn.Module, layers: nn.ModuleList, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """What each layer gave inside the model's own forward, then the logits."""
    outs: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, out: Any) -> None:
        outs.append(out[0] if isinstance(out, tuple) else out)

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    try:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=True).logits
    finally:
        for hook in hooks:
            hook.remove()
    return [*outs[:-1], logits]


def _what(layout: Layout, k: int, pieces: int, n: int) -> str:
    if k == pieces - 1:
        return f"the logits (piece {k} of {pieces}: decoder layer {n - 1}, then {', '.join(layout.last)})"
    return f"the output of decoder layer {k} ({layout.layers}.{k}, piece {k} of {pieces})"


def _compare(layout: Layout, got: Any, want: torch.Tensor, batch: torch.Size, what: str) -> float:
    """The largest difference of ``got`` from ``want`` relative to ``want``'s largest magnitude (NaN where both
    are NaN counts as equal); raises past :data:`ULPS`."""
    prefix = _prefix(layout, batch)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"{prefix}, its stage pieces give {what} of shape {shape}, the model {tuple(want.shape)}")
    both_nan = got.isnan() & want.isnan()
    diff = (got.double() - want.double()).abs().masked_fill(both_nan, 0.0)
    scale = float(want.double().abs().nan_to_num(0.0).max()) or 1.0
    err = float(diff.nan_to_num(float("inf")).max()) / scale
    allowed = ULPS * torch.finfo(want.dtype).eps
    if not err <= allowed:
        raise ValueError(
            f"{prefix}, its stage pieces do not give the model's own outputs: at {what} they are off by {err:.2g} "
            f"(relative to the largest value, {scale:.2g}; {allowed:.2g} allowed). Something between its decoder "
            "layers depends on more than what crosses a cut (the hidden states, the attention mask, the positions)"
        )
    return err


def _prefix(layout: Layout, batch: torch.Size) -> str:
    where = f"chained on a {batch[0]}x{batch[1]} batch in eval mode (no dropout)"
    return f"from_hf refuses {layout.kind} (model_type {layout.family!r}): {where}"


@contextmanager
def evaluating(*modules: nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout) inside the block; each one's own mode restored after."""
    modes = {id(m): (m, m.training) for root in modules for m in root.modules()}
    try:
        for m, _ in modes.values():
            m.training = False
        yield
    finally:
        for m, mode in modes.values():
            m.training = mode
