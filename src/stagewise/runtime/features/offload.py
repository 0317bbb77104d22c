"""Optimizer-state offload: each stage's optimizer state, and its update, live in host memory.

Roughly: with ``Pipeline(..., optimizer=factory, offload="optimizer")`` the device keeps only what the
forwards and backwards use - the parameters, and their gradients until the stage's STEP - while the host
keeps, per parameter, a *master* copy (float32 for a bfloat16 / float16 parameter, else the parameter's own
dtype), a gradient buffer, and every tensor of the optimizer's state (AdamW's two moments, SGD's momentum).
On CUDA the host buffers are pinned, so the copies are asynchronous DMA.

Where the update runs: **on the host** (ZeRO-Offload's choice). At a stage's STEP:

    device                          host (pinned)
    grad  ---- D2H, async ------->  gradient buffer          1x the parameters' bytes down
          wait for the copies (one GPU wait per stage STEP: the host must see the gradients)
                                    optimizer.step() on the masters, its state beside them
    param <--- H2D, async --------  master (rounded to the parameter's dtype first)   1x up

Memory / time, per parameter with AdamW in float32: the device saves the 8 bytes of moments (and, for
a bfloat16 model, the 4-byte float32 master it would need for exact accumulation); the host holds
4 (master) + 4 (gradient buffer) + 8 (moments). Each step moves the parameters' bytes twice over PCIe
and runs the update on the CPU - memory-bound, ~16-20 bytes read and written per parameter, so a CPU
with ~100 GB/s does ~5 G parameters/s at best (give the factory ``fused=True`` for torch's fused CPU
AdamW). The wait at a stage's STEP covers everything queued before it on the stream, and the device has
nothing queued while the host updates: the step grows by each stage's gradient copy, host update and
the part of its copy back that the next kernels do not hide. The two alternatives not taken: state
streamed to the device for an update there moves the state (2x the parameters for AdamW) down *and* up
each step, three times the PCIe bytes, for a faster update - it pays only with a slow CPU and a fast
link; and ZeRO-Offload's optional delayed update (the host updates step k while the device runs step k+1) hides
the update but trains on one-step-stale weights, which is not the optimizer the user asked for.

What "host" means with sharding: each rank offloads what its optimizer holds - under ``parallel=``
sharding (FSDP2) that is its own shard, so each host holds ``1/sharding`` of the state, as on the
device; a DTensor parameter (sharded or tensor-parallel) gets a DTensor master of the same placements
over a host local tensor, so the optimizer computes exactly what it computes on the device. Data
parallelism changes nothing: the gradients are reduced before STEP, each replica updates its copy.

The optimizer is the factory's own, built over the device parameters (so checkpoints, learning-rate
schedulers and ``Pipeline.optimizers`` see the usual object, its state keyed by the parameters); at each
STEP its parameter groups hold the host masters for the length of ``step()``. An optimizer that keeps
references to its parameters outside ``param_groups`` and ``state`` is not supported. A master is
refreshed from its device parameter when something else wrote the parameter in place since the last
update (torch's version counter: a checkpoint load, HetPipe's wave); a write through ``.data`` is not
seen. Masters are not saved in checkpoints (the model's tensors are): after a load they restart from the
loaded parameters.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

CHOICES = ("optimizer",)
HALF = (torch.bfloat16, torch.float16)
WaitGpu = Callable[[torch.device, str], None]


def check_offload(value: str | None) -> None:
    if value is not None and value not in CHOICES:
        raise ValueError(f"offload must be None or 'optimizer' (optimizer state and update on the host), got {value!r}")


def _dtensor() -> Any:
    """torch's DTensor class, if its module is loaded (no DTensor exists otherwise; importing it is slow)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    cls = _dtensor()
    return t.to_local() if cls is not None and isinstance(t, cls) else t


def _like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a host tensor) as ``t`` is: a DTensor of ``t``'s mesh and placements, or itself."""
    cls = _dtensor()
    if cls is None or not isinstance(t, cls):
        return local
    return cls.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


@dataclass
class _Param:
    """One parameter's host side."""

    param: nn.Parameter  # on the device: what the stage computes with
    master: torch.Tensor  # on the host: what the optimizer updates (a DTensor where ``param`` is one)
    local: torch.Tensor  # the master's local tensor
    buffer: torch.Tensor | None = None  # host, the gradient's dtype: gradients come down (and half values go up)
    grad: torch.Tensor | None = None  # the gradient the optimizer sees at this step
    version: int = -1  # the device parameter's version counter after our last write


class HostOptimizer:
    """One optimizer whose state and update live on the host (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.pin = device.type == "cuda"
        self.params: list[_Param] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.params.append(self._host(p))
        self._to_host = {id(h.param): h.master for h in self.params}
        self._to_device = {id(h.master): h.param for h in self.params}
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: self._swap(self._to_host))
        optimizer.register_load_state_dict_post_hook(lambda opt: self._swap(self._to_device))

    def _empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(like.shape, dtype=dtype, pin_memory=self.pin)

    def _host(self, p: nn.Parameter) -> _Param:
        src = _local(p).detach()
        local = self._empty(src, torch.float32 if src.dtype in HALF else src.dtype)
        local.copy_(src)
        h = _Param(p, _like(p, local), local)
        h.version = _local(p)._version
        return h

    # ---- one STEP -----------------------------------------------------------------------------------
    def pull(self) -> None:
        """Masters written elsewhere refreshed; this step's gradients copied down (asynchronously on CUDA)."""
        with torch.no_grad():
            for h in self.params:
                if _local(h.param)._version != h.version:
                    h.local.copy_(_local(h.param))  # (rare: a checkpoint load, a HetPipe wave; blocking)
                g = h.param.grad
                if g is None:
                    h.grad = None
                    continue
                src = _local(g)
                if h.buffer is None or h.buffer.shape != src.shape or h.buffer.dtype != src.dtype:
                    h.buffer = self._empty(src, src.dtype)
                h.buffer.copy_(src, non_blocking=True)
                h.grad = g

    def update(self) -> None:
        """The factory's optimizer steps the masters (its state is created, and stays, beside them)."""
        for h in self.params:
            if h.grad is not None:
                assert h.buffer is not None
                grad = h.buffer if h.buffer.dtype == h.local.dtype else h.buffer.to(h.local.dtype)
                h.master.grad = _like(h.grad, grad)
        self._swap(self._to_host)
        try:
            self.optimizer.step()
        finally:
            self._swap(self._to_device)
            for h in self.params:
                h.master.grad, h.grad = None, None

    def push(self) -> None:
        """The updated values go back up into the device parameters (asynchronously on CUDA)."""
        with torch.no_grad():
            for h in self.params:
                dst = _local(h.param)
                if h.local.dtype == dst.dtype:
                    dst.copy_(h.local, non_blocking=True)
                else:  # a half parameter: rounded on the host, into its (idle) gradient buffer, then up
                    if h.buffer is None or h.buffer.shape != dst.shape or h.buffer.dtype != dst.dtype:
                        h.buffer = self._empty(dst, dst.dtype)
                    h.buffer.copy_(h.local)
                    dst.copy_(h.buffer, non_blocking=True)
                h.version = dst._version

    # ---- the optimizer's view -----------------------------------------------------------------------
    def _swap(self, mapping: Mapping[int, torch.Tensor]) -> None:
        """Hand the optimizer the tensors ``mapping`` names in place of its parameters, state and all."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
        state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for key, value in opt.state.items():
            state[mapping.get(id(key), key)] = value
        opt.state = state

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """Every host tensor this optimizer's offload holds: masters, gradient buffers and the state."""
        for h in self.params:
            yield h.local
            if h.buffer is not None:
                yield h.buffer
            for value in self.optimizer.state.get(h.param, {}).values():
                if isinstance(value, torch.Tensor):
                    yield _local(value)


class Offload:
    """The STEP of every local stage's optimizer, with state and update on the host (a hooks' stepper)."""

    def __init__(self, optimizers: dict[int, torch.optim.Optimizer], device: torch.device, wait_gpu: WaitGpu) -> None:
        self.device = device
        self.wait_gpu = wait_gpu
        self.hosts = {s: HostOptimizer(opt, device) for s, opt in optimizers.items()}

    def step(self, stage: int, optimizer: torch.optim.Optimizer) -> None:
        host = self.hosts[stage]
        assert host.optimizer is optimizer, f"stage {stage}: an optimizer the offload does not hold"
        host.pull()
        self.wait_gpu(self.device, f"stage {stage}'s gradients to reach the host")
        host.update()
        host.push()

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s state lives on the host (one of the stages' optimizers this offload steps)."""
        return any(host.optimizer is optimizer for host in self.hosts.values())

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """Every host tensor the offload holds: masters, gradient buffers and the optimizers' state."""
        for host in self.hosts.values():
            yield from host.host_tensors()


def offload_optimizers(
    choice: str | None, optimizers: dict[int, torch.optim.Optimizer], device: torch.device, wait_gpu: WaitGpu
) -> Offload | None:
    """The stepper for ``offload=choice`` (None: the optimizers step on the device, as built)."""
    check_offload(choice)
    if choice is None or not optimizers:
        return None
    return Offload(optimizers, device, wait_gpu)
