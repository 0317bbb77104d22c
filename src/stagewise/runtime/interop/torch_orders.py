"""The order of a torch.distributed.pipelining schedule class, made without processes: :func:`torch_order`.

torch's schedule classes compute their order in their constructor, from the stages they are given: only
the stages' counts and ranks are read, so stand-in stages (:class:`_StandIn`) build every rank's order in
one process. What comes out is a :class:`stagewise.interop.TorchOrder` (torch's words, plain data), read
into stagewise by :func:`stagewise.interop.from_torch`.

Two readings (``read=``):

* ``"pipeline_order"``: the class's ``pipeline_order`` table, what torch draws and dumps;
* ``"step"``: the actions its ``step()`` runs. A ``_PipelineScheduleRuntime`` subclass interprets
  ``pipeline_order_with_comms`` (its lowering of the table: communication, REDUCE_GRAD, UNSHARD and
  RESHARD added), so that list is read. The single-stage classes (``ScheduleGPipe``, ``Schedule1F1B``) run
  a loop of their own that ignores the table; it is run on a stand-in stage per rank that records each
  forward, backward and gradient reduction it is asked for (their point-to-point operations are empty
  lists, so no process group is touched). ``Schedule1F1B``'s table numbers the last rank's forwards one
  too high (``1F1 1B0 ...``), which the validator refuses; its loop runs them in order.

Uses torch's private schedule internals (tested on torch 2.13; see :func:`torch_pipelining_missing`).
"""

from __future__ import annotations

import inspect
from typing import Any

from ...interop import TorchOrder

READS = ("pipeline_order", "step")


def torch_pipelining_missing() -> str | None:
    """Why this torch cannot run the interop (None when it can): it needs ``_PipelineScheduleRuntime``
    with ``_load_csv(path, format)`` and the action kinds of torch 2.13 (OVERLAP_F_B, REDUCE_GRAD)."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as err:  # a torch built without distributed
        return f"torch.distributed.pipelining does not import: {err}"
    if not hasattr(schedules, "_PipelineScheduleRuntime"):
        return "this torch has no torch.distributed.pipelining.schedules._PipelineScheduleRuntime"
    kinds = {k.value for k in schedules._ComputationType}
    missing = sorted({"OVERLAP_F_B", "REDUCE_GRAD", "SEND_F", "RECV_B"} - kinds)
    if missing:
        return f"this torch's pipelining has no action kinds {missing}"
    return None


def schedule_class(cls: type | str) -> type:
    """A torch schedule class, given itself or its name (``"ZBVZeroBubble"``, ``"ScheduleZBVZeroBubble"``)."""
    from torch.distributed.pipelining import schedules

    if isinstance(cls, str):
        name = cls.removeprefix("Schedule") if cls.lower() != "schedule" else cls
        try:
            klass = schedules.get_schedule_class(name)
        except ValueError as err:
            raise ValueError(f"unknown torch schedule {cls!r}: {err}") from None
    elif isinstance(cls, type) and issubclass(cls, schedules._PipelineSchedule):
        klass = cls
    else:
        raise TypeError(f"expected a torch.distributed.pipelining schedule class or its name, got {cls!r}")
    bases = (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti, schedules._PipelineScheduleRuntime)
    if klass in bases or inspect.isabstract(klass):
        raise ValueError(
            f"{klass.__name__} is a base of torch's schedule classes, with no order of its own (torchtitan takes it "
            "with a CSV file, whose order it runs): name a class that makes one, e.g. 1F1B, GPipe, Interleaved1F1B, "
            "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; or read a file with from_torch(Path(...))"
        )
    return klass


def torch_order(cls: type | str, p: int, m: int, v: int | None = None, *, read: str = "pipeline_order") -> TorchOrder:
    """torch's order for schedule class ``cls`` on ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank.

    ``cls``: the class (``torch.distributed.pipelining.ScheduleZBVZeroBubble``) or its name as torchtitan
    spells it (``"ZBVZeroBubble"``). ``v``: 1 for the single-stage classes, else 2 unless given.
    ``read``: ``"pipeline_order"`` (the table) or ``"step"`` (what ``step()`` runs; module docstring).
    A combination torch refuses raises ``ValueError`` with torch's reason.

    >>> order = torch_order("ZBVZeroBubble", p=2, m=4)          # doctest: +SKIP
    >>> stagewise.from_torch(order)                             # doctest: +SKIP
    """
    from torch.distributed.pipelining import schedules

    if read not in READS:
        raise ValueError(f"read must be one of {', '.join(READS)}, got {read!r}")
    klass = schedule_class(cls)
    single = issubclass(klass, schedules.PipelineScheduleSingle)
    v = (1 if single else 2) if v is None else v
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"torch_order needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    if single and v != 1:
        raise ValueError(f"{klass.__name__} holds one stage per rank: v must be 1, got {v}")
    try:
        if single:
            ranks = _single(klass, p, m, read)
        else:
            ranks = _multi(klass, p, m, v, read)
    except (ValueError, AssertionError, RuntimeError) as err:  # torch's own refusal of the combination
        raise ValueError(f"torch's {klass.__name__} does not build for p={p}, m={m}, v={v}: {err}") from None
    return TorchOrder(klass.__name__, m, ranks, read)


def _text(action: Any) -> str:
    return "" if action is None else str(action)


def _multi(klass: type, p: int, m: int, v: int, read: str) -> tuple[tuple[str, ...], ...]:
    """Built once, with rank 0's stand-ins: the constructor computes every rank's order from the counts."""
    built = klass([_StandIn(0, p, v, c * p) for c in range(v)], m)
    table = built.pipeline_order if read == "pipeline_order" else built.pipeline_order_with_comms
    return tuple(tuple(_text(a) for a in table[r]) for r in range(p))


def _single(klass: type, p: int, m: int, read: str) -> tuple[tuple[str, ...], ...]:
    if read == "pipeline_order":
        table = klass(_StandIn(0, p, 1, 0), m).pipeline_order
        return tuple(tuple(_text(a) for a in table[r]) for r in range(p))
    out = []
    for rank in range(p):  # each rank's loop, on its own stand-in
        stage = _StandIn(rank, p, 1, rank)
        built = klass(stage, m)
        built._initialize_stage = lambda *args, **kwargs: None  # shapes are never exchanged: nothing is sent
        built._step_microbatches()
        out.append(tuple(stage.done))
    return tuple(out)


class _StandIn:
    """What torch's schedule constructors and single-stage loops ask of a stage, and nothing else.

    Its point-to-point operations are empty lists (torch's batching returns at once for those), its
    forward and backward record their action text in :attr:`done`. The constructors compute every rank's
    stages from the counts and the rank, so the stand-ins' own indices (rank 0's, looped) are not read.
    """

    def __init__(self, rank: int, p: int, v: int, stage_index: int) -> None:
        import torch

        self.group_rank, self.group_size, self.num_stages = rank, p, p * v
        self.stage_index = stage_index
        self.is_first, self.is_last = stage_index == 0, stage_index == p * v - 1
        self.submod = torch.nn.Module()  # torch's compile check walks it
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.has_backward = True
        self.output_chunks: list[Any] = []
        self.done: list[str] = []

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.done.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> None:
        self.done.append(f"{self.stage_index}{'B' if full_backward else 'I'}{mb}")

    def backward_weight_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.done.append(f"{self.stage_index}W{mb}")

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> None:
        self.done.append(f"{self.stage_index}REDUCE_GRAD")

    def clear_runtime_states(self) -> None:
        pass

    def _no_ops(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = _no_ops
