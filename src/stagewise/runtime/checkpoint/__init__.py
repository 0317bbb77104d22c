"""Layout-independent checkpoints: save a pipeline under one layout, load it under any other, or in one process.

See :func:`save` and :func:`load`; the tensors are written with
``torch.distributed.checkpoint`` under the one-process model's names
(:mod:`.state`), sealed by a manifest of digests (:mod:`.manifest`), and
published by a rename under ``ROOT/step-N`` (:mod:`.retention`).
"""

from .api import latest, load, save
from .declared import CheckpointInfo
from .manifest import CheckpointError
from .resume import resume

__all__ = ["CheckpointError", "CheckpointInfo", "latest", "load", "resume", "save"]
