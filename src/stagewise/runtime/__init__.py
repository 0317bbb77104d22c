"""The runtime: torch and torch.distributed live here, and nowhere else in stagewise.

Under ``torchrun --nproc-per-node N train.py``, every rank runs::

    import stagewise as sw
    env = sw.init()                                  # gloo on CPU, NCCL on CUDA; explicit timeout
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())       # this rank's share of the model
    loss = pipe.train_step(inputs, targets)          # the batch's mean loss, on every rank
    opt.step(); opt.zero_grad()

``layers`` are modules or lazy :class:`Layer` specs; layer k of a spec list
is seeded with ``seed + k``, so ``build_model(layers, seed)`` is the same
model in one process (the reference for tests and checkpoints; parameter
names match). A layer's output is the next layer's input; a plain tuple is
unpacked into arguments.

How it is built: :mod:`.pipeline` builds this rank's stages and runs this
rank's action list through :mod:`.interpreter` (one handler per action kind,
no schedule-specific code); :mod:`.backward` splits backward into input (I)
and weight (W) parts; :mod:`.messages` turns values into point-to-point ops;
:mod:`.transport` is the only module that talks to ``torch.distributed``
besides :mod:`.init`.
"""

from .errors import PipelineError
from .init import Env, init
from .layers import Chain, Layer, build_model
from .pipeline import Pipeline

__all__ = ["Chain", "Env", "Layer", "Pipeline", "PipelineError", "build_model", "init"]
