"""Part 4's listing: who holds and who needs each tensor, told in keys to all and in names only where it moves.

Three exchanges, every process taking part in each, before any tensor moves:

1. every process's four key lists (:mod:`.keys`: 8 bytes a model tensor or an optimizer unit), gathered;
2. a small gather: the model tensors each process needs that no process holds (by name, from the process that
   needs them: so every process refuses the same bad request with the same reason), the bytes each will send,
   and each member's new stages and layout (what :class:`~.layout.Layout` reports);
3. point to point, between the pairs a tensor moves between only: the sender's names, shapes and dtypes of what
   it sends, and the optimizer metadata (hyper-parameters, non-tensor state) of each unit it sends; the receiver
   checks every name against the one it needs.

A tensor no process holds live comes from a snapshot file a process listed (``files``, :mod:`.snapfiles`: the
first process of each machine lists its files' keys in one more small gather before the plan): read by its
lister and sent as a live tensor is (kept when the lister is the receiver); a damaged file is refused alike in
step 2.

What this replaces: every process's JSON listing (names, shapes, optimizer metadata) all-gathered, padded to the
longest: processes x (processes + 1) x the longest listing held at once on every process, a retiring one too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint import state, storage
from ..comm import collectives, relayout_wire
from . import keys as K
from .snapfiles import Files, filed
from .transfers import Move, Transfers


@dataclass(frozen=True)
class Listing:
    """This process's part of the move: its transfers (its own moves, in the one order its peers use), the shape
    and dtype of each tensor it receives, the optimizer metadata of the parameters its new stages hold, the
    tensors its new stages fill, every process's row of step 2 and the bytes the whole move carries."""

    transfers: Transfers
    described: dict[str, Any]
    record: dict[str, Any]
    targets: dict[str, torch.Tensor | None]
    everyone: list[dict[str, Any]]
    bytes_moved: int
    read: dict[str, torch.Tensor] = field(default_factory=dict)  # what it read from a file for itself
    sending: dict[tuple[str, int], Mapping[str, torch.Tensor]] = field(default_factory=dict)  # a file's, to send

    def source(self, name: str, dst: int, held: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Where this process reads ``name`` it sends to ``dst``: a file it read, else its live tensors."""
        return self.sending.get((name, dst), held)


@dataclass(frozen=True)
class _Mine:
    """This process's side: what it holds (tensors, optimizer metadata), the tensors its new stages fill, and the
    names behind its keys (one dict key -> name per list of :data:`.keys.LISTS`)."""

    held: Mapping[str, torch.Tensor]
    optim: Mapping[str, Any]
    targets: dict[str, torch.Tensor | None]
    names: tuple[dict[int, str], ...]
    files: Files | None = None

    def name(self, item: K.Item, needed: bool) -> str:
        kind, key = item
        return self.names[kind + (2 if needed else 0)][key]

    def entries(self, unit: str) -> dict[str, Any]:
        return self.optim["state"].get(unit, {})

    def source(self, plan: K.Plan, item: K.Item, dst: int) -> tuple[Mapping[str, torch.Tensor], Mapping[str, Any], str]:
        """Where this process reads ``item`` for ``dst``: its live tensors, or the file the plan gave it (the
        tensors, the optimizers' metadata and the item's name there)."""
        path = plan.filed.get((dst, item))
        if path is None:
            return self.held, self.optim, self.name(item, False)
        assert self.files is not None
        read = self.files.read[path]
        return read.tensors, read.optim, read.names[item[0]][item[1]]


def exchange(
    held: Mapping[str, torch.Tensor],
    optim: Mapping[str, Any],
    new: nn.Module | None,
    ranks: storage.Ranks,
    row: dict[str, Any],
    files: Files | None = None,
) -> Listing:
    """See the module docstring. ``held``/``optim``: this process's tensors and optimizer metadata under the old
    layout (those it may give live); ``new``: its new stages (None: it holds none); ``row``: its new stages and
    layout, for everyone; ``files``: its snapshot files (None alike on every process: no file is a source)."""
    mine = _mine(held, optim, new, files)
    keys = [K.unpack(flat) for flat in _gather_keys(mine, ranks)]
    if files is None:
        plan = K.plan(keys, ranks.rank)
    else:
        plan = K.plan(keys, ranks.rank, *filed(storage.gather(files.row(), ranks, "every process's snapshot files")))
    lost = sorted(mine.name(item, True) for item in plan.lost)
    where = "no process holds" if files is None else "no process holds live and no snapshot file holds"
    missing = [f"process {ranks.rank} needs {', '.join(lost[:5])} that {where}"] if lost else []
    missing += [] if files is None else files.take(plan.filed.values())
    sent = 0 if missing else sum(_nbytes(mine, plan, item, dst) for dst, items in plan.sends.items() for item in items)
    everyone = storage.gather({**row, "missing": missing, "sent": sent}, ranks, "the tensors needed")
    storage.refuse_alike(
        [e["missing"] for e in everyone], "relayout: the new layout needs tensors the old one does not have"
    )
    told = _tell(mine, plan, ranks)
    transfers, described, record = _assemble(mine, plan, told, ranks.rank)
    read, sending = _from_files(mine, plan, record, ranks.rank)
    targets = dict(mine.targets)
    targets.update({n: None for unit, entries in record["state"].items() for n in unit_tensors(unit, entries)})
    moved = sum(e["sent"] for e in everyone)
    return Listing(transfers, described, record, targets, everyone, moved, read, sending)


def unit_tensors(unit: str, entries: Mapping[str, Any]) -> list[str]:
    """The names of a parameter's optimizer state tensors (``optim/NAME/KEY``), from its state entries."""
    return [f"{state.OPTIM}{unit}/{k}" for k, e in sorted(entries.items()) if "tensor" in e]


def _mine(
    held: Mapping[str, torch.Tensor], optim: Mapping[str, Any], new: nn.Module | None, files: Files | None
) -> _Mine:
    """This process's four lists, keyed; a key standing for two names on this process is refused."""
    targets: dict[str, torch.Tensor | None] = {}
    units: list[str] = []
    if new is not None:
        targets = {state.MODEL + k: t for k, t in state.load_targets(new, True).items()}
        names = state.parameter_names(new)
        units = [names[id(p)] for o in state.optimizers_of(new, None) for g in o.param_groups for p in g["params"]]
    model = [n for n in held if not n.startswith(state.OPTIM)]
    lists: tuple[dict[int, str], ...] = (K.keyed(model, "tensors"), K.keyed(optim["params"], "parameters"))
    lists += (K.keyed(targets, "tensors"), K.keyed(units, "parameters"))
    for a, b in ((0, 2), (1, 3)):
        for k in lists[a].keys() & lists[b].keys():
            if lists[a][k] != lists[b][k]:
                raise ValueError(f"relayout: {lists[a][k]!r} and {lists[b][k]!r} share a 64-bit key; rename one")
    return _Mine(held, optim, targets, lists, files)


def _gather_keys(mine: _Mine, ranks: storage.Ranks) -> list[list[int]]:
    """Every process's packed key lists (one all-gather of int64s, padded to the longest)."""
    flat = K.pack([list(names) for names in mine.names])
    if not ranks.distributed:
        return [flat]
    guard = ranks.guard
    assert guard is not None
    data = torch.tensor(flat, dtype=torch.int64).view(torch.uint8)
    got = collectives.gather_bytes(data, ranks.group, guard.wait, "every process's tensor keys")
    return [t.view(torch.int64).tolist() for t in got]


def _nbytes(mine: _Mine, plan: K.Plan, item: K.Item, dst: int) -> int:
    """The bytes a sent item carries: a model tensor, or a unit's state tensors."""
    held, optim, name = mine.source(plan, item, dst)
    names = [name] if item[0] == K.MODEL else unit_tensors(name, optim["state"].get(name, {}))
    return sum(math.prod(held[n].shape) * held[n].element_size() for n in names)


def _tell(mine: _Mine, plan: K.Plan, ranks: storage.Ranks) -> dict[int, Any]:
    """Step 3: to each process this one sends to, the names, shapes and optimizer metadata of what it sends; from
    each it receives from, theirs (lengths first, then the JSON bytes)."""
    out = {dst: collectives.encode(_metadata(mine, plan, items, dst)) for dst, items in plan.sends.items()}
    lengths = {src: torch.zeros(1, dtype=torch.int64) for src in plan.receives}
    ops = [("send", torch.tensor([len(blob)], dtype=torch.int64), dst) for dst, blob in out.items()]
    _post(ops + [("recv", t, src) for src, t in lengths.items()], ranks)
    blobs = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
    ops = [("send", torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst) for dst, blob in out.items()]
    _post(ops + [("recv", t, src) for src, t in blobs.items()], ranks)
    return {src: collectives.decode(bytes(t.numpy().tobytes())) for src, t in blobs.items()}


def _post(ops: list[tuple[str, torch.Tensor, int]], ranks: storage.Ranks) -> None:
    guard = ranks.guard
    assert guard is not None
    relayout_wire.post(ops, ranks.group, guard.wait)


def _metadata(mine: _Mine, plan: K.Plan, items: tuple[K.Item, ...], dst: int) -> dict[str, Any]:
    """What one receiver learns of the items sent to it, by name."""
    model: dict[str, Any] = {}
    units: dict[str, Any] = {}
    for item in items:
        held, optim, name = mine.source(plan, item, dst)
        if item[0] == K.MODEL:
            model.update(state.describe({name: held[name]}))
            continue
        entries = optim["state"].get(name, {})
        tensors = {n: held[n] for n in unit_tensors(name, entries)}
        units[name] = {"params": optim["params"][name], "state": entries, "described": state.describe(tensors)}
    return {"model": model, "units": units}


def _from_files(
    mine: _Mine, plan: K.Plan, record: dict[str, Any], rank: int
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], Mapping[str, torch.Tensor]]]:
    """What this process read from files for itself (tensors by name; the units' metadata into ``record``), and
    the file each tensor it sends from a file is read from, by (name, receiver)."""
    read: dict[str, torch.Tensor] = {}
    for item in plan.read:
        held, optim, name = mine.source(plan, item, rank)
        names = (
            [name]
            if item[0] == K.MODEL
            else _recorded(record, name, optim["params"][name], optim["state"].get(name, {}))
        )
        read.update({n: held[n] for n in names})
    sending: dict[tuple[str, int], Mapping[str, torch.Tensor]] = {}
    for (dst, item), _ in plan.filed.items():
        if dst == rank:
            continue
        held, optim, name = mine.source(plan, item, dst)
        names = [name] if item[0] == K.MODEL else unit_tensors(name, optim["state"].get(name, {}))
        sending.update({(n, dst): held for n in names})
    return read, sending


def _assemble(
    mine: _Mine, plan: K.Plan, told: Mapping[int, Any], rank: int
) -> tuple[Transfers, dict[str, Any], dict[str, Any]]:
    """This process's moves (sorted by name, then receiver, as every process sorts them: its peers post theirs in
    the same order), the names it keeps; the shapes of what it receives; the optimizer metadata it restores."""
    record: dict[str, Any] = {"params": {}, "state": {}}
    described: dict[str, Any] = {}
    moves: list[Move] = []
    kept: list[str] = []
    for item in plan.kept:
        name = mine.name(item, False)
        if item[0] == K.MODEL:
            kept.append(name)
        else:
            kept += _recorded(record, name, mine.optim["params"][name], mine.entries(name))
    for src, items in plan.receives.items():
        for item in items:
            name = mine.name(item, True)
            got = _checked(told[src], item[0], name, src)
            if item[0] == K.MODEL:
                described[name], names = got, [name]
            else:
                described.update(got["described"])
                names = _recorded(record, name, got["params"], got["state"])
            moves += [Move(n, src, rank) for n in names]
    for dst, items in plan.sends.items():
        for item in items:
            _, optim, name = mine.source(plan, item, dst)
            names = [name] if item[0] == K.MODEL else unit_tensors(name, optim["state"].get(name, {}))
            moves += [Move(n, rank, dst) for n in names]
    moves.sort(key=lambda m: (m.name, m.dst))
    return Transfers(tuple(moves), {rank: tuple(sorted(kept))}, {}), described, record


def _recorded(record: dict[str, Any], unit: str, params: Any, entries: Mapping[str, Any]) -> list[str]:
    """Put a unit's metadata in ``record`` (as :func:`..checkpoint.state.optimizer_state` lists it); its tensors."""
    record["params"][unit] = params
    if entries:
        record["state"][unit] = dict(entries)
    return unit_tensors(unit, entries)


def _checked(told: Mapping[str, Any], kind: int, name: str, src: int) -> Any:
    """The sender's entry for ``name``: it must be there (else two names share a key, across processes)."""
    sent = told["model" if kind == K.MODEL else "units"]
    if name not in sent:
        raise ValueError(
            f"relayout: process {src} sent {sorted(sent)[:3]} where {name!r} was needed: two names share a 64-bit "
            "key; rename one"
        )
    return sent[name]
