"""The runtime: everything that touches torch lives under here; the rest of stagewise is pure.

Under ``torchrun --nproc-per-node N train.py``, every rank runs::

    import stagewise as sw
    env = sw.init()                                  # gloo on CPU, NCCL on CUDA; explicit timeout
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())       # this rank's share of the model
    loss = pipe.train_step(inputs, targets)          # the batch's mean loss, on every rank
    opt.step(); opt.zero_grad()

The rooms:

* ``pipeline.py``, ``context.py``, ``options.py``: the facade; where it runs; its options.
* ``model/``: layers and layer lists, tied modules, profiling, partitioning, building this rank's stages.
* ``frontends/``: other ways in: ``from_model`` (torch.fx tracing and cutting, ``split/``), ``from_hf``
  (transformers causal LMs, cut among their decoder layers), ``ties`` (tied parameters a frontend finds).
* ``engine/``: the interpreter (one handler per action kind, no schedule-specific code), backward
  split into I and W, the mailbox of boundary values, micro-batching, recompute, precision, memory,
  hang forensics.
* ``comm/``: the only room talking to torch.distributed: process-group set-up, groups, collectives,
  the error board, deadline waits, the ``Transport`` protocol and its torch point-to-point implementation.
* ``hybrid/``: the other parallel axes: the device mesh, data parallelism, ZeRO sharding (FSDP2),
  tensor parallelism (DTensor).
"""

from .comm.setup import Env, init
from .errors import PipelineError
from .frontends.layers import Chain, Layer, build_model
from .pipeline import Pipeline

__all__ = ["Chain", "Env", "Layer", "Pipeline", "PipelineError", "build_model", "init"]
