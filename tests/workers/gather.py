"""Test-side gather of arbitrary Python objects (pickled: the checks compare the ranks' own reports).

The library itself exchanges only plain data (JSON or tensors); the checks may gather whatever they inspect.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
