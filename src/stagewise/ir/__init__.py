"""The intermediate representation: actions, schedules (per-rank action lists), their array form, timelines.

A schedule is data: for each rank, the ordered tuple of :class:`Action` values it
executes. Everything else in stagewise reads or writes this form:

* :mod:`.actions`: the action kinds and their text form (``2F0``, ``1SEND_B3``);
* :mod:`.schedule`: :class:`Schedule` and the stage placements;
* :mod:`.columns`: the same actions as integer columns (kind, stage, micro-batch), with the
  integer kind codes (``F``, ``B``, ... ``STEP``) the array paths compute with;
* :mod:`.dataflow`: which value each action makes and needs (the messages between ranks);
* :mod:`.timeline`: what ran where and when, simulated or measured.
"""

from .actions import COMM, COMPUTE, Action, Kind, parse_action
from .columns import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    STEP,
    SYNC,
    ActionRows,
    B,
    Columns,
    F,
    I,
    W,
    columns,
    from_rows,
    in_range,
    insert_after_last,
)
from .dataflow import Message, consumer_stage, consumes, message_of, produces
from .schedule import Schedule, boundary_crossings, loop_placement, v_placement
from .timeline import Event, Timeline

__all__ = [
    "B",
    "COMM",
    "COMPUTE",
    "F",
    "I",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "STEP",
    "SYNC",
    "W",
    "Action",
    "ActionRows",
    "Columns",
    "Event",
    "Kind",
    "Message",
    "Schedule",
    "Timeline",
    "boundary_crossings",
    "columns",
    "consumer_stage",
    "consumes",
    "from_rows",
    "in_range",
    "insert_after_last",
    "loop_placement",
    "message_of",
    "parse_action",
    "produces",
    "v_placement",
]
