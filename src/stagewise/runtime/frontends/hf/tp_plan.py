"""The tensor-parallel plan of a transformers model, from its own ``config.base_model_tp_plan``.

transformers writes, per family, which linear layers of the decoder are split and how (``"colwise"``:
by output features; ``"rowwise"``: by input features, outputs summed), with names relative to the base model
(``"layers.*.self_attn.q_proj"``). Those two are Megatron's column and row styles, which
:mod:`stagewise.runtime.hybrid.tensor_parallel` applies; a plan naming any other style (fused projections
gathered or split, norms whose gradients must be summed over the tensor axis, experts) is refused: its
arithmetic is not the one-process model's without that style, so ``tp_plan=`` must then be given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .discover import Layout

if TYPE_CHECKING:
    from ...hybrid.tensor_parallel import TPPlan

#: the styles of transformers' plans that are Megatron's column and row splits
STYLES = ("colwise", "rowwise")


def default_tp_plan(model: nn.Module, layout: Layout) -> TPPlan:
    """``config.base_model_tp_plan`` as a stagewise plan (names in the causal LM), or a ValueError saying why not."""
    from ...hybrid.tensor_parallel import column_parallel, row_parallel

    plan: dict[str, Any] = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"tp > 1 needs a tensor-parallel plan; {layout.kind}'s config has no base_model_tp_plan: pass tp_plan= "
            "(e.g. {'model.layers.*.self_attn.q_proj': sw.runtime.column_parallel(), ...})"
        )
    odd = sorted({f"{name}: {style}" for name, style in plan.items() if style not in STYLES})
    if odd:
        raise ValueError(
            f"{layout.kind}'s base_model_tp_plan uses styles stagewise does not apply ({odd}); only {list(STYLES)} "
            "map to its column and row splits: pass tp_plan= with a plan of those"
        )
    prefix = next(name for name, module in model.named_modules() if module is model.base_model)
    make = {"colwise": column_parallel, "rowwise": row_parallel}
    return {(f"{prefix}.{name}" if prefix else name): make[style]() for name, style in plan.items()}
