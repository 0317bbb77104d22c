"""The named device mesh of a hybrid-parallel job, and the few collectives stagewise runs over its axes.

:class:`Mesh` is a value built once from a :class:`~stagewise.ParallelConfig`
and passed explicitly (to :class:`~stagewise.Pipeline` as ``parallel=``): a
torch ``DeviceMesh`` with axes ``("pp", "dp", "sharding", "tp")`` (see
:mod:`stagewise.parallel` for the order), one process group per axis,
and this rank's coordinates. Nothing is global: two meshes over the same
processes are two sets of groups.

Besides :mod:`..comm.transport` (point-to-point) and :mod:`..comm.setup`, this is the only
module that runs ``torch.distributed`` collectives: the data-parallel gradient
all-reduce, the loss mean and the gradient norm go through the functions at
the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...parallel import AXES, Coords, ParallelConfig
from ..comm.collectives import Wait, all_reduce

_meshes_made = 0


class Mesh:
    """A :class:`~stagewise.ParallelConfig` laid out on the processes: groups per axis and this rank's place.

    ``device_mesh`` is torch's ``DeviceMesh`` (named axes, for DTensor, FSDP2
    and tensor parallelism); ``group(axis)`` the process group along one axis
    (the ranks that differ from this one only there).
    """

    def __init__(self, config: ParallelConfig, device_mesh: DeviceMesh) -> None:
        if tuple(device_mesh.mesh_dim_names or ()) != AXES:
            raise ValueError(f"the device mesh must have the axes {AXES}, got {device_mesh.mesh_dim_names}")
        if tuple(device_mesh.shape) != config.shape:
            raise ValueError(f"the device mesh has shape {tuple(device_mesh.shape)}, the config {config.describe()}")
        self.config = config
        self.device_mesh = device_mesh
        self.rank = dist.get_rank()
        self.coords = Coords(*(device_mesh.get_local_rank(a) for a in AXES))
        global _meshes_made
        self.id = _meshes_made  # the same on every rank: meshes are built in the same order everywhere
        _meshes_made += 1
        self.pipelines_made = 0

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def replica(self) -> int:
        """Which slice of the batch this rank trains on (``dp_i * sharding + sharding_i``)."""
        return self.coords.dp * self.config.sharding + self.coords.sharding

    def group(self, axis: str) -> Any:
        """The process group along ``axis``."""
        return self.device_mesh.get_group(axis)

    def sub(self, *axes: str) -> DeviceMesh:
        """The sub-mesh over ``axes`` (in mesh order) that holds this rank."""
        return self.device_mesh[axes if len(axes) > 1 else axes[0]]

    def all_reduce(
        self, tensor: torch.Tensor, axes: Iterable[str], op: str = "sum", wait: Wait | None = None, what: str = ""
    ) -> torch.Tensor:
        """Reduce ``tensor`` in place over the ranks spanned by ``axes`` (one collective per axis of size > 1),
        each waited for through ``wait`` (the pipeline's deadline wait) when given."""
        for axis in axes:
            if self.config.size(axis) > 1:
                all_reduce(tensor, self.group(axis), op, wait, f"{what or 'an all-reduce'} over {axis}")
        return tensor

    def where(self) -> str:
        """This rank on the mesh, for messages: ``"global rank 3: pp=1 dp=1 sharding=0 tp=0"``."""
        return f"global rank {self.rank}: " + " ".join(f"{a}={c}" for a, c in zip(AXES, self.coords))

    def __repr__(self) -> str:
        return f"Mesh({self.config.describe()}, rank {self.rank} at {tuple(self.coords)})"


def build_mesh(config: ParallelConfig, device_type: str | None = None) -> Mesh:
    """Lay ``config`` out on the default process group (its size must be the product of the degrees).

    ``device_type`` defaults to ``"cuda"`` under NCCL and ``"cpu"`` otherwise
    (gloo). Every rank must call it, in the same order as its other group
    creations.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call stagewise.init() before building a mesh")
    backend, world = str(dist.get_backend()), dist.get_world_size()  # (after an in-place membership change: the
    config.check_world(world)  # generation's default group, remade from its members: comm/generations.py)
    if device_type is None:
        device_type = "cuda" if backend == "nccl" else "cpu"
    # an axis spanning the world gets a group of its own rather than the default one (the user's), so that
    # the pipeline can give it its timeout (comm.groups.bound)
    whole: dict[int | str, Any] = {a: backend for a, n in zip(AXES, config.shape) if n > 1 and n == world}
    return Mesh(config, init_device_mesh(device_type, config.shape, mesh_dim_names=AXES, backend_override=whole))
