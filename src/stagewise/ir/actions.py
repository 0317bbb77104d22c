"""Actions: the words every schedule is written in, and their text form."""

from __future__ import annotations

import enum
import functools
import re
from typing import NamedTuple


class Kind(str, enum.Enum):
    """What a rank does in one step of its action list.

    Roughly:
      F       run stage s forward on micro-batch i (the last stage also computes the loss)
      B       full backward of stage s for micro-batch i (input and weight gradients)
      I       backward for the stage's *inputs* only (what the previous stage waits for)
      W       backward for the stage's *weights* only (nobody waits for it: fills bubbles)
      SEND_F  post the send of stage s's output for micro-batch i to stage s+1's rank
      RECV_F  post the receive of stage s's input for micro-batch i from stage s-1's rank
      SEND_B  post the send of the gradient of stage s's input to stage s-1's rank
      RECV_B  post the receive of the gradient of stage s's output from stage s+1's rank
      SYNC    stage s's gradients are final: reduce them across replicas / tied copies
      STEP    apply the optimizer to stage s's parameters
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the paper's name for the input-gradient pass
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SYNC = "SYNC"
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE

    @property
    def is_comm(self) -> bool:
        return self in COMM

    @property
    def is_backward(self) -> bool:
        return self in BACKWARD


COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
BACKWARD = frozenset({Kind.B, Kind.I, Kind.W})
COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
#: kinds that concern a whole stage rather than one micro-batch
PER_STAGE = frozenset({Kind.SYNC, Kind.STEP})


class Action(NamedTuple):
    """One step of a rank's list: (stage, kind, micro-batch).

    The text form is ``{stage}{kind}{microbatch}``: ``2F0`` is stage 2's forward
    of micro-batch 0, ``1SEND_B3`` posts stage 1's input gradient of
    micro-batch 3, ``0SYNC`` reduces stage 0's gradients.
    """

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return self.__str__()


_KINDS_BY_LENGTH = sorted((k.value for k in Kind), key=len, reverse=True)
_ACTION_RE = re.compile(r"^\s*(\d+)(" + "|".join(_KINDS_BY_LENGTH) + r")(\d*)\s*$")


@functools.lru_cache(maxsize=1 << 14)
def parse_action(text: str) -> Action:
    """Parse the text form; ``parse_action(str(a)) == a`` for every action. Cached (an action is immutable): a
    step's timeline from every rank is parsed back each step the run is watched (0.2 ms of the watching rank's
    1.7 ms a step at 2 ranks, 2026-12-04)."""
    match = _ACTION_RE.match(text)
    if match is None:
        kinds = ", ".join(k.value for k in Kind)
        raise ValueError(
            f"cannot parse action {text!r}: expected STAGE KIND [MICROBATCH] such as "
            f"'2F0' or '1SEND_B3', with KIND one of {kinds}"
        )
    stage, kind_text, mb = match.groups()
    kind = Kind(kind_text)
    if kind in PER_STAGE:
        if mb:
            raise ValueError(f"action {text!r}: {kind.value} applies to a whole stage, not a micro-batch")
        return Action(int(stage), kind, None)
    if not mb:
        raise ValueError(f"action {text!r}: {kind.value} needs a micro-batch number, e.g. '{stage}{kind.value}0'")
    return Action(int(stage), kind, int(mb))
