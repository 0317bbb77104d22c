"""Which compute action feeds which: the data edges every pass, check and timer shares.

A *message* is the value that crosses a stage boundary, named by
``(direction, producer stage, micro-batch)``:

* ``("F", s, i)`` is stage s's output for micro-batch i, consumed by ``F`` of stage s+1;
* ``("B", s, i)`` is the gradient of stage s's input, made by ``B``/``I`` of stage s and
  consumed by ``B``/``I`` of stage s-1.
"""

from __future__ import annotations

from typing import NamedTuple

from .actions import Action, Kind


class Message(NamedTuple):
    direction: str  # "F" or "B"
    stage: int  # the producing stage
    microbatch: int


def consumes(a: Action, num_stages: int) -> Message | None:
    """The message compute action ``a`` needs from another stage, if any."""
    if a.kind is Kind.F:
        return Message("F", a.stage - 1, a.microbatch) if a.stage > 0 else None  # type: ignore[arg-type]
    if a.kind is Kind.B or a.kind is Kind.I:
        return Message("B", a.stage + 1, a.microbatch) if a.stage < num_stages - 1 else None  # type: ignore[arg-type]
    return None


def produces(a: Action, num_stages: int) -> Message | None:
    """The message compute action ``a`` makes for another stage, if any."""
    if a.kind is Kind.F:
        return Message("F", a.stage, a.microbatch) if a.stage < num_stages - 1 else None  # type: ignore[arg-type]
    if a.kind is Kind.B or a.kind is Kind.I:
        return Message("B", a.stage, a.microbatch) if a.stage > 0 else None  # type: ignore[arg-type]
    return None


def consumer_stage(msg: Message) -> int:
    return msg.stage + 1 if msg.direction == "F" else msg.stage - 1


def message_of(a: Action) -> Message:
    """The message a communication action moves (SEND_F s <-> RECV_F s+1, SEND_B s <-> RECV_B s-1)."""
    mb = a.microbatch
    assert mb is not None
    if a.kind is Kind.SEND_F:
        return Message("F", a.stage, mb)
    if a.kind is Kind.RECV_F:
        return Message("F", a.stage - 1, mb)
    if a.kind is Kind.SEND_B:
        return Message("B", a.stage, mb)
    if a.kind is Kind.RECV_B:
        return Message("B", a.stage + 1, mb)
    raise ValueError(f"{a} moves no message")
