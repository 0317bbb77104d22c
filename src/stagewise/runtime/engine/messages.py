"""Values between stages on different ranks: shapes learned on the first step, then cached and checked.

A message (see :mod:`stagewise.ir.dataflow`) carries a nested value: its tensors
travel point-to-point, its containers and constants travel once, in the
*meta*.

The first time a message goes by (in a mode, "train" or "eval"; both ends
know it is the first time), the receiver cannot post its receive early: it
does not know the shapes. So the sender posts the meta's length, the meta
(JSON) and the data *eagerly*, on their own tags, and the receiver takes them
when the consuming action needs them. Eager sends never wait for a batch, so
nothing can deadlock while shapes are being learned (no rank blocks before it
has posted what others need). From then on both ends keep the meta: the
receiver posts its receive as early as the schedule says, into buffers made
from it, and the sender checks each value against it. A mismatch would make the
receive hang or corrupt data, so the sender raises (and posts) an error that
names the stage, the tensor and both shapes instead.

With ``variable_shapes`` every value travels the first-time way, meta and
all, so each micro-batch of each step may have shapes of its own (packed or
variable-length sequences) at the cost of two small extra messages per value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...ir import Message, consumer_stage
from ..comm.collectives import decode, encode
from ..comm.faults.waiters import Watch
from ..comm.transport.protocol import Op, Transport, check_tag
from ..errors import PipelineError
from .tree import Spec, flatten, leaf_paths, same_spec, spec_difference, spec_from_plain, spec_to_plain, unflatten


@dataclass(frozen=True)
class Meta:
    """What a receiver needs to rebuild a value: its spec and each tensor's shape and dtype."""

    spec: Spec
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    requires_grad: tuple[bool, ...] = ()  # per tensor: whether the receiving stage differentiates it

    @classmethod
    def of(cls, value: Any) -> tuple[Meta, list[torch.Tensor]]:
        leaves, spec = flatten(value)
        grads = tuple(t.requires_grad for t in leaves)
        return cls(spec, tuple(tuple(t.shape) for t in leaves), tuple(t.dtype for t in leaves), grads), leaves

    def to_bytes(self, where: str) -> bytes:
        """JSON, not a pickle: a peer's bytes are parsed as plain data only."""
        plain = {
            "spec": spec_to_plain(self.spec, where),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": [_dtype(d) for d in self.dtypes],
            "grads": list(self.requires_grad),
        }
        return encode(plain)

    @classmethod
    def from_bytes(cls, blob: bytes) -> Meta:
        data = decode(blob)
        dtypes = tuple(getattr(torch, name) for name in data["dtypes"])
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError(f"a peer sent unknown dtypes {data['dtypes']}")
        shapes = tuple(tuple(int(n) for n in s) for s in data["shapes"])
        return cls(spec_from_plain(data["spec"]), shapes, dtypes, tuple(bool(g) for g in data["grads"]))

    def rebuild(self, buffers: list[torch.Tensor]) -> Any:
        """The value from received buffers, flagged ``requires_grad`` as the sender's tensors were."""
        for b, flag in zip(buffers, self.requires_grad):
            if flag:
                b.requires_grad_(True)
        return unflatten(self.spec, buffers)


@dataclass
class Pending:
    """A receive: posted (``meta`` known, ``works`` running) or, on a first exchange, deferred (``meta`` None)."""

    msg: Message
    peer: int
    mode: str
    meta: Meta | None
    buffers: list[torch.Tensor]
    works: list[Any]
    watch: Watch | None = None  # a helper already waiting for the works (see Transport.watch)


def describe(msg: Message) -> str:
    what = "output" if msg.direction == "F" else "input gradient"
    return f"stage {msg.stage}'s {what} for micro-batch {msg.microbatch}"


# what travels under a message's tags
_DATA, _META_LEN, _META = range(3)


class Mailbox:
    """Turns a batch of outgoing values and expected messages into point-to-point ops, for one rank."""

    def __init__(
        self,
        transport: Transport,
        placement: tuple[int, ...],
        num_microbatches: int,
        device: torch.device,
        *,
        variable_shapes: bool = False,
    ) -> None:
        self.transport = transport
        self.variable_shapes = variable_shapes
        self.placement = placement
        self.num_microbatches = num_microbatches
        self.device = device
        self._known: dict[tuple[str, Message], Meta] = {}
        check_tag(self.tag(Message("B", len(placement) - 1, num_microbatches - 1), _META))

    def tag(self, msg: Message, what: int = _DATA) -> int:
        """The message's own tag: no two values in flight between two ranks share one."""
        index = ((msg.direction == "B") * len(self.placement) + msg.stage) * self.num_microbatches + msg.microbatch
        return index * 4 + what

    def knows(self, msg: Message, mode: str) -> bool:
        """Whether ``msg``'s shapes are known in ``mode``, so its receive can be posted before it is needed."""
        return not self.variable_shapes and (mode, msg) in self._known

    def forget_shapes(self, mode: str | None = None) -> None:
        """Drop every cached meta (only ``mode``'s: ``"train"`` or ``"eval"``); the next step exchanges shapes
        again (call on all ranks)."""
        for key in [k for k in self._known if mode is None or k[0] == mode]:
            del self._known[key]

    def batch(
        self, sends: list[tuple[Message, Any]], recvs: list[Message], mode: str
    ) -> tuple[list[Op], list[Pending]]:
        """The ops of one batch whose shapes are known, and a Pending per receive.

        Values sent for the first time are posted eagerly here, with their meta.
        """
        ops: list[Op] = []
        for msg, value in sends:
            meta, leaves = Meta.of(value)
            peer = self.placement[consumer_stage(msg)]
            known = None if self.variable_shapes else self._known.get((mode, msg))
            if known is None:
                if not self.variable_shapes:
                    self._known[(mode, msg)] = meta
                self._send_first(msg, peer, meta, leaves)
                continue
            self._check(msg, known, meta)
            ops += [Op(peer, t.detach().contiguous(), send=True, tag=self.tag(msg), key=msg) for t in leaves]
        pendings = []
        for msg in recvs:
            peer = self.placement[msg.stage]
            expected = None if self.variable_shapes else self._known.get((mode, msg))
            if expected is None:
                pendings.append(Pending(msg, peer, mode, None, [], []))
                continue
            shapes = zip(expected.shapes, expected.dtypes)
            buffers = [torch.empty(sh, dtype=dt, device=self.device) for sh, dt in shapes]
            ops += [Op(peer, b, send=False, tag=self.tag(msg), key=msg) for b in buffers]
            pendings.append(Pending(msg, peer, mode, expected, buffers, []))
        return ops, pendings

    def receive(self, pending: Pending) -> Any:
        """Wait for a received value (taking a deferred one, meta first) and rebuild it."""
        what = f"{describe(pending.msg)} from rank {pending.peer}"
        if pending.meta is not None:
            self.transport.wait(pending.works, what, watch=pending.watch)
            return pending.meta.rebuild(pending.buffers)
        meta = self._take_meta(pending, what)
        if not self.variable_shapes:
            self._known[(pending.mode, pending.msg)] = meta
        cpu = [torch.empty(sh, dtype=dt) for sh, dt in zip(meta.shapes, meta.dtypes)]
        self._eager(pending.peer, cpu, self.tag(pending.msg), what)
        return meta.rebuild([b.to(self.device) for b in cpu])

    def _send_first(self, msg: Message, peer: int, meta: Meta, leaves: list[torch.Tensor]) -> None:
        try:
            blob = meta.to_bytes("output" if msg.direction == "F" else "input_grad")
        except TypeError as err:
            raise PipelineError(
                self.transport.guard.fail(f"rank {self.transport.rank}: stage {msg.stage}: {err}")
            ) from err
        ops = [
            Op(peer, torch.tensor([len(blob)], dtype=torch.int64), send=True, tag=self.tag(msg, _META_LEN)),
            Op(peer, torch.frombuffer(bytearray(blob), dtype=torch.uint8), send=True, tag=self.tag(msg, _META)),
        ]
        ops += [Op(peer, t.detach().to("cpu").contiguous(), send=True, tag=self.tag(msg)) for t in leaves]
        self.transport.post_eager(ops)

    def _take_meta(self, pending: Pending, what: str) -> Meta:
        length = torch.empty(1, dtype=torch.int64)
        self._eager(pending.peer, [length], self.tag(pending.msg, _META_LEN), f"the shapes of {what}")
        blob = torch.empty(int(length.item()), dtype=torch.uint8)
        self._eager(pending.peer, [blob], self.tag(pending.msg, _META), f"the shapes of {what}")
        return Meta.from_bytes(blob.numpy().tobytes())

    def _eager(self, peer: int, buffers: list[torch.Tensor], tag: int, what: str) -> None:
        works = self.transport.post_eager([Op(peer, b, send=False, tag=tag) for b in buffers])
        self.transport.wait(works, what, eager=True)

    def _check(self, msg: Message, known: Meta, meta: Meta) -> None:
        to = f"to stage {consumer_stage(msg)}"
        root = "output" if msg.direction == "F" else "input_grad"
        problem = None
        if not same_spec(known.spec, meta.spec):
            problem = (
                f"stage {msg.stage} sent a value {to} for micro-batch {msg.microbatch} whose structure or "
                f"non-tensor values changed since the first step: {spec_difference(meta.spec, known.spec, root)} "
                f"({_brief(meta.spec)}, expected {_brief(known.spec)}); they are fixed after the first step: give "
                "every step inputs of one form (the same optional inputs, e.g. always or never position_ids), or "
                "call Pipeline.reset_shapes() on every rank to change it"
            )
        else:
            names = leaf_paths(meta.spec, root)
            for name, s_new, s_old, d_new, d_old in zip(names, meta.shapes, known.shapes, meta.dtypes, known.dtypes):
                if s_new != s_old or d_new != d_old:
                    rows = d_new == d_old and len(s_new) == len(s_old) > 0 and s_new[1:] == s_old[1:]
                    problem = (
                        f"stage {msg.stage} sent {name} of shape {s_new} ({_dtype(d_new)}) {to} for micro-batch "
                        f"{msg.microbatch}, expected shape {s_old} ({_dtype(d_old)}) as on the first step; "
                        + (_ROWS if rows else "")
                        + "shapes are fixed after the first step: build the pipeline with variable_shapes=True to "
                        "let every step have its own, or call Pipeline.reset_shapes() on every rank before a step "
                        "whose shapes change"
                    )
                    break
        if problem is not None:
            raise PipelineError(self.transport.guard.fail(f"rank {self.transport.rank}: {problem}"))


#: the words for a value whose first dimension alone changed: most often a data loader's last batch
_ROWS = (
    "this step's batch has another size (a DataLoader's short last batch? DataLoader(..., drop_last=True) keeps "
    "every batch whole); "
)


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _brief(spec: Spec) -> str:
    text = repr(spec)
    return text if len(text) <= 120 else text[:117] + "..."
