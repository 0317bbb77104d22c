"""``torch.optim.swa_utils.update_bn`` for a pipeline: the running statistics of its BatchNorm layers estimated
afresh, with the weights as they are now, over the batches given.

Why a pipeline needs it more than one process does: it trains every BatchNorm on micro-batch statistics, while
eval mode normalises with the running statistics, an exponential average over steps whose weights kept moving.
``examples/resnet_digits.py`` after 30 steps (2 stages, 4 micro-batches of 16) scored 55.9 % with
``batchnorm="deferred"`` and 87.2 % with ``"micro"`` where one process scored 94.9 %; a one-process replay of the
micro-batched training gives the same two figures (so neither is a fault of the pipeline), and statistics
estimated again with the final weights gave 93.3 % (micro-batches of 16, one process). By 150 steps all
three agree (98.7 %).

As torch's: each layer's statistics are reset and its ``momentum`` set to None (the cumulative average) for the
pass, every module in training mode; the forwards run as ``eval_step`` runs them (no autograd graph, each
micro-batch normalised alone, as in training); each layer's momentum and every module's mode are put back after.
What one estimate averages follows the pipeline's ``batchnorm=``: under ``"micro"`` (or none chosen) torch's own
update, one per micro-batch, which is torch's ``update_bn`` over the micro-batches in one process; under
``"deferred"`` one per batch, over the inputs the layer saw in all of its micro-batches (:mod:`.batchnorm`; with
``across_replicas=True`` every replica's share too). Only a first BatchNorm sees the inputs it would see in one
process: behind one, each micro-batch was normalised with its own statistics, as in training, so the estimates
are those of the model the pipeline trains, not torch's ``update_bn`` over whole batches. (In the ResNet above
with ``"deferred"``: 93.6 % after it.) A DataLoader's short last batch may give a layer a micro-batch of one value
per channel, which torch refuses to normalise by its own statistics: that call normalises with the running
statistics and updates nothing (under ``"deferred"`` its values still count), where it failed the pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .batchnorm import BatchNorms


def update_bn(loader: Iterable[Any], pipe: Any) -> None:
    """Estimate ``pipe``'s BatchNorm running statistics again over ``loader``'s batches, as
    ``torch.optim.swa_utils.update_bn(loader, model)`` does in one process (the module docstring says how).

    A collective, like ``eval_step``: every rank calls it with the same batches (under ``parallel=``, each
    replica's own share, :meth:`~stagewise.Pipeline.local_batch`). As in torch's, a batch that is a tuple or list
    gives its first item as the inputs (an ``(inputs, targets)`` pair from a DataLoader; a model whose inputs are
    a tuple is given ``(inputs,)``), anything else is the inputs; batches may differ in size (a
    DataLoader's last one), as ``eval_step``'s may.
    """
    hooks = getattr(pipe, "hooks", None)  # a stage's SYNC / STEP parts: the BatchNorm policy is one of them
    if hooks is None or not hasattr(pipe, "eval_step"):
        raise TypeError(f"update_bn(loader, pipe) takes a stagewise Pipeline as pipe, got {type(pipe).__name__}")
    norms = next((p for p in hooks.parts if isinstance(p, BatchNorms)), None)
    layers = [] if norms is None else [bn for ls in norms.layers.values() for bn in ls if bn.running_mean is not None]
    momenta = [bn.momentum for bn in layers]
    modes = [(m, m.training) for m in pipe.modules()]
    for bn in layers:
        bn.reset_running_stats()
        bn.momentum = None
    pipe.train()  # (eval_step then counts every forward, as a train step's: see .batchnorm)
    try:
        for batch in loader:
            pipe.eval_step(batch[0] if isinstance(batch, (list, tuple)) else batch, merge_outputs=False)
    finally:
        for bn, momentum in zip(layers, momenta):
            bn.momentum = momentum
        _restore_modes(modes)


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Every module's own training flag back (``pipe.train(was)`` would flatten a frozen layer's eval mode)."""
    for module, training in modes:
        module.training = training
