"""A recovery's re-layout: the new generation's stages take each tensor of the committed step from a live survivor
or from a snapshot file a survivor holds, over the new generation's world (never the old, dead groups).

Called on every process of the new world (the default group an in-place job made again for the generation),
each with its new pipeline (or None: it builds nothing) and what it kept of its old one (:func:`hold`: the
tensors only, by name; None for a newcomer):

1. *agreement*: one exchange of small records (:mod:`.sources`): the snapshot files each machine holds, what
   each new stage needs, which live tensors still hold which snapshot's value; every process computes the same
   sources, or refuses alike (:class:`LiveRefused`: the caller resumes from the snapshots instead);
2. *read*: each process reads and verifies the files it sends or uses itself; a damaged one refuses alike;
3. *move*: in one global order, a live tensor or a file's tensor is sent point-to-point and received in place;
   a tensor its own process held at the committed step is aliased, no copy;
4. *fill*: the model tensors, the optimizers' state, the dropout step and seed of the committed step; the
   snapshots' step and job name go on; then the commit point (every process filled).
"""

from __future__ import annotations

import logging
import os
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
from ..elastic.folder import ended, inventory
from ..elastic.recover import needs_of
from ..elastic.snapshot_file import SnapshotRefused, host_bytes, tensors_of, verified
from ..elastic.snapshot_file import generation_of as snapshot_generation
from ..elastic.snapshots import MACHINE_ENV, versions
from ..interrupt import note_checkpoint
from .fill import Move, commit, fill, post_moves
from .sources import PARAM, Decision, Take, clean_names, decide

log = logging.getLogger(__name__)

_calls = [0]  # take-overs on this process (advanced alike on every process): the guards' board names


class LiveRefused(Exception):
    """The live path cannot restore this state (the same reason on every process, before anything moved)."""


@dataclass
class Held:
    """What a survivor keeps of its old pipeline: its tensors by name (no groups, no threads), their
    descriptions, its optimizers' metadata, and per snapshot step the names still holding that step's value."""

    tensors: dict[str, torch.Tensor]
    described: dict[str, Any]
    optimizer: dict[str, Any]
    live: dict[str, list[str]]
    generation: int = 0  # the membership generation that trained them (meta46)


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
        everyone = storage.gather(_record(new, held, checkpoints, me, world), ranks, "every process's sources")
        layout = next((e["layout"] for e in everyone if e["layout"] is not None), None)
        decided = decide(everyone, layout, everyone[0]["disk"])
        if isinstance(decided, str):
            raise LiveRefused(decided)
        listed = {(c["machine"], c["path"]): c for e in everyone for c in e["copies"]}
        parts = _read(decided, me, listed)
        problems = [p for ps in storage.gather(parts[1], ranks, "every process's snapshot reads") for p in ps]
        if problems:
            raise LiveRefused("snapshot files refused: " + "; ".join(problems[:5]))
        values, record = _move(decided, everyone, listed, held, parts[0], new, ranks)
        if new is not None:
            _fill(new, values, record, decided, held, listed)
        commit(ranks)
        done = True
    finally:
        ranks.close()
        relayout_wire.release(exchange) if done else relayout_wire.release_failed(exchange, timeout)  # meta46
    if new is not None:
        _said(new, decided, listed, world)
    count_from(decided.generation)  # meta46: the states trained next count on from the one restored
    return Restored(decided.step, decided.counts(), decided.generation)


def _record(new: nn.Module | None, held: Held | None, checkpoints: Path | None, me: int, world: int) -> dict[str, Any]:
    """This process's part of the agreement (plain JSON)."""
    snap = new.snapshots if isinstance(new, PipelineState) else None
    machine = snap.machines[snap.rank] if snap is not None else os.environ.get(MACHINE_ENV, "0")
    first = snap is not None and snap.machines.index(machine) == snap.rank  # (its group ranks are the world's)
    folder = snap.folder if snap is not None else None
    out: dict[str, Any] = {
        "machine": machine,
        "copies": _listing(folder, machine, me) if first and folder else [],
        "ended": ended(folder) if first and folder else {},
        "need": None if new is None else sorted(needs_of(new)),
        "layout": None if new is None else state.layout_of(new, world),
        "live": {} if held is None else held.live,
        "described": {} if held is None else held.described,
        "optimizer": {"params": {}, "state": {}} if held is None else held.optimizer,
        "disk": None,
        "held_in": 0 if held is None else held.generation,  # meta46
    }
    if me == 0 and checkpoints is not None:
        try:
            newest, _ = retention.choose(checkpoints)
            out["disk"] = None if newest is None else step_of(newest)
            out["disk_generation"] = generation_of(newest, META)  # meta46
        except CheckpointError as err:
            out["disk"] = 1 << 62  # refused here: the resume says why
            log.warning("stagewise: the checkpoints under %s: %s", checkpoints, err)
    return out


def _listing(folder: Path, machine: str, rank: int) -> list[dict[str, Any]]:
    """This machine's snapshot files by header: what :mod:`.sources` chooses from, and what a receiver needs
    of each (its tensors' shapes, its optimizer's metadata, the dropout step)."""
    out = []
    for f in inventory(folder)[0]:
        h = f.header
        names = [*h["tensors"], *(PARAM + p for p in h["optimizer"]["params"])]
        fields = {k: h[k] for k in ("lineage", "step", "owner", "world", "layout", "tensors", "optimizer")}
        out.append({**fields, "machine": machine, "holder": rank, "path": str(f.path), "job": h.get("job", "")})
        out[-1].update(names=names, dropout=h.get("dropout"), scheduler=h.get("scheduler"))
        out[-1]["membership"] = snapshot_generation(h)  # meta46
    return out


def _read(decided: Decision, me: int, listed: dict[Any, Any]) -> tuple[dict[Any, dict[str, torch.Tensor]], list[str]]:
    """The files this process reads (to send, or for itself), verified against their digests and listing."""
    parts: dict[Any, dict[str, torch.Tensor]] = {}
    problems = []
    for key in decided.reads(me):
        said = listed[key]
        try:
            data = Path(key[1]).read_bytes()
            header, payload = verified(memoryview(data))
            if (header["lineage"], header["step"], header["owner"]) != (said["lineage"], said["step"], said["owner"]):
                raise SnapshotRefused("it was replaced since it was listed")
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else None
            parts[key] = tensors_of(header, host_bytes(raw) if raw is not None else memoryview(b""))
        except (OSError, SnapshotRefused) as err:
            problems.append(f"{key[1]} on machine {key[0]}: {err}")
    return parts, problems


def _expand(take: Take, everyone: list[Any], listed: dict[Any, Any]) -> tuple[list[str], dict[str, Any], Any]:
    """The tensor names a take carries (a ``param:`` need: that parameter's optimizer tensors), their
    descriptions, and the optimizer metadata of its source (None for a model tensor)."""
    if take.path is None:
        described, meta = everyone[take.src]["described"], everyone[take.src]["optimizer"]
    else:
        file = listed[(take.machine, take.path)]
        described, meta = file["tensors"], file["optimizer"]
    if not take.name.startswith(PARAM):
        return [take.name], described, None
    param = take.name[len(PARAM) :]
    entries = meta["state"].get(param, {})
    names = sorted(f"{state.OPTIM}{param}/{k}" for k, e in entries.items() if "tensor" in e)
    return names, described, {"params": meta["params"][param], "state": entries}


def _move(
    decided: Decision,
    everyone: list[Any],
    listed: dict[Any, Any],
    held: Held | None,
    parts: dict[Any, dict[str, torch.Tensor]],
    new: nn.Module | None,
    ranks: storage.Ranks,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every take in the one global order: sends and receives posted together; this process's values and the
    optimizer metadata of what it received."""
    targets = {} if new is None else {state.MODEL + k: t for k, t in state.load_targets(new, True).items()}
    me = ranks.rank
    values: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {"params": {}, "state": {}}
    moves: list[Move] = []
    shapes: dict[str, Any] = {}
    for take in decided.takes:
        if me not in (take.src, take.dst):
            continue
        names, described, meta = _expand(take, everyone, listed)
        source = parts.get((take.machine, take.path), {}) if take.path is not None else (held.tensors if held else {})
        if take.dst == me and meta is not None:
            record["params"][take.name[len(PARAM) :]] = meta["params"]
            if meta["state"]:
                record["state"][take.name[len(PARAM) :]] = meta["state"]
        for name in names:
            if not take.moves:
                values[name] = source[name]
            else:
                moves.append((name, take.src, take.dst, source))
                shapes[name] = described.get(name)
    guard = ranks.guard
    assert guard is not None
    values.update(post_moves(moves, me, targets, shapes.__getitem__, ranks.group, guard.wait))  # meta46: its group
    return values, record


def _fill(
    new: nn.Module,
    values: dict[str, torch.Tensor],
    record: dict[str, Any],
    decided: Decision,
    held: Held | None,
    listed: Any,
) -> None:
    """The new stages take their values (kept ones aliased), their optimizers' state and the committed step's
    progress; the snapshots go on from that step, under the job's name."""
    kept = _kept(decided.kept.get(groups.global_rank(), ()), held, values, record)
    targets = {state.MODEL + k: t for k, t in state.load_targets(new, True).items()}
    fill(new, targets, values, record, kept)
    file = next(c for c in listed.values() if (c["step"], c["lineage"]) == (decided.step, decided.lineage))
    state.restore_dropout(new, file["dropout"])
    state.restore_scheduler(new, file["scheduler"])  # lr_scheduler=: where the schedule was at the committed step
    snap = new.snapshots if isinstance(new, PipelineState) else None
    if snap is not None:
        snap.step, snap.job = decided.step, decided.job
        note_checkpoint(snap.folder, decided.step, loaded=True)


def _kept(names: Any, held: Held | None, values: dict[str, torch.Tensor], record: dict[str, Any]) -> dict[str, Any]:
    """This process's own live tensors at the committed step into ``values`` (and their optimizer metadata into
    ``record``); the model tensors among them, which the fill aliases."""
    kept = {}
    for name in names:
        assert held is not None
        if not name.startswith(PARAM):
            kept[name] = values[name] = held.tensors[name]
            continue
        param = name[len(PARAM) :]
        record["params"][param] = held.optimizer["params"][param]
        entries = held.optimizer["state"].get(param, {})
        if entries:
            record["state"][param] = entries
        for key in (k for k, e in entries.items() if "tensor" in e):
            values[f"{state.OPTIM}{param}/{key}"] = held.tensors[f"{state.OPTIM}{param}/{key}"]
    return kept


def _said(new: nn.Module, decided: Decision, listed: Any, world: int) -> None:
    """The resume's one line, on the first process of every machine, with the sources counted."""
    snap = new.snapshots if isinstance(new, PipelineState) else None
    if snap is not None and snap.machines.index(snap.machines[snap.rank]) != snap.rank:
        return
    file = next(c for c in listed.values() if (c["step"], c["lineage"]) == (decided.step, decided.lineage))
    c = decided.counts()
    how = f"from live tensors ({c['kept']} kept, {c['live']} moved) and peer snapshots ({c['snapshot']} tensors)"
    log.warning("stagewise: %s", resumed_line(decided.step, state.layout_of(new, world), file["layout"], how))
