"""Counting transformers' routed experts on ``meta``: each token's work on ``top_k`` experts, whichever they are.

A mixture-of-experts layer picks its experts by value (Mixtral's, Qwen2-MoE's and the other families' experts
modules under transformers' ``use_experts_implementation``): its eager forward asks which experts were hit
(``nonzero``) and which tokens each got (``where``), shapes no ``meta`` tensor has, so the count
(:mod:`.counting`) could not run it and such a model was cut by parameters, which weigh every expert though a
token uses ``top_k`` of them. Whatever the routing, every token goes to ``top_k`` experts, and an expert's matrix
products cost in proportion to the tokens it gets: the experts' FLOPs are those of ``tokens x top_k`` rows through
one expert, for any routing. :func:`uniform_routing` runs the experts that way while a layer is counted, each
expert on an equal share of the token-expert pairs, with the module's own weights, gate and biases as its eager
forward uses them, so each expert's weights are read once as there; the router before it runs as written.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: what transformers' ``use_experts_implementation`` gives an experts module, besides its weights
_MARKS = ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel", "num_experts")


def is_routed_experts(module: nn.Module) -> bool:
    """A transformers experts module (weights as 3-D tensors, one slice per expert; ``forward(hidden_states,
    top_k_index, top_k_weights)``), not split across ranks by expert parallelism."""
    return all(hasattr(module, name) for name in _MARKS) and not module._is_expert_parallel


@contextmanager
def uniform_routing(root: nn.Module) -> Iterator[int]:
    """While inside, every routed experts module under ``root`` runs :func:`_uniform_forward` (yields how many);
    their own forwards come back on the way out, whatever happened."""
    found = [m for m in root.modules() if is_routed_experts(m)]
    had = [m.__dict__.get("forward") for m in found]
    try:
        for m in found:
            m.forward = types.MethodType(_uniform_forward, m)
        yield len(found)
    finally:
        for m, own in zip(found, had):
            if own is None:
                del m.forward
            else:
                m.forward = own


def _uniform_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' eager forward with the ``tokens x top_k`` token-expert pairs dealt out evenly: expert ``e``
    takes the next ``pairs // E`` (one more for the first ``pairs % E``), each pair weighted as routed."""
    tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
    k = top_k_index.shape[-1]
    experts = int(self.num_experts)
    pairs = hidden_states.repeat_interleave(k, dim=0)  # (tokens * k, hidden): each token once per expert it uses
    weights = top_k_weights.reshape(-1, 1)
    out, start = [], 0
    for e in range(experts):
        n = tokens * k // experts + (1 if e < tokens * k % experts else 0)
        if n == 0:
            continue
        x = pairs[start : start + n]
        up = _linear(self, x, "gate_up_proj" if self.has_gate else "up_proj", e)
        up = self._apply_gate(up) if self.has_gate else self.act_fn(up)
        y = _linear(self, up, "down_proj", e)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        out.append(y * weights[start : start + n])
        start += n
    routed = torch.cat(out).view(tokens, k, hidden).sum(dim=1)
    return routed.to(hidden_states.dtype)


def _linear(self: Any, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s projection ``name`` (its bias where the module has them), stored ``(out, in)`` or, transposed,
    ``(in, out)``."""
    weight = getattr(self, name)[e]
    y = x @ weight if self.is_transposed else nn.functional.linear(x, weight)
    return y + getattr(self, f"{name}_bias")[e] if self.has_bias else y
