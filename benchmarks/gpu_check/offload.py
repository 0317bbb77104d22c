"""(e) offload="optimizer": device memory saved and step time lost, on the GPT of (c) in float32 with AdamW
(torch's fused kernel, on the device without offload and on the host with it), 4 stages on one rank.

Device memory: the allocator's peak over a steady step, with and without offload (on a CPU there is no
device allocator: the optimizer state the offload holds on the "host" is what a device would save). The
host side: every byte the offload holds (masters, gradient buffers, moments).
"""

from __future__ import annotations

import torch
from torch import nn

import stagewise as sw

from .common import Row, Sizes, gpt, gpt_data, mib, peak_bytes, timed


def fused_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)


def measured(s: Sizes, device: torch.device, offload: str | None) -> tuple[int | None, float, int]:
    """(device peak bytes over a steady step, median step seconds, host bytes the offload holds)."""
    layers, loss_fn = gpt(s)
    pipe = sw.Pipeline(layers, loss_fn=loss_fn, schedule="interleaved-1f1b", virtual_stages=4,
                       microbatches=s.microbatches, optimizer=fused_adamw, offload=offload, nan_policy=None,
                       device=device, seed=0)  # fmt: skip
    x, y = gpt_data(s, 0, device)
    pipe.train_step(x, y)  # the optimizer state exists from here on
    peak = peak_bytes(device, lambda: pipe.train_step(x, y))
    seconds = timed(lambda: pipe.train_step(x, y), device, s.warmup, s.steps)
    stepper = pipe.hooks.stepper
    host = stepper.host_bytes() if hasattr(stepper, "host_bytes") else 0
    state = sum(
        v.numel() * v.element_size()
        for opt in pipe.optimizers.values()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return peak, seconds, host if offload else state


def run(s: Sizes, device: torch.device) -> list[Row]:
    peak0, sec0, state = measured(s, device, None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak1, sec1, host = measured(s, device, "optimizer")
    lost = sec1 / sec0 - 1
    rows = [
        Row("e", "offload: step time", f"{sec1 * 1e3:.1f} ms vs {sec0 * 1e3:.1f} ms on the device ({lost:+.1%})"),
        Row("e", "offload: host memory it holds", mib(host)),
    ]
    if peak0 is not None and peak1 is not None:
        rows.insert(0, Row("e", "offload: device memory saved (peak over a step)",
                           f"{mib(peak0 - peak1)} ({mib(peak0)} -> {mib(peak1)}); AdamW state {mib(state)}",
                           ">= 0.9 x the AdamW state", peak0 - peak1 >= 0.9 * state))  # fmt: skip
    else:
        rows.insert(0, Row("e", "offload: optimizer state moved off the device (no device allocator on a CPU)",
                           mib(state)))  # fmt: skip
    return rows
