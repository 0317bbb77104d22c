"""The runtime: everything that touches torch lives under here; the rest of stagewise is pure.

Under ``torchrun --nproc-per-node N train.py``, every rank runs::

    import stagewise as sw
    env = sw.init()                                  # gloo on CPU, NCCL on CUDA; explicit timeout
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())       # this rank's share of the model
    loss = pipe.train_step(inputs, targets)          # the batch's mean loss, on every rank
    opt.step(); opt.zero_grad()

The rooms (this door loads none of them until a name is asked for), from the ground up; a room imports only
rooms below it (``tests/core/test_layering.py``):

* ``errors.py``, ``interrupt.py``, ``losses.py``: the one error, Ctrl-C's line, token-level losses;
* ``comm/``: talking to torch.distributed: set-up, groups, collectives; ``transport/``, ``shm/``, ``faults/``;
  ``launch.py``: starting the ranks (``stagewise run``);
* ``engine/``: executes the IR: the interpreter (one handler per action kind, no schedule-specific code),
  the runner (the one step protocol), stages, messages, backward split into I and W; its two seams, a
  stage's SYNC / STEP (``StagePart``) and each step (``StepPart``), which the features plug into;
* ``hybrid/``: the other parallel axes: device mesh, data parallelism, FSDP2 sharding, DTensor TP;
  ``checkpoint/``: save / load / resume on torch.distributed.checkpoint; ``interop/``:
  torch.distributed.pipelining's schedule classes read (``torch_order``), its runtime loaded (``torch_runtime``);
* ``features/``: optional per-step behaviour, one file per option; ``asynchronous/``: weight versions at run
  time, the version-aware interpreter, windows; ``measure/``: profiling a module, probing a link;
* ``reporting/``: what a pipeline reports: per-step metrics (JSON lines, TensorBoard), the progress line, the
  events, memory, the gathered state dict and the loss plot;
* ``options.py``: the one options value; ``standing.py``: where a pipeline's process stands (its ranks, its
  replica); ``frontends/``: every way in returns parts for the assembly: layer
  lists, ``from_model`` (torch.fx, ``split/``), ``from_hf``, ``from_stages``, plans;
* ``assembly/``: the construction path: the schedule and where it runs, what is refused, the ranks'
  agreement, ``schedule="auto"``, the engine around the built stages;
* ``pipeline.py``, ``hetpipe.py``: the facades; ``calibration/``: pipelines run to measure the group;
  ``elastic/``: lost machines: ``snapshot=`` (each rank's state in its machine's and a peer's memory), resuming
  from it at any world size, and what ``stagewise run --nnodes MIN:MAX`` gives torch's elastic agent.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public runtime names -> the module that defines them (imported on first use)
_NAMES = {
    "Pipeline": ".pipeline",
    "HetPipe": ".hetpipe",
    "WSPStats": ".hetpipe",
    "Options": ".options",
    "PipelineOptions": ".options",
    "init": ".comm.setup",
    "Env": ".comm.setup",
    "PipelineError": ".errors",
    "Snapshots": ".elastic.config",
    "InPlace": ".relayout.generation",
    "Layer": ".frontends.layers",
    "Chain": ".frontends.layers",
    "build_model": ".frontends.one_process",
    "Tied": ".frontends.tied",
    "MicroBatches": ".engine.microbatch",
    "stage": ".frontends.split",
    "split_model": ".frontends.split",
    "SplitModel": ".frontends.split",
    "SplitError": ".frontends.split",
    "Mesh": ".hybrid.mesh",
    "build_mesh": ".hybrid.mesh",
    "column_parallel": ".hybrid.tensor_parallel",
    "row_parallel": ".hybrid.tensor_parallel",
    "vocab_parallel_embedding": ".hybrid.tensor_parallel",
    "BatchNormPolicy": ".features.batchnorm",
    "update_bn": ".features.update_bn",
    "aux_loss": ".features.aux_loss",
    "seeded_dropout": ".features.dropout",
    "collect_aux_losses": ".features.aux_loss",
    "causal_lm_loss": ".losses",
    "count_tokens": ".losses",
    "profile": ".frontends.profile",
    "profile_sizes": ".frontends.profile",
    "calibrate": ".calibration.calibrate",
    "measure_compute_scale": ".calibration.compute_scale",
    "RunCalibrator": ".calibration.from_run",
    "Replanner": ".calibration.replan",
    "counted_reads": ".measure.host_reads",
    "shm_transport": ".comm.shm.transport",
    "torch_transport": ".comm.choose_transport",
    "torch_order": ".interop.torch_orders",
    "torch_runtime": ".interop.torch_runtime",
    "MetricsConfig": ".reporting.config",
    "gather_state_dict": ".reporting.files",
    "plot_losses": ".reporting.files",
    "read_metrics": ".reporting.files",
}

__all__ = sorted(_NAMES)


#: names that left the runtime: name -> where they are now
_GONE = {
    "async_reference": "the repository's tests/oracles/async_reference.py (a test-only replay of the rule)",
    "wsp_reference": "the repository's tests/oracles/wsp_reference.py (a test-only replay of the rule)",
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name], __name__), name)
    if name in _GONE:
        raise AttributeError(f"stagewise.runtime.{name} is gone: it is {_GONE[name]}")
    raise AttributeError(f"module 'stagewise.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_NAMES)
