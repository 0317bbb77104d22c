"""The offload column of the combination matrix: ``offload="optimizer"`` with SGD's momentum (plain SGD has no
state to move), exact against the plain optimizer, its state where the offload put it.

On these CPU ranks the "host" is the same memory as the "device": where the state lives is proven by storage
identity - every momentum buffer in a storage the offload allocated, none in a parameter's.
"""

from __future__ import annotations

from typing import Any

import stagewise as sw
from matrix_build import build, momentum
from matrix_models import mlp_tp_plan
from matrix_reference import train_compare
from stagewise.runtime.features.offload import Offload, _local
from worker import Ctx


def offload_cell(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """SGD with momentum, its state offloaded: exact against the plain optimizer, and every state tensor on every
    rank in a host buffer of the offload's, none in a parameter's or gradient's storage. For layer lists also on
    pp 2 x dp 2, pp 2 x sharding 2 and pp 2 x tp 2: under sharding (and tp) each rank's host holds the state of
    its own part of each parameter."""
    b = build(row, column, ctx)
    out: dict[str, Any] = {"losses": train_compare(b, f"{row} x {column}", optimizer=momentum)}
    out["state"] = _offloaded_state(b.pipe, f"{row} x {column}")
    if row == "layers":
        for axis in ("dp", "sharding", "tp"):
            more = {"tp_plan": mlp_tp_plan()} if axis == "tp" else {}
            mesh = build(row, column, ctx, parallel=sw.ParallelConfig(pp=2, **{axis: 2}), **more)
            train_compare(mesh, f"{row} x {column} x {axis}", optimizer=momentum)
            local, whole = out[axis] = _offloaded_state(mesh.pipe, f"{row} x {column} x {axis}")
            assert (local < whole) == (axis != "dp"), f"{axis}: {local} state elements here of {whole}"
    return out


def _offloaded_state(pipe: Any, what: str) -> tuple[int, int]:
    """The state's elements on this rank and its parameters' whole elements; the state checked to live in the
    offload's host buffers, each as large as its parameter's part on this rank (a shard under sharding)."""
    stepper = pipe.hooks.stepper
    assert isinstance(stepper, Offload), f"{what}: the optimizers step on the device"
    host = {t.untyped_storage().data_ptr() for h in stepper.hosts.values() for t in h.host_tensors()}
    device = {_local(p).untyped_storage().data_ptr() for p in pipe.parameters()}
    assert not host & device, f"{what}: a host buffer shares a parameter's storage"
    count = whole = 0
    for opt in pipe.optimizers.values():
        for p, state in opt.state.items():
            buf = _local(state["momentum_buffer"])
            assert buf.untyped_storage().data_ptr() in host, f"{what}: a momentum buffer outside the host buffers"
            assert buf.shape == _local(p).shape, (what, buf.shape, _local(p).shape)
            count, whole = count + buf.numel(), whole + p.numel()
    assert count > 0, f"{what}: no optimizer state to check"
    return count, whole
