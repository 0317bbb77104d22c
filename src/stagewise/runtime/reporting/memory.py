""":meth:`Pipeline.memory_report`: this rank's bytes in the planner's four terms, measured.

The planner predicts, per pipeline rank, ``parameters + gradients + optimizer + activations``
(:class:`stagewise.planning.RankMemory`); this report gives the same keys, measured on the tensors this rank
holds: parameters (a DTensor's local shard), their ``.grad`` (as they stand: after a train step, before
``zero_grad(set_to_none=True)``), every tensor of the optimizers' state (``optimizer=``'s, and those given to
``pipe.metrics.watch``), and the peak of activations saved for backward during the last train step
(``measure_memory=True``: :mod:`..features.memory`; None without it). ``total`` sums the terms it has.

With ``offload="optimizer"`` the stages' optimizer state lives in host memory, so ``optimizer`` counts only
what stays on the device (a watched optimizer's), and ``host`` the offload's host bytes - each parameter's
master, gradient buffer and optimizer state - which ``total``, the device's, leaves out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = _local(t)
        key = local.untyped_storage().data_ptr() if local.device.type != "meta" else id(local)
        if key and key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:  # (a step count is a 1-element tensor)
                    yield value


def memory_report(
    params: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer], meter: Any, offload: Any = None
) -> dict[str, Any]:
    """``parameters``, ``gradients``, ``optimizer``, ``activations`` (None without ``measure_memory=True``) and
    ``total`` in bytes; with the meter also ``peak_bytes``, ``forward_bytes`` and ``weight_bytes``; with an
    offload (:class:`..features.offload.Offload`) also ``host``."""
    on_device = [opt for opt in optimizers if offload is None or not offload.holds(opt)]
    report: dict[str, Any] = {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(optimizer_tensors(on_device)),
        "activations": None if meter is None else int(meter.peak),
    }
    report["total"] = sum(v for v in report.values() if v is not None)
    if offload is not None:
        report["host"] = _bytes(offload.host_tensors())
    if meter is not None:
        report.update(peak_bytes=meter.peak, forward_bytes=dict(meter.by_forward), weight_bytes=dict(meter.by_weight))
    return report
