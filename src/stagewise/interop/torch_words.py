"""torch.distributed.pipelining's action words, read into stagewise's and written back.

torch writes an action as stagewise does, ``{stage}{kind}{micro-batch}`` (``2F0``, ``1SEND_B3``), with a few
kinds of its own. Read (torch -> stagewise):

    F B I W SEND_F RECV_F SEND_B RECV_B   the same action
    REDUCE_GRAD                           SYNC: the stage's gradients are final (torch scales and reduces them)
    (0F3;3B1)OVERLAP_F_B                  its sub-actions, in order: 0F3 then 3B1 (torch runs them so, one
                                          after the other, unless a custom function overlaps them)
    UNSHARD RESHARD                       not an action: kept beside the schedule as an annotation (FSDP's
                                          all-gather and free of a stage's parameters; stagewise's sharding
                                          does its own)
    an empty cell, None                   a bubble in torch's table: nothing

Written (stagewise -> torch): the same words; SYNC as REDUCE_GRAD where torch's format takes it (its
``compute_comms`` CSV; its ``compute_only`` loader adds its own); STEP never (torch steps the optimizer after
``step()``, outside the schedule).

Pure: a torch action is read by duck typing (``stage_index``, ``computation_type``, ``microbatch_index``,
``sub_actions``) or from its text, so torch is never imported here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..ir import Action, Kind

#: torch's kinds that are stagewise kinds of the same name and meaning
SAME = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: torch's kinds kept beside the schedule, not as actions
ANNOTATIONS = ("UNSHARD", "RESHARD")
#: every word read: torch's, plus stagewise's SYNC and STEP (so stagewise's own CSV reads too)
KNOWN = (*SAME, "REDUCE_GRAD", "OVERLAP_F_B", *ANNOTATIONS, "SYNC", "STEP")

_WORDS = "|".join(sorted(KNOWN, key=len, reverse=True))
_PLAIN = re.compile(rf"^(\d+)({_WORDS})(\d*)$")
_GROUP = re.compile(r"^\((.*)\)(\w+)$")
_PER_STAGE = ("REDUCE_GRAD", "SYNC", "STEP", *ANNOTATIONS)


@dataclass(frozen=True)
class Read:
    """One torch action read: the stagewise actions it stands for, or an annotation's text."""

    actions: tuple[Action, ...] = ()
    annotation: str | None = None


def read_action(item: object, where: str = "") -> Read:
    """One cell of torch's order: a torch ``_Action`` (or any object with its fields), its text, or None.

    ``where`` ("rank 1, position 4") prefixes the error for a word stagewise does not know.
    """
    if item is None:
        return Read()
    if isinstance(item, str):
        return _read_text(item.strip(), where)
    kind = getattr(item, "computation_type", None)
    if kind is None:
        raise TypeError(f"{where}: expected a torch action (with computation_type) or its text, got {item!r}")
    word = str(getattr(kind, "value", kind))
    subs = getattr(item, "sub_actions", None)
    if word == "OVERLAP_F_B" or subs is not None:
        return Read(tuple(a for sub in subs or () for a in read_action(sub, where).actions))
    stage = int(getattr(item, "stage_index"))  # noqa: B009 - a duck-typed torch _Action
    return _action(word, stage, getattr(item, "microbatch_index", None), f"{where}: {item}")


def _read_text(text: str, where: str) -> Read:
    if not text:
        return Read()
    group = _GROUP.match(text)
    if group is not None:
        inner, word = group.groups()
        if word != "OVERLAP_F_B":
            raise ValueError(f"{where}: {text!r}: only OVERLAP_F_B groups actions, got {word}")
        return Read(tuple(a for part in inner.split(";") for a in _read_text(part.strip(), where).actions))
    plain = _PLAIN.match(text)
    if plain is None:
        raise ValueError(
            f"{where}: cannot read torch action {text!r}: expected STAGE KIND [MICRO-BATCH] with KIND one of "
            f"{', '.join(KNOWN)}, or (A;B)OVERLAP_F_B"
        )
    stage, word, mb = plain.groups()
    return _action(word, int(stage), int(mb) if mb else None, f"{where}: {text!r}")


def _action(word: str, stage: int, mb: int | None, where: str) -> Read:
    if word in _PER_STAGE and mb is not None:
        raise ValueError(f"{where}: {word} applies to a whole stage, not micro-batch {mb}")
    if word in ANNOTATIONS:
        return Read(annotation=f"{stage}{word}")
    if word in _PER_STAGE:
        return Read((Action(stage, Kind.STEP if word == "STEP" else Kind.SYNC),))
    if word not in SAME:
        raise ValueError(f"{where}: stagewise does not read torch's {word!r} (it reads {', '.join(KNOWN)})")
    if mb is None:
        raise ValueError(f"{where}: {word} needs a micro-batch number")
    return Read((Action(stage, Kind(word), mb),))


def write_actions(actions: tuple[Action, ...], *, comms: bool) -> Iterator[str]:
    """A rank's actions as torch's cells: compute only (``comms`` False) or with communication and REDUCE_GRAD."""
    for a in actions:
        if a.kind is Kind.STEP or (not comms and not a.kind.is_compute):
            continue
        yield f"{a.stage}REDUCE_GRAD" if a.kind is Kind.SYNC else str(a)
