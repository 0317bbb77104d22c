"""(d) peak memory per schedule (gpipe, 1f1b, zb-v; recompute off and "stage") against the simulator's and the
planner's prediction, on one rank.

The prediction: parameters + gradients + AdamW's two moments (2x the parameters) + the simulator's activation
peak for the schedule over the profiled costs (``LayerProfile.cost_model`` of the pipeline's partition, the
loss's saved tensors on the last stage (``sw.profile(..., loss_fn=, targets=)``), plus,
with recompute, the largest stage's full activations while it recomputes - the planner's rule). The planner
(``stagewise.planning.search`` on 1 process) plans one stage per rank, so it predicts gpipe and 1f1b; zb-v
needs 2 stages on the rank and has the simulator's prediction only. Measured on CUDA:
``torch.cuda.max_memory_allocated`` over a steady step (its optimizer state made by a first step), less what
was allocated before the pipeline was built. On a CPU there is no allocator to ask: the runtime's own
activation meter (``measure_memory=True``) is compared with the activation term alone.
"""

from __future__ import annotations

from typing import Any

import torch

import stagewise as sw
from stagewise.planning import search
from stagewise.simulation import simulate

from .common import Row, Sizes, adamw, lm_data, lm_layers, lm_loss, mib, peak_bytes

TARGET = 0.10
CASES = [("gpipe", 1, None), ("gpipe", 1, "stage"), ("1f1b", 1, None), ("1f1b", 1, "stage"),
         ("zb-v", 2, None), ("zb-v", 2, "stage")]  # fmt: skip


def profiled(s: Sizes, device: torch.device) -> sw.LayerProfile:
    layers = lm_layers(s, torch.float32)
    modules = list(sw.build_model(layers, seed=0).to(device).children())
    x, y = lm_data(s, 0, device)
    b = s.batch // s.microbatches
    return sw.profile(modules, x[:b], repeats=2, warmup=1, loss_fn=lm_loss, targets=y[:b])


def predicted(profile: sw.LayerProfile, pipe: sw.Pipeline, recompute: str | None) -> tuple[float, float]:
    """(static bytes, activation peak) the simulator predicts for ``pipe``'s schedule and partition."""
    counts = [len(r) for r in pipe.layer_ranges]
    bounds = [sum(counts[:k]) for k in range(len(counts) + 1)]
    costs = profile.cost_model(bounds)
    if recompute == "stage":  # a checkpointed stage keeps its input only, and recomputes the rest in its backward
        kept = [profile.layers[a - 1].output_bytes if a > 0 else 0.0 for a in bounds[:-1]]  # (the ids: not float)
        kept[-1] += profile.loss_bytes  # the loss runs outside the checkpoint
        sim = simulate(pipe.schedule, _keeping(costs, kept))
        activations = sim.peak_activation_bytes[0] + max(costs.activation_bytes)
    else:
        activations = simulate(pipe.schedule, costs).peak_activation_bytes[0]
    params = sum(costs.parameter_bytes)
    return 4 * params, activations  # parameters, gradients, two AdamW moments


def _keeping(costs: Any, kept: list[float]) -> Any:
    from dataclasses import replace

    return replace(costs, activation_bytes=tuple(kept), weight_activation_bytes=tuple(0.0 for _ in kept))


def planner(profile: sw.LayerProfile, s: Sizes, schedule: str, recompute: str | None) -> float | None:
    """The planner's predicted peak for this schedule on 1 process (None: it plans no such candidate)."""
    try:
        found = search(profile, 1, global_batch=s.batch, profile_batch=s.batch // s.microbatches,
                       schedules=[schedule], recompute=[recompute], top=100)  # fmt: skip
    except ValueError:
        return None
    for plan in found.plans:
        if plan.schedule == schedule and plan.microbatches == s.microbatches and plan.recompute == recompute:
            return plan.memory[0].total
    return None


def one(s: Sizes, device: torch.device, profile: sw.LayerProfile, case: tuple[str, int, str | None]) -> Row:
    schedule, v, recompute = case
    layers = lm_layers(s, torch.float32)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    pipe = sw.Pipeline(layers, loss_fn=lm_loss, schedule=schedule, virtual_stages=v, microbatches=s.microbatches,
                       recompute=recompute, optimizer=adamw, nan_policy=None, device=device, seed=0,
                       measure_memory=device.type != "cuda")  # fmt: skip
    pipe.train_step(*lm_data(s, 0, device))
    peak = peak_bytes(device, lambda: pipe.train_step(*lm_data(s, 1, device)))
    static, activations = predicted(profile, pipe, recompute)
    plan = planner(profile, s, schedule, recompute)
    what = f"peak memory, {schedule} v={v}, recompute {recompute or 'off'}"
    if peak is None:  # a CPU: the activation meter against the activation term
        measured = float(pipe.memory_report()["peak_bytes"])
        gap = measured / activations - 1 if activations else float("inf")
        return Row("d", what + " (activations: meter)", f"{mib(measured)} vs simulator {mib(activations)} "
                   f"({gap:+.1%})", f"within {TARGET:.0%}", abs(gap) <= TARGET)  # fmt: skip
    measured = float(peak - before)
    gap = measured / (static + activations) - 1
    plan_text = "planner: no 1-rank plan" if plan is None else f"planner {mib(plan)} ({measured / plan - 1:+.1%})"
    ok = abs(gap) <= TARGET and (plan is None or abs(measured / plan - 1) <= TARGET)
    text = f"{mib(measured)} vs simulator {mib(static + activations)} ({gap:+.1%}); {plan_text}"
    return Row("d", what, text, f"within {TARGET:.0%}", ok)


def run(s: Sizes, device: torch.device) -> list[Row]:
    profile = profiled(s, device)
    rows = []
    for case in CASES:
        rows.append(one(s, device, profile, case))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
