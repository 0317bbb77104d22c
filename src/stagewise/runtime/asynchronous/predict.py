"""XPipe's weight prediction: where the optimizer's own update direction will take the weights in d updates.

At a mini-batch's bellwether forward a stage holds W^(c) and knows (from the
schedule) that d updates will land before the mini-batch's own; XPipe
predicts the weights then as

    Ŵ = W^(c) - lr * d * u(c)

with u the direction the optimizer's state after version c points to:

* SGD with momentum mu > 0 (any dampening and weight decay, which the buffer
  already holds; Nesterov refused): u = the momentum buffer b, since
  SGD steps W <- W - lr * b.
* Adam / AdamW (no AMSGrad): u = m̂ / (sqrt(v̂) + eps), with m̂ = m / (1 - beta1^k),
  v̂ = v / (1 - beta2^k) after k steps; AdamW (decoupled weight decay wd) adds
  wd * W^(c), the decay it will also apply.

Before the optimizer's first step there is no state and u = 0 (Ŵ = W^(c)).
Other optimizers have no rule here: :func:`check_predictable` refuses them
with a ValueError naming them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless :func:`predict` has a rule for ``optimizer`` and its options."""
    name = type(optimizer).__name__
    if type(optimizer) is torch.optim.SGD:
        for group in optimizer.param_groups:
            if not group["momentum"] > 0:
                raise ValueError(
                    "xpipe predicts weights along the optimizer's update direction; SGD needs momentum > 0 "
                    f"(its momentum buffer is the direction), got momentum={group['momentum']}"
                )
            if group["nesterov"] or group.get("maximize", False):
                raise ValueError("xpipe has no prediction rule for SGD with nesterov=True or maximize=True")
        return
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for group in optimizer.param_groups:
            if group["amsgrad"] or group.get("maximize", False):
                raise ValueError(f"xpipe has no prediction rule for {name} with amsgrad=True or maximize=True")
        return
    raise ValueError(
        f"xpipe has no weight-prediction rule for the optimizer {name}: supported are torch.optim.SGD "
        "(momentum > 0, no Nesterov), torch.optim.Adam and torch.optim.AdamW"
    )


def direction(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> tuple[float, torch.Tensor]:
    """(lr, u): the learning rate of ``param``'s group and the update direction its state points to."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    lr = float(group["lr"])
    state = optimizer.state.get(param, {})
    if type(optimizer) is torch.optim.SGD:
        buf = state.get("momentum_buffer")
        return lr, torch.zeros_like(param) if buf is None else buf.detach().to(param.device)
    if "exp_avg" not in state:
        return lr, torch.zeros_like(param)
    beta1, beta2 = group["betas"]
    k = float(state["step"])
    # (the state may live on the host: offload="optimizer" keeps it there)
    m_hat = state["exp_avg"].to(param.device) / (1 - beta1**k)
    denom = (state["exp_avg_sq"].to(param.device) / (1 - beta2**k)).sqrt() + group["eps"]
    u = m_hat / denom
    if group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW):
        u = u + group["weight_decay"] * param.detach()
    return lr, u


def predict(
    optimizer: torch.optim.Optimizer | None, params: Sequence[torch.nn.Parameter], ahead: int
) -> list[torch.Tensor]:
    """Ŵ = W - lr * ahead * u for each of ``params`` (new tensors; the parameters are not touched)."""
    out = []
    for p in params:
        w = p.detach().clone()
        if ahead and optimizer is not None and p.requires_grad:
            lr, u = direction(optimizer, p)
            w.sub_(u, alpha=lr * ahead)
        out.append(w)
    return out


__all__ = ["check_predictable", "direction", "predict"]
