"""ZeRO sharding over the ``sharding`` axis (replicated over ``dp``) with torch's FSDP2, driven by SYNC.

Each layer of a stage that has parameters becomes one ``fully_shard`` unit
on the ``(dp, sharding)`` sub-mesh (plain FSDP when ``dp == 1``, HSDP
otherwise: sharded within a sharding group, replicated across dp). At rest -
between steps - a rank holds ``1/sharding`` of each parameter, of its
gradient and therefore of the optimizer state built over it (ZeRO stages 1
and 2, and parameters too). During a step:

* the first forward of a layer all-gathers its parameters (FSDP's pre-forward
  hook), and they stay whole until the stage's SYNC, so every later
  micro-batch's forward, backward, I and W uses them without further traffic;
* gradients accumulate, unsharded, over the micro-batches (reduction is off);
* at ``sSYNC`` the stage's gradients are reduce-scattered over ``sharding``
  (and all-reduced over ``dp``), averaged, and the parameters resharded.

FSDP2 itself reduces after every backward; a pipeline needs one reduction per
step, after the last micro-batch. So reduction is switched off and run by hand
at SYNC, as ``torch.distributed.pipelining`` does (``perform_reduce_grad`` in
its ``stage.py``): that reaches into FSDP2's state (``_fsdp_param_groups``,
``_root_post_backward_final_callback``), which may move between torch versions.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def shard_layers(layers: Iterable[nn.Module], mesh: DeviceMesh, whole: Container[int] = ()) -> list[FSDPModule]:
    """Make each layer with trainable parameters an FSDP2 unit on ``mesh``, reduction left to :func:`reduce`.

    Parameters whose id is in ``whole`` (tied ones) stay unsharded, ignored by the unit (FSDP2's
    ``ignored_params``): their gradients are summed over every copy and replica by the tied sync. The rest of
    a layer holding one is sharded and reduced as any other: leaving that whole layer out instead (as this
    once did) left its other gradients unreduced, each replica's own (the wrong gradients of a tied head under
    ``sharding > 1``, issue 51).
    """
    _quiet_view_warning()
    units = []
    for layer in layers:
        params = list(layer.parameters())
        tied = {p for p in params if id(p) in whole}
        if not any(p.requires_grad and p not in tied for p in params):
            continue
        unit = fully_shard(layer, mesh=mesh, reshard_after_forward=False, ignored_params=tied or None)
        _accumulate(unit)
        units.append(unit)
    return units


#: torch 2.13's FSDP2 warning when a unit's output is a view (a Linear on a 3-d input with a bias: addmm then view)
VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def _quiet_view_warning() -> None:
    """Ignore exactly FSDP2's "returned a view tensor" warning, raised at each forward of a unit whose output is a
    view. It warns that an in-place op on that view drops the unit's pre-backward hook, and so the all-gather
    before its backward. Harmless here: a unit's parameters are gathered at its first forward and stay whole until
    SYNC (``reshard_after_forward=False``, no resharding after backward), so there is no all-gather in backward to
    skip, and the reduction runs by hand at SYNC (:func:`reduce`), not from that hook
    (tests/runtime/test_sharding_warnings.py does the in-place op and gets the model's gradients)."""
    warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)


def reduce(units: Iterable[FSDPModule]) -> None:
    """Reduce-scatter (and all-reduce over dp) the accumulated gradients, average them, reshard the parameters."""
    for unit in units:
        unit.set_is_last_backward(True)
        unit.set_reshard_after_backward(True)
        unit.set_requires_gradient_sync(True)
        state = unit._get_fsdp_state()
        for group in state._fsdp_param_groups:
            group.post_backward()
        state._root_post_backward_final_callback()
        _accumulate(unit)


def reshard(units: Iterable[FSDPModule]) -> None:
    """Free the gathered parameters (after a forward-only step), keeping this rank's shard."""
    for unit in units:
        unit.reshard()


def _accumulate(unit: FSDPModule) -> None:
    """Backward passes only accumulate: no reduction, no resharding, until :func:`reduce`."""
    unit.set_is_last_backward(False)
    unit.set_reshard_after_backward(False)
    unit.set_requires_gradient_sync(False)
