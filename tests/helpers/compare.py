"""A pipeline against the one-process model: gradients and parameters by name, to a float64 tolerance.

One comparator for every suite, in one process or on many ranks: each rank compares the parameters it holds
(a tensor-parallel shard is gathered whole first), so the checks differ only in the tolerance they pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagewise.runtime.hybrid.tensor_parallel import full

#: float64 on both sides: only the order of summation differs
RTOL, ATOL = 1e-10, 1e-12


def assert_grads_close(
    pipe: Any, ref: nn.Module, what: str = "", *, rtol: float = RTOL, atol: float = ATOL, aliases: bool = False
) -> int:
    """Every gradient this rank's part of ``pipe`` holds equals ``ref``'s under the same name; returns how many
    parameters were compared.

    A parameter ``ref`` freezes must get no gradient here either. ``aliases``: a tied parameter may be named
    by any of its names in ``ref`` (a tied head reports ``lm_head.weight``).
    """
    refs = dict(ref.named_parameters(remove_duplicate=not aliases))
    count = 0
    for name, p in pipe.named_parameters():
        assert name in refs, f"{what}: pipeline parameter {name!r} is not in the one-process model"
        count += 1
        r = refs[name]
        if not r.requires_grad:
            assert p.grad is None, f"{what}: frozen {name} got a gradient"
            continue
        assert p.grad is not None, f"{what}: {name} got no gradient"
        torch.testing.assert_close(full(p.grad), r.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")
    return count


def assert_params_close(
    pipe: Any,
    ref: nn.Module,
    what: str = "",
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    aliases: bool = False,
    buffers: bool = False,
) -> None:
    """Every parameter (and with ``buffers``, every buffer) this rank holds equals ``ref``'s of the same name."""
    named = [(pipe.named_parameters(), dict(ref.named_parameters(remove_duplicate=not aliases)))]
    if buffers:
        named.append((pipe.named_buffers(), dict(ref.named_buffers())))
    for mine, refs in named:
        for name, t in mine:
            assert name in refs, f"{what}: {name!r} is not in the one-process model"
            torch.testing.assert_close(
                full(t.detach()), refs[name].detach(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
            )
