"""An evaluation's inputs, checked where stage 0 runs and agreed on by every rank before anything is sent.

``eval_step`` takes a batch of any size (a test set, a DataLoader's short last batch), and only the rank holding
stage 0 must be given it. The shapes the stages exchange are learned once and then posted ahead (no metadata per
message), so a second evaluation of another size used to fail the pipeline for good, and so did inputs refused on
that rank (too few samples for the micro-batches, another structure than training's), though nothing had been
sent: the other ranks were already waiting for stage 0's output. Now that rank checks the inputs first and tells
the others, in one broadcast of a number, the batch size it will send or that it refused them. A refusal is then
raised alike on every rank and leaves the pipeline usable (:class:`Refused`); a size other than the last
evaluation's makes every rank learn the evaluation's shapes again.
"""

from __future__ import annotations

from typing import Any

import torch

from .microbatch import batch_size
from .run import RunRecord


class Refused(ValueError):
    """An evaluation's inputs refused on every rank alike before anything was sent: the pipeline stays usable."""


def agreed_record(runner: Any, inputs: Any, m: int) -> RunRecord:
    """This rank's record of the evaluation of ``inputs`` in ``m`` micro-batches, once every rank knows its size
    (``runner``: the :class:`~.runner.Runner`; its ``eval_size`` is the last evaluation's)."""
    first = runner.schedule.placement[0]
    record, refusal = None, None
    code = torch.zeros(1, dtype=torch.int64, device=runner.batches.device)
    if runner.rank == first:
        try:
            record = runner.batches.prepare("eval", [(inputs, None)], m)
            for part in runner.parts:
                check = getattr(part, "check_eval", None)  # (the inputs' structure against training's)
                if check is not None:
                    check(record)
            code[0] = batch_size(inputs, runner.batches.batch_dims[0])
        except ValueError as err:
            refusal, code[0] = err, -1
    if runner.schedule.num_ranks > 1:
        runner.transport.broadcast(code, first, f"the evaluation's batch size from rank {first}")
    size = int(code.item())
    if size < 0:
        words = _words(runner, first, refusal)
        if refusal is not None:
            raise Refused(str(refusal)) from refusal
        raise Refused(f"rank {first}, which holds stage 0, refused the inputs: {words}")
    if size != runner.eval_size:  # every rank alike: the shapes are learned again at a new size
        runner.interpreter.mailbox.forget_shapes("eval")
        runner.eval_size = size
    return record if record is not None else runner.batches.prepare("eval", [(inputs, None)], m)


#: the most bytes of a refusal the other ranks are told word for word (a longer one is cut there, and says so)
WORDS_BYTES = 1024
_CUT = " [... cut: rank {} raised the whole refusal]"


def _told(refusal: str, first: int) -> bytes:
    """``refusal``'s bytes as the other ranks are told them: whole, or cut to ``WORDS_BYTES`` saying where it is."""
    text = refusal.encode()
    if len(text) <= WORDS_BYTES:
        return text
    cut = _CUT.format(first).encode()
    return text[: WORDS_BYTES - len(cut)] + cut


def _words(runner: Any, first: int, refusal: ValueError | None) -> str:
    """The refusal's words on every rank: a second broadcast from ``first``, made only when it refused (every rank
    knows it from the size), so an evaluation that goes on costs one broadcast as before."""
    text = _told(str(refusal), first) if refusal is not None else b""
    data = torch.zeros(WORDS_BYTES + 8, dtype=torch.uint8, device=runner.batches.device)
    if refusal is not None:
        data[:8] = torch.tensor(list(len(text).to_bytes(8, "little")), dtype=torch.uint8)
        data[8 : 8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    if runner.schedule.num_ranks > 1:
        runner.transport.broadcast(data, first, f"the words of rank {first}'s refusal of the evaluation's inputs")
    got = data.cpu().numpy().tobytes()
    n = int.from_bytes(got[:8], "little")
    return got[8 : 8 + n].decode("utf-8", "replace")
