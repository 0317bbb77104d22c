"""(c) bfloat16 autocast throughput of a GPT-2-small-sized model (124 M parameters on a GPU): a 1-rank pipeline
with 4 virtual stages against the plain training loop on the same device.

Rows: the plain loop on the whole batch; the plain loop accumulating gradients over the pipeline's
micro-batches (the same kernels on the same shapes: what the pipeline can at best match, so the runtime's
overhead is the ratio to it, target <= 3 %); the pipeline with ``nan_policy=None`` (no check, as the plain
loop has none) and with the default check. Every variant reads its loss once per step, AdamW, same data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import stagewise as sw

from .common import Row, Sizes, adamw, gpt, gpt_data, timed

TARGET = 0.03


def plain(s: Sizes, device: torch.device, split: int) -> Callable[[], float]:
    """The plain loop: one process, the model whole, the batch cut into ``split`` accumulated micro-batches."""
    layers, loss_fn = gpt(s)
    model = sw.build_model(layers, seed=0).to(device)
    opt = adamw(list(model.parameters()))
    x, y = gpt_data(s, 0, device)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for xs, ys in zip(x.tensor_split(split), y.tensor_split(split)):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(model(xs), ys) / split
            loss.backward()
            total += loss.detach()
        opt.step()
        return total.item()

    return step


def piped(s: Sizes, device: torch.device, nan_policy: str | None) -> Callable[[], float]:
    layers, loss_fn = gpt(s)
    pipe = sw.Pipeline(layers, loss_fn=loss_fn, schedule="interleaved-1f1b", virtual_stages=4,
                       microbatches=s.microbatches, optimizer=adamw, autocast=torch.bfloat16, nan_policy=nan_policy,
                       device=device, seed=0)  # fmt: skip
    x, y = gpt_data(s, 0, device)
    return lambda: pipe.train_step(x, y)


def run(s: Sizes, device: torch.device) -> list[Row]:
    tokens = s.gpt_batch * s.gpt["seq_len"]
    params = None
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("plain loop, whole batch", lambda: plain(s, device, 1)),
        (f"plain loop, {s.microbatches} accumulated micro-batches", lambda: plain(s, device, s.microbatches)),
        ("pipeline, 1 rank x 4 virtual stages, nan_policy=None", lambda: piped(s, device, None)),
        ('pipeline, 1 rank x 4 virtual stages, nan_policy="raise"', lambda: piped(s, device, "raise")),
    ]
    seconds = {}
    for name, make in variants:
        step = make()
        seconds[name] = timed(step, device, s.warmup, s.steps)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if params is None:
        layers, _ = gpt(s)
        params = sum(p.numel() for p in sw.build_model(layers, seed=0).parameters())
    base = seconds[variants[1][0]]
    rows = []
    for name, sec in seconds.items():
        overhead = sec / base - 1
        piped_row = name.startswith("pipeline")
        text = f"{tokens / sec:,.0f} tokens/s ({sec * 1e3:.1f} ms/step; {overhead:+.1%} vs accumulated)"
        target = f"<= +{TARGET:.0%}" if piped_row else ""
        rows.append(Row("c", f"bf16 GPT {params / 1e6:.3g} M params: {name}", text, target,
                        overhead <= TARGET if piped_row else None))  # fmt: skip
    return rows
