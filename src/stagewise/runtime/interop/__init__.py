"""torch.distributed.pipelining's side of :mod:`stagewise.interop`: what needs torch's own objects.

* :mod:`.torch_orders`: :func:`torch_order`, a torch schedule class's order (made with stand-in stages,
  no processes), for :func:`stagewise.interop.from_torch`;
* :mod:`.torch_runtime`: :func:`torch_runtime`, torch's ``_PipelineScheduleRuntime`` loaded with a
  stagewise schedule.

The only room outside ``comm/`` and ``hybrid/`` that imports ``torch.distributed``: the pipelining package
it wraps (tests/core/test_layering.py names it).
"""

from .torch_orders import READS, schedule_class, torch_order, torch_pipelining_missing
from .torch_runtime import torch_runtime

__all__ = ["READS", "schedule_class", "torch_order", "torch_pipelining_missing", "torch_runtime"]
