"""Where each tensor of a recovery's new layout comes from: pure, the same answer on every process (no torch).

Every process of the new generation sends one record in the agreement's exchange (:mod:`.takeover`): its
machine, the snapshot files its machine holds (listed by the first process of each machine), what its new
stages need (``model/NAME``, and ``param:NAME`` for one parameter's optimizer state), and, per snapshot step
its old pipeline captured, which of its live tensors still hold that snapshot's value (their version counter
unchanged since the capture). From those records every process computes the same :class:`Decision`:

1. the committed step: the newest snapshot generation whose files cover every need
   (:func:`..elastic.choose.choose`, the step a resume from the snapshots takes: every rank's snapshot of it
   written and copied). Between it, the disk's newest checkpoint and the survivors' live tensors, the choice
   is the resume's (:func:`..checkpoint.newest.newest`: the newest step, a tie to the cheaper source; live
   tensors are partial: they complete the snapshots of their own step only). The live path is refused, alike
   everywhere, when no generation covers the needs, the disk's checkpoint is chosen, or the new layout is the
   one that saved (the generators' states come back from the files then: the resume does that);
2. a survivor's live tensors count only at the committed step: those clean since the capture of that step's
   snapshot. A survivor past it (it stepped again, or a forward changed a buffer) gives those tensors nothing
   live: they come from the snapshot;
3. per name and receiver: its own live tensor (kept: aliased), else the lowest survivor's live one (moved), else
   a file of the committed step, nearest first, read by the process that listed it on its machine and sent (its
   listing is what verifies it). A newcomer (no old state) contributes nothing and receives everything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..checkpoint.newest import DISK, LIVE, SNAPSHOTS, Report, newest
from ..elastic.choose import Choice, Copy, Need, choose, of_live_jobs

PARAM = "param:"  # a need for the optimizer state of one parameter (as the snapshots' inventory names it)


@dataclass(frozen=True)
class Take:
    """``name`` for process ``dst`` from process ``src``: a live tensor (``path`` None), or the snapshot file
    ``path`` on ``machine``, read by ``src`` (``src == dst``: read where it is needed, nothing sent)."""

    name: str
    dst: int
    src: int
    path: str | None = None
    machine: str = ""

    @property
    def moves(self) -> bool:
        return self.src != self.dst


@dataclass
class Decision:
    """The committed step, its generation, and every name's source (``kept[r]``: process ``r``'s own live)."""

    step: int
    lineage: str
    job: str
    kept: dict[int, tuple[str, ...]] = field(default_factory=dict)
    progress: Any = None  # the chosen source's report of it (the dropout step, the LR schedule's place)
    takes: tuple[Take, ...] = ()
    files: dict[tuple[str, str], Copy] = field(default_factory=dict)
    generation: int = 0  # the membership generation of the state chosen (meta46)

    def reads(self, rank: int) -> list[tuple[str, str]]:
        """The files (machine, path) process ``rank`` reads: to send, or for itself."""
        return sorted({(t.machine, t.path) for t in self.takes if t.src == rank and t.path is not None})

    def counts(self) -> dict[str, int]:
        """How many names came from each kind of source: own live (kept), another's live, a snapshot file."""
        live = sum(1 for t in self.takes if t.path is None)
        return {"kept": sum(len(k) for k in self.kept.values()), "live": live, "snapshot": len(self.takes) - live}


def decide(records: Sequence[Mapping[str, Any]], layout: Any, disk_step: int | None) -> Decision | str:
    """The decision from every process's record (see the module docstring), or why the live path is refused.

    A record: ``machine``; ``copies`` (the listed snapshot files, :class:`..elastic.choose.Copy`'s fields);
    ``ended`` (the jobs that ended cleanly, by this machine's markers); ``need`` (names, None: no new stages);
    ``live`` (``{str(step): names clean since that step's capture}``). ``layout``: the new layout's
    (``state.layout_of``); ``disk_step``: the newest checkpoint's step on disk (None: none)."""
    finished = {job: step for r in records for job, step in r["ended"].items()}
    copies, _ = of_live_jobs([as_copy(c) for r in records for c in r["copies"]], finished)
    needs = [Need(k, r["machine"], frozenset(r["need"])) for k, r in enumerate(records) if r["need"] is not None]
    if not needs:
        return "no process builds new stages"
    choice = choose(copies, needs, layout, set())
    if choice is None:
        return "no snapshot generation covers every new stage (snapshot= off, or files lost)"
    chosen = newest(_reports(records, choice, disk_step))  # (the snapshots' is whole: never None)
    assert chosen is not None
    if chosen.report.kind == DISK:
        return f"a checkpoint on disk (step {disk_step}) is newer than the snapshots (step {choice.step})"
    if choice.rng:
        return "the new layout is the one that saved the snapshots: their generators' states come back with them"
    files = [c for c in copies if c.generation == (choice.step, choice.lineage)]
    live: dict[int, frozenset[str]] = {k: frozenset() for k in range(len(records))}
    for part in chosen.partial:  # the survivors' live tensors of the chosen step
        live[part.holder] = frozenset(records[part.holder]["live"][str(part.step)])
    decision = Decision(choice.step, choice.lineage, choice.job, files={(c.machine, c.path): c for c in files})
    decision.generation = chosen.report.generation  # meta46: what the states trained next count on from
    decision.progress = chosen.report.progress
    missing = plan_sources(decision, needs, live, files)
    if missing:
        return "; ".join(f"process {r} needs {', '.join(sorted(ns)[:5])} that no source holds" for r, ns in missing)
    return decision


def _reports(records: Sequence[Mapping[str, Any]], choice: Choice, disk_step: int | None) -> list[Report]:
    """What each source holds, for the one choice (:mod:`..checkpoint.newest`): the snapshots' newest whole
    generation (with its progress, as its files' headers say: ``progress`` in a record, by ``step/lineage``), the
    disk's newest checkpoint, and each survivor's live tensors per captured step (partial: they only complete the
    snapshots of their step), each with the membership generation that trained it (the headers', the checkpoint
    record's (process 0's ``disk_generation``), the old pipeline's (``held_in``))."""
    key = f"{choice.step}/{choice.lineage}"
    told = (r["progress"] for r in records if "progress" in r)  # (the take-over's: the files' headers, by generation)
    said = next((ps[key] for ps in told if key in ps), None)
    reports = [Report(SNAPSHOTS, choice.step, generation=choice.membership, progress=said)]
    if disk_step is not None:
        reports.append(Report(DISK, disk_step, generation=int(records[0].get("disk_generation", 0))))
    return reports + [
        Report(LIVE, int(step), whole=False, generation=int(r.get("held_in", 0)), holder=k)
        for k, r in enumerate(records)
        for step in r["live"]
    ]


def plan_sources(
    decision: Decision, needs: Sequence[Need], live: Mapping[int, frozenset[str]], files: Sequence[Copy]
) -> list[tuple[int, set[str]]]:
    """Fill ``decision.kept`` and ``decision.takes`` (in the one order every process posts them: by name, then
    receiver); return what no source holds, per process."""
    holders: dict[str, list[int]] = {}
    for r in sorted(live):
        for name in live[r]:
            holders.setdefault(name, []).append(r)
    takes: list[Take] = []
    missing: list[tuple[int, set[str]]] = []
    for need in needs:
        kept, lost, near = [], set(), nearest_first(files, need.machine)
        for name in sorted(need.names):
            src = live_source(need.rank, holders.get(name, ()))
            found = None if src is not None else next((c for c in near if name in c.names), None)
            if src == need.rank:
                kept.append(name)
            elif src is not None:
                takes.append(Take(name, need.rank, src))
            elif found is None:
                lost.add(name)
            else:
                src = found.holder  # (its lister reads it: the only process holding its listing)
                takes.append(Take(name, need.rank, src, found.path, found.machine))
        decision.kept[need.rank] = tuple(kept)
        if lost:
            missing.append((need.rank, lost))
    decision.takes = tuple(sorted(takes, key=lambda t: (t.name, t.dst)))
    return missing


def live_source(receiver: int, holders: Collection[int]) -> int | None:
    """The one rule for a tensor some process holds live (a re-layout's, a take-over's): the receiver's own
    (kept: aliased, no copy), else the lowest process holding it (a replicated tensor is read once per receiver,
    never from two senders); None when no process holds it live (then a snapshot file: :func:`nearest_first`)."""
    if receiver in holders:
        return receiver
    return min(holders) if holders else None


class Located(Protocol):
    """A snapshot file as :func:`nearest_first` orders it (a :class:`..elastic.choose.Copy`, a
    :class:`.keys.Filed`)."""

    @property
    def machine(self) -> str: ...
    @property
    def owner(self) -> int: ...
    @property
    def path(self) -> str: ...


FileT = TypeVar("FileT", bound=Located)


def nearest_first(files: Sequence[FileT], machine: str) -> list[FileT]:
    """The snapshot files in the order a receiver on ``machine`` takes a name from them, when no process holds
    it live: its own machine's first (read there), then the others' (read by their lister and sent), by owner."""
    return sorted(files, key=lambda c: (c.machine != machine, c.owner, c.machine, c.path))


def as_copy(listed: Mapping[str, Any]) -> Copy:
    """A listed file as :mod:`..elastic.choose` takes it (the listing's other fields left out)."""
    keys = ("machine", "holder", "path", "lineage", "step", "owner", "world", "layout", "job")
    generation = int(listed.get("membership", 0))  # meta46
    return Copy(**{k: listed[k] for k in keys}, names=frozenset(listed["names"]), membership=generation)


def clean_names(captured: Mapping[str, int], now: Mapping[str, int], params: Sequence[str]) -> frozenset[str]:
    """The names whose value is still a capture's. ``captured`` / ``now``: tensor name -> version counter at the
    capture and now; ``params``: the parameters the optimizers hold. ``param:NAME`` counts only when the
    parameter itself is clean and so is every tensor of its optimizer state, none come or gone since (a
    parameter never stepped has none: its hyper-parameters are the capture's while it is clean)."""
    clean = {n for n, v in now.items() if captured.get(n) == v}
    optim: dict[str, list[str]] = {}
    for name in set(captured) | set(now):
        if name.startswith("optim/"):
            optim.setdefault(name[len("optim/") : name.rindex("/")], []).append(name)
    out = {n for n in clean if n.startswith("model/")}
    out |= {PARAM + p for p in params if "model/" + p in clean and all(n in clean for n in optim.get(p, []))}
    return frozenset(out)


def in_place_refusal(kind: str, before: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> str | None:
    """Why ``sw.runtime.InPlace`` cannot go on with the pipeline ``build(fit)`` returned (None: it can), decided
    alike on every member before anything moves, as its recovery would otherwise move tensors by names that no
    longer mean the same. ``kind``: "pipeline", "given" (``from_stages``), or the type's name of anything else;
    ``before`` / ``now``: the placement (ranks, stages' places, virtual stages) of the generation before (None: the
    first) and of the new one."""
    if kind not in ("pipeline", "given"):
        return (
            f"sw.runtime.InPlace takes the state of a Pipeline over in place, and build(fit) returned a {kind} "
            "(a HetPipe's virtual workers each keep their own state): build a Pipeline, or run the HetPipe under "
            "torchrun's restarts with sw.checkpoint.resume"
        )
    if kind == "given" and before is not None and dict(before) != dict(now or {}):
        return (
            "a pipeline of given stages (from_stages) keeps its placement across an in-place recovery: its tensors "
            f"are named by stage, and the stages were placed {dict(before)}, the new members' layout places them "
            f"{dict(now or {})}: keep pp fixed (ElasticLayout keeps it), or build from layers or from_model"
        )
    return None
