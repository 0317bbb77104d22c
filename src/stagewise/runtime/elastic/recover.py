"""Resuming a pipeline with ``snapshot=``: the newest whole state among the machines' snapshots and the disk.

``sw.checkpoint.resume(root, pipe)`` on a pipeline with snapshots (a collective, like every resume) asks
:class:`PeerSnapshots`, one of its sources (:mod:`..checkpoint.resume`), beside the disk's checkpoints:

1. the first rank of each machine lists its machine's snapshot files (headers only, each checked against
   its digest); every rank says what it must load (its model tensors, its optimizers' parameters); all of
   it is gathered, and rank 0's choice of checkpoint on disk too;
2. every rank computes the same choice (:mod:`.choose`): the newest generation whose files, wherever they
   still are, cover every rank's needs - at any layout, since a tensor is found by its one-process name;
   it wins over the disk's newest checkpoint unless that one is newer;
3. each rank reads its files: its own machine's in place, the others' sent by the first rank of the machine
   holding them, in one global order (so the sends and receives pair up without a deadlock). Every file
   is checked against its digests where it is used; a damaged or replaced one is refused - every rank
   hears of it, and the choice is made again without it (an older generation, or the disk);
4. the shapes are checked against this layout's on every rank, and only when every rank agrees is
   anything written: parameters and buffers, the optimizers' state and hyper-parameters, and the
   generators' states when the layout is the one that saved (the states are per rank).

One line on the first rank of every machine says what happened (:func:`..checkpoint.resume.resumed_line`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..._util import VERSION
from ..checkpoint import state, storage
from ..checkpoint.declared import CheckpointInfo, Offer, PipelineState
from ..checkpoint.manifest import CheckpointError
from ..comm import snapshot_wire
from ..interrupt import note_checkpoint
from .choose import Choice, Copy, Need, choose, of_live_jobs
from .folder import ended, inventory, remove
from .snapshot_file import SnapshotRefused, generation_of, host_bytes, tensors_of, verified

log = logging.getLogger(__name__)

_PARAM = "param:"  # a name an inventory uses for "the optimizer state of this parameter"
_TRIES = 8  # choices made again after a refused file, at most


class Snapshotter(Protocol):
    """What a resume needs of :class:`.snapshots.Snapshotter` (which calls it)."""

    folder: Path
    group: Any
    timeout: float
    step: int
    job: str

    @property
    def machines(self) -> list[str]: ...


@dataclass
class Part:
    """A snapshot file this rank read and verified: its header and tensors."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class PeerSnapshots:
    """The snapshots in the machines' memory, as a resume's :class:`..checkpoint.declared.StateSource`
    (:func:`..checkpoint.resume.resume` chooses between them and the disk)."""

    def __init__(self, snap: Snapshotter, model: nn.Module) -> None:
        self.snap, self.model = snap, model
        self.copies: list[Copy] = []
        self.needs: list[Need] = []
        self.extras: dict[tuple[int, str, int], Any] = {}
        self.speaks = False

    def newest(self, ranks: storage.Ranks) -> Offer | None:
        """Step 1 and 2: every machine's files listed, every rank's needs, gathered; the same choice everywhere."""
        snap = self.snap
        machine = snap.machines[ranks.rank]
        first = snap.machines.index(machine) == ranks.rank
        self.speaks = first and not ranks.first  # the first rank of each other machine says the resume line too
        mine = {"copies": _listed(snap, machine, ranks.rank) if first else [], "need": sorted(needs_of(self.model))}
        mine["ended"] = ended(snap.folder) if first else {}
        everyone = storage.gather(mine, ranks, "every machine's snapshots", patient=True)
        finished = {job: step for e in everyone for job, step in e["ended"].items()}
        self.copies, stale = of_live_jobs([_copy(c) for e in everyone for c in e["copies"]], finished)
        _refuse_ended(stale, finished, machine if first else None, ranks.first)
        self.extras = {(c["step"], c["lineage"], c["owner"]): c["extra"] for e in everyone for c in e["copies"]}
        self.needs = [Need(r, snap.machines[r], frozenset(e["need"])) for r, e in enumerate(everyone)]
        choice = choose(self.copies, self.needs, state.layout_of(self.model, ranks.size), set())
        return None if choice is None else Offer(choice.step, choice, choice.membership)

    def restore(self, offer: Offer, floor: int) -> CheckpointInfo | None:
        """Steps 3 and 4; None when the files that survive verification hold nothing newer than ``floor``."""
        assert isinstance(self.model, PipelineState)
        ranks = storage.pipeline_ranks(self.model, self.snap.timeout)
        try:
            return _from_snapshots(self, offer.detail, ranks, floor)
        finally:
            ranks.close()

    def said(self, offer: Offer) -> str:
        return "from peer snapshots"

    def resumed(self, step: int, line: str) -> None:
        self.snap.step = step
        if self.speaks and line:  # rank 0 says it in resume; so every machine's log has it
            log.warning("stagewise: %s", line)


def _from_snapshots(source: PeerSnapshots, choice: Choice | None, ranks: storage.Ranks, floor: int) -> Any:
    """The state resumed from the snapshots, as a CheckpointInfo; None when what is left is not newer than
    ``floor`` (the disk's newest; a tie goes to the snapshots) or none fits."""
    snap, model = source.snap, source.model
    machine = snap.machines[ranks.rank]
    layout = state.layout_of(model, ranks.size)
    refused: set[tuple[str, str]] = set()
    for _ in range(_TRIES):
        if choice is None or choice.step < floor:
            return None
        parts, problems = _obtain(snap, choice, ranks.rank, machine)
        bad = [p for ps in storage.gather(problems, ranks, "every rank's snapshot reads") for p in ps]
        if not bad:
            break
        for m, path, why in bad:
            if ranks.first:
                log.warning("stagewise: refused snapshot %s on machine %s: %s", path, m, why)
            refused.add((m, path))
        choice = choose(source.copies, source.needs, layout, refused)
    else:
        raise CheckpointError(f"the peers' snapshots were refused {_TRIES} times in a row: see the log")
    assigned, problems = _assign(model, choice, parts[ranks.rank] if ranks.rank in parts else [])
    storage.agree(problems, ranks, f"the snapshot of step {choice.step} does not fit this model")
    mine = parts.get(ranks.rank, [])
    scheduler_restored = _apply(model, assigned, choice, mine)
    note_checkpoint(snap.folder, choice.step, loaded=True)
    extras = source.extras
    owners = sorted(o for (step, lineage, o) in extras if (step, lineage) == (choice.step, choice.lineage))
    extra = extras[(choice.step, choice.lineage, owners[0])]  # the lowest rank's whose file is still somewhere
    snap.job = choice.job  # the job goes on: its end will refuse these files too
    return CheckpointInfo(
        path=snap.folder,
        step=choice.step,
        extra=state.decode(extra),
        layout=choice.layout,
        versions={"stagewise": VERSION, "torch": torch.__version__},
        optimizer_restored=True,
        scheduler_restored=scheduler_restored,
        rng_restored=choice.rng,
        reason=f"peer snapshots: step {choice.step} (generation {choice.lineage}), newer than any checkpoint",
        scheduler_saved=bool(mine) and mine[0].header.get("scheduler") is not None,
    )


def _listed(snap: Snapshotter, machine: str, rank: int) -> list[dict[str, Any]]:
    """This machine's snapshot files as the inventory carries them (a header that fails its digest is left out)."""
    found, refused = inventory(snap.folder)
    for path, why in refused:
        log.warning("stagewise: refused snapshot %s on machine %s: %s", path, machine, why)
    out = []
    for f in found:
        h = f.header
        names = [*h["tensors"], *(_PARAM + p for p in h["optimizer"]["params"])]
        out.append(
            {
                "machine": machine,
                "holder": rank,
                "path": str(f.path),
                "lineage": h["lineage"],
                "job": h.get("job", ""),
                "step": h["step"],
                "owner": h["owner"],
                "world": h["world"],
                "layout": h["layout"],
                "names": names,
                "extra": h["extra"],
                "membership": generation_of(h),
            }
        )
    return out


def _refuse_ended(stale: dict[str, list[Copy]], finished: dict[str, int], machine: str | None, say: bool) -> None:
    """Snapshots of jobs that ended cleanly: said once (``say``), and removed from this machine's folder by its
    first rank (``machine``): nothing will ever resume from them."""
    for job, files in stale.items():
        steps = sorted({c.step for c in files})
        where = sorted({c.machine for c in files})
        if say:
            log.warning(
                "stagewise: refused the snapshots of step %s on machine %s: their job (%s) ended cleanly at step %d, "
                "so they are a finished job's, not this one's; removed",
                "/".join(map(str, steps)), ", ".join(where), job, finished[job],
            )  # fmt: skip
        if machine is not None:
            remove(Path(c.path) for c in files if c.machine == machine)


def _copy(listed: dict[str, Any]) -> Copy:
    fields = {k: v for k, v in listed.items() if k != "extra"}
    return Copy(**{**fields, "names": frozenset(fields["names"])})


def needs_of(model: nn.Module) -> set[str]:
    """What this rank loads: its model tensors (tied copies included) and the parameters its optimizers hold."""
    out = {state.MODEL + k for k in state.load_targets(model)}
    names = state.parameter_names(model)
    for opt in state.optimizers_of(model, None):
        for group in opt.param_groups:
            out |= {_PARAM + names[id(p)] for p in group["params"]}
    return out


def _obtain(snap: Snapshotter, choice: Choice, me: int, machine: str) -> tuple[dict[int, list[Part]], list[Any]]:
    """This rank's files of the choice (read here, or received), verified; and the problems found."""
    problems: list[Any] = []
    got: dict[tuple[str, str], Part] = {}
    for holder, receiver, c in choice.transfers:
        if me == holder:
            snapshot_wire.send_bytes(_read(Path(c.path)), receiver, snap.group, snap.timeout)
        if me == receiver:
            data = snapshot_wire.recv_bytes(holder, snap.group, snap.timeout)
            _check(c, None if data is None else host_bytes(data), got, problems)
    for c in choice.reads.get(me, []):
        if c.machine == machine:
            raw = _read(Path(c.path))
            _check(c, None if raw is None else host_bytes(raw), got, problems)
    mine = [got[(c.machine, c.path)] for c in choice.reads.get(me, []) if (c.machine, c.path) in got]
    return {me: mine}, problems


def _read(path: Path) -> torch.Tensor | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _check(c: Copy, data: memoryview | None, got: dict[tuple[str, str], Part], problems: list[Any]) -> None:
    """Verify one file's bytes against its digests and against what the inventory said it was."""
    try:
        if data is None:
            raise SnapshotRefused("it is gone")
        header, payload = verified(data)
        said = (c.lineage, c.step, c.owner, c.membership)  # a step redone by a later generation is another file
        now = (header["lineage"], header["step"], header["owner"], generation_of(header))
        if now != said:
            raise SnapshotRefused(
                f"it was replaced since it was listed (now step {now[1]} of generation {now[3]}, "
                f"was step {c.step} of generation {c.membership})"
            )
        got[(c.machine, c.path)] = Part(header, tensors_of(header, payload))
    except SnapshotRefused as err:
        problems.append([c.machine, c.path, str(err)])


def _assign(model: nn.Module, choice: Choice, parts: list[Part]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each tensor this rank loads, from the first of its files that has it; shape and dtype checked."""
    problems = []
    assigned: dict[str, torch.Tensor] = {}
    targets = {state.MODEL + k: v for k, v in state.load_targets(model).items()}
    for name, target in targets.items():
        src = next((p.tensors[name] for p in parts if name in p.tensors), None)
        if src is None:
            problems.append(f"{name!r} is in no snapshot this rank received")
        elif tuple(src.shape) != tuple(target.shape) or src.dtype != target.dtype:
            problems.append(
                f"{name!r} is {tuple(src.shape)} {src.dtype} in the snapshot, {tuple(target.shape)} {target.dtype} here"
            )
        else:
            assigned[name] = src
    return assigned, problems


@torch.no_grad()
def _apply(model: nn.Module, assigned: dict[str, torch.Tensor], choice: Choice, parts: list[Part]) -> bool:
    """Write the model's tensors, the optimizers' state and (same layout) the generators' states; whether the
    pipeline's schedulers (``lr_scheduler=``) took the saved one's position."""
    targets = {state.MODEL + k: v for k, v in state.load_targets(model).items()}
    for name, src in assigned.items():
        targets[name].copy_(src)
    names = state.parameter_names(model)
    optimizers = state.optimizers_of(model, None)
    record: dict[str, Any] = {"optimizer": {"params": {}, "state": {}}}
    tensors: dict[str, torch.Tensor] = {}
    wanted = {n[len(_PARAM) :] for n in needs_of(model) if n.startswith(_PARAM)}
    for param in wanted:
        part = next(p for p in parts if param in p.header["optimizer"]["params"])
        meta = part.header["optimizer"]
        record["optimizer"]["params"][param] = meta["params"][param]
        if param in meta["state"]:
            record["optimizer"]["state"][param] = meta["state"][param]
            for key in meta["state"][param]:
                full = f"{state.OPTIM}{param}/{key}"
                if full in part.tensors:
                    tensors[full] = part.tensors[full]
    if optimizers:
        state.restore_optimizers(optimizers, names, record, tensors)
    if choice.rng:
        state.set_rng_state(parts[0].header["rng"])  # its own file comes first (see .choose)
    state.restore_dropout(model, parts[0].header.get("dropout"))  # any layout: the masks' step and seed
    return state.restore_scheduler(model, parts[0].header.get("scheduler"))  # lr_scheduler=: where it was
