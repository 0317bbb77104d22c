"""A recovery's re-layout: the new generation's stages take each tensor of the committed step from a live survivor
or from a snapshot file a survivor holds, over the new generation's world (never the old, dead groups).

Called on every process of the new world (the default group an in-place job made again for the generation),
each with its new pipeline (or None: it builds nothing) and what it kept of its old one (:func:`hold`: the
tensors only, by name; None for a newcomer):

1. *agreement*: one exchange of small records (:mod:`.sources`): the snapshot files each machine holds (by
   name), what each new stage needs, which live tensors still hold which snapshot's value; every process
   computes the same committed step, or refuses alike (:class:`LiveRefused`: the caller resumes from the
   snapshots instead);
2. the re-layout's own primitive (:func:`.primitive.relay`, as ``pipe.relayout``): its listing in keys, each
   survivor giving live only its tensors clean since the committed step's capture, the first process of each
   machine listing that step's files (:mod:`.snapfiles`: read and verified by whoever the plan gives them to; a
   damaged one refuses alike); the move in one global order; the fill (a tensor its own process held at the
   committed step is aliased, no copy);
3. the progress of the committed step from its files' headers (the dropout step and seed, the LR schedule);
   the snapshots' step and job name go on; then the commit point (every process filled).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import retention, state, storage
from ..checkpoint.declared import PipelineState
from ..checkpoint.manifest import CheckpointError, generation_of
from ..checkpoint.resume import resumed_line, step_of
from ..checkpoint.verify import META
from ..comm import groups, relayout_wire
from ..comm.faults.guard import Guard
from ..comm.generations import count_from, recorded
from ..comm.machine import agent_number
from ..elastic.folder import ended
from ..elastic.recover import needs_of
from ..elastic.snapshots import versions
from ..interrupt import note_checkpoint
from .fill import commit
from .primitive import Held as Held  # (re-exported: InPlace holds its survivors by it)
from .primitive import relay
from .snapfiles import Files, listed
from .sources import PARAM, Decision, clean_names, decide

log = logging.getLogger(__name__)

_calls = [0]  # take-overs on this process (advanced alike on every process): the guards' board names


class LiveRefused(Exception):
    """The live path cannot restore this state (the same reason on every process, before anything moved)."""


@dataclass
class Restored:
    """What a take-over restored: the committed step, and how many names came from which kind of source."""

    step: int
    counts: dict[str, int] = field(default_factory=dict)
    generation: int = 0  # the membership generation of the state restored (meta46)


def hold(old: nn.Module | None) -> Held | None:
    """The old pipeline's tensors and which of them are still a snapshot's (read before the pipeline goes)."""
    if not isinstance(old, PipelineState):
        return None
    tensors, meta = held_state(old)
    optim = {n: t for n, t in tensors.items() if n.startswith(state.OPTIM)}
    snap = old.snapshots
    live: dict[str, list[str]] = {}
    plain = all(type(t) is torch.Tensor for t in tensors.values())  # a DTensor shard is not moved live
    if snap is not None and plain and not old.merged_steps:
        saved = {state.MODEL + k: t for k, t in state.saved_tensors(old).items()}
        now = versions({**saved, **optim})
        for step, mark in snap.marks.items():
            here = dict(now)
            for name, copy in mark.copies.items():  # buffers: a forward may write them without a version
                if name not in saved or copy.shape != saved[name].shape or not torch.equal(copy, saved[name]):
                    here[name] = -1
            live[str(step)] = sorted(clean_names(mark.versions, here, list(meta["params"])))
    return Held(tensors, state.describe(tensors), meta, live, recorded())  # meta46: its generation


def hold_whole(old: Any, step: int) -> Held | None:
    """A live pipeline held as a survivor holds its own (``pipe.relayout``'s old state): every tensor clean at
    ``step``, the step it stands at (None: it holds no part)."""
    if not isinstance(old, PipelineState):
        return None
    tensors, meta = held_state(old)
    names = [n for n in tensors if n.startswith(state.MODEL)] + [PARAM + p for p in meta["params"]]
    return Held(tensors, state.describe(tensors), meta, {str(step): names})


def held_state(old: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What a process holds of its old layout, by one-process name (model tensors, its optimizers' state
    tensors), and its optimizers' metadata: what a re-layout and a take-over both move from."""
    if not isinstance(old, PipelineState):
        return {}, {"params": {}, "state": {}}
    assert isinstance(old, nn.Module)
    model = {state.MODEL + k: t.detach() for k, t in state.load_targets(old).items()}
    optim, meta = state.optimizer_state(state.optimizers_of(old, None), state.parameter_names(old))
    return {**model, **optim}, meta


def take_over(new: nn.Module | None, held: Held | None, checkpoints: Path | None, timeout: float) -> Restored:
    """See the module docstring; raises :class:`LiveRefused` alike on every process when the live path cannot."""
    me, world = groups.global_rank(), groups.world_size()
    _calls[0] += 1
    guard = Guard(f"takeover/{_calls[0]}", timeout, f"global rank {me}")
    exchange = relayout_wire.fresh_group(range(world), timeout, backend="gloo")  # meta46: the members' own group
    ranks = storage.Ranks(exchange, me, world, torch.device("cpu"), True, guard, timeout, True)
    done = False
    try:
        mine, copies = _record(new, held, checkpoints, me, world)
        everyone = storage.gather(mine, ranks, "every process's sources")
        layout = next((e["layout"] for e in everyone if e["layout"] is not None), None)
        decided = decide(everyone, layout, everyone[0]["disk"])
        if isinstance(decided, str):
            raise LiveRefused(decided)
        committed = [c for c in copies if (c["step"], c["lineage"]) == (decided.step, decided.lineage)]
        files = Files(mine["machine"], committed)
        try:
            relay(held, decided.step, new, ranks, {}, files)
        except CheckpointError as err:  # (refused alike: a file damaged since it was listed)
            raise LiveRefused(str(err)) from err
        if new is not None:
            _progress(new, decided)
        commit(ranks)
        done = True
    finally:
        ranks.close()
        relayout_wire.release(exchange) if done else relayout_wire.release_failed(exchange, timeout)  # meta46
    if new is not None:
        _said(new, decided, everyone, world)
    count_from(decided.generation)  # meta46: the states trained next count on from the one restored
    return Restored(decided.step, decided.counts(), decided.generation)


def _record(
    new: nn.Module | None, held: Held | None, checkpoints: Path | None, me: int, world: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This process's part of the agreement (plain JSON: names, no shapes nor optimizer metadata: those travel
    in the listing, between the processes a tensor moves between), and the snapshot files it lists."""
    snap = new.snapshots if isinstance(new, PipelineState) else None
    machine = snap.machines[snap.rank] if snap is not None else agent_number()
    first = snap is not None and snap.machines.index(machine) == snap.rank  # (its group ranks are the world's)
    folder = snap.folder if snap is not None else None
    copies: list[dict[str, Any]] = listed(folder, machine, me) if first and folder else []
    out: dict[str, Any] = {
        "machine": machine,
        "copies": [{k: v for k, v in c.items() if k not in ("dropout", "scheduler")} for c in copies],
        "ended": ended(folder) if first and folder else {},
        "need": None if new is None else sorted(needs_of(new)),
        "layout": None if new is None else state.layout_of(new, world),
        "live": {} if held is None else held.live,
        "disk": None,
        "held_in": 0 if held is None else held.generation,  # meta46
        "progress": {f"{c['step']}/{c['lineage']}": [c["dropout"], c["scheduler"]] for c in copies},
    }
    if me == 0 and checkpoints is not None:
        try:
            newest, _ = retention.choose(checkpoints)
            out["disk"] = None if newest is None else step_of(newest)
            out["disk_generation"] = generation_of(newest, META)  # meta46
        except CheckpointError as err:
            out["disk"] = 1 << 62  # refused here: the resume says why
            log.warning("stagewise: the checkpoints under %s: %s", checkpoints, err)
    return out, copies


def _progress(new: nn.Module, decided: Decision) -> None:
    """The committed step's progress, from the chosen source's report (the dropout step and seed, the LR
    schedule's place, as its files' headers say); the snapshots go on from that step, under the job's name."""
    dropout, scheduler = decided.progress
    state.restore_dropout(new, dropout)
    state.restore_scheduler(new, scheduler)  # lr_scheduler=: where the schedule was at the committed step
    snap = new.snapshots if isinstance(new, PipelineState) else None
    if snap is not None:
        snap.step, snap.job = decided.step, decided.job
        note_checkpoint(snap.folder, decided.step, loaded=True)


def _said(new: nn.Module, decided: Decision, everyone: list[dict[str, Any]], world: int) -> None:
    """The resume's one line, on the first process of every machine, with the sources counted."""
    snap = new.snapshots if isinstance(new, PipelineState) else None
    if snap is not None and snap.machines.index(snap.machines[snap.rank]) != snap.rank:
        return
    copies = (c for e in everyone for c in e["copies"])
    file = next(c for c in copies if (c["step"], c["lineage"]) == (decided.step, decided.lineage))
    c = decided.counts()
    how = f"from live tensors ({c['kept']} kept, {c['live']} moved) and peer snapshots ({c['snapshot']} tensors)"
    log.warning("stagewise: %s", resumed_line(decided.step, state.layout_of(new, world), file["layout"], how))
