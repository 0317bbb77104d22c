"""``Pipeline.relayout``: the same processes (or fewer, or more) take a new layout, exactly, without a restart.

A collective over every process of the world, in five parts (timed in :attr:`Layout.seconds`: agreement, groups,
build, move, fill, commit, release):

1. *agreement*: one small exchange (the request's digest, each process's progress and refusals); a bad
   request raises the same ``ValueError`` everywhere before any group is made or any tensor moves;
2. *groups*: the members' pipeline group and a gloo exchange group, both new for this generation;
3. *build*: each member builds its stages of the new layout through the usual construction path (the
   pipeline's own way in, with the changed options), layer specs on ``meta`` then given storage, never
   initialised (:func:`~stagewise.runtime.frontends.layers.built_empty`);
4. *move*: every tensor the new stages hold (parameters, buffers, tied copies, the own optimizers' state by
   parameter name, Adam's ``step`` included) comes from the lowest process that held it (the one primitive,
   :func:`.primitive.relay`, as a recovery's take-over; with ``live=``, what no listed process holds comes
   from the current step's snapshot files: :mod:`.from_snapshots`); a model tensor kept on its process is
   aliased, the others go point-to-point over gloo, never through disk; then the
   steps trained and the dropout seed are set, so the next step draws the masks it would have; last, the
   commit point: every process says it is done. A process failing before it posts its failure on the
   call's board, so every process raises the same PipelineError and keeps the old layout, whole;
5. *release*: the old layout's transport, groups and shared memory are let go.

The user's reference stays valid: the Pipeline object takes the new layout's state in place. A process left
out of the members becomes a :class:`Retired` pipeline that holds nothing and refuses every step but the next
``relayout``. Data: the global batch on every process, sliced by :meth:`~stagewise.Pipeline.local_batch`,
needs nothing; a sampler of one's own reads :attr:`Layout.inputs_at` / :attr:`Layout.targets_at`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..checkpoint import storage
from ..checkpoint.declared import PipelineState, Progress, progress_of, restore_progress
from ..checkpoint.manifest import CheckpointError
from ..comm import groups, relayout_wire
from ..comm.faults import calls
from ..comm.faults.guard import Guard
from ..errors import PipelineError
from ..frontends.layer_list import LayerList
from ..frontends.layers import built_empty
from ..frontends.parts import Frontend
from ..frontends.plan import FromPlan
from ..options import Options
from .carried import carry_snapshots, restore_schedulers, retire, scheduler_state, tell
from .clock import Clock
from .fill import commit
from .from_snapshots import chosen_progress, current_files, snapshot_refusals
from .kept import lender
from .layout import Layout
from .models import release_model, twin_of
from .old_layout import hooks_of, let_go_old
from .primitive import relay
from .request import (
    digest,
    local_refusals,
    members_of,
    placement_refusals,
    plan_refusals,
    refuse_alike,
    subgroups_ahead,
)
from .takeover import hold_whole

Build = Callable[[Frontend, Options], nn.Module]
Live = Sequence[int] | None  # members (None: every process), or the ranks whose live tensors are sources (None: all)


_generations = [0]  # re-layouts this process took part in (advanced alike on every process)
_calls = [0]  # relayout calls on this process, refused ones too (advanced alike on every process): boards' names
#: per pipeline (the user's object, which keeps its identity across re-layouts), the groups made for its layout in
#: force: let go by its next re-layout (another pipeline's re-layout in the same process never touches them)
_owned: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def relayout(
    pipe: nn.Module, members: Live, changes: Mapping[str, Any], plan: Any, build: Build, live: Live = None
) -> Layout:
    """See the module docstring (``live``: :mod:`.from_snapshots`); ``build(frontend, options)``: the constructor.

    A collective call of the pipeline (:mod:`..comm.faults.calls`): a rank waiting in it for a peer that is in
    another call (``train_step`` on one rank, ``relayout`` on the other) says so within seconds, on both sides,
    where both waited out their deadline."""
    scope = pipe.transport.guard.scope if isinstance(pipe, PipelineState) else None
    with calls.call("relayout", scope) if scope is not None else nullcontext():
        return _relayout(pipe, members, changes, plan, build, live, scope)


def _relayout(
    pipe: nn.Module, members: Live, changes: Mapping[str, Any], plan: Any, build: Build, live: Live, scope: str | None
) -> Layout:
    source: Any = pipe
    frontend, options = source.frontend, source.options
    world, me = groups.world_size(), groups.global_rank()
    chosen = members_of(members, world)
    old = pipe if isinstance(pipe, PipelineState) else None
    clock = Clock()
    _calls[0] += 1
    guard = _guard("agreement", options.timeout, me, scope)
    agreeing = storage.Ranks(None, me, world, torch.device("cpu"), True, guard, options.timeout, True)
    try:
        progress, schedule = _agree(agreeing, old, frontend, options, chosen, changes, plan, live)
    finally:
        agreeing.close()
    clock.lap("agreement")
    _generations[0] += 1
    group = relayout_wire.fresh_group(chosen, options.timeout)
    exchange = relayout_wire.fresh_group(range(world), options.timeout, backend="gloo")
    prepared = _groups_ahead(chosen, world, options)
    clock.lap("groups")
    guard = _guard("move", options.timeout, me, scope)
    ranks = storage.Ranks(exchange, me, world, torch.device("cpu"), True, guard, options.timeout, True)
    new: nn.Module | None = None
    old_hooks = hooks_of(pipe)  # (before the build: a module the new layout shares gets its hooks too)
    try:
        if me in chosen:
            source = _new_source(frontend, options, changes, plan, group)
            with built_empty(lender(old, source[0])):  # filled below: none initialised, none kept allocated
                new = build(*source)
        clock.lap("build")
        moved, everyone = _move(old, new, ranks, progress, schedule, clock, live)
        commit(ranks)
        clock.lap("commit")
    except BaseException as err:
        new = None  # half-filled: dropped; the user's object still holds the old layout, whole
        posted = _failed(ranks, err)
        relayout_wire.release(group)
        relayout_wire.release_failed(exchange, options.timeout)  # a collective may be left in flight
        exchange = None
        if posted is None:
            raise
        raise posted from err
    finally:
        ranks.close()
        relayout_wire.release(exchange)
    stale = _stale_groups(pipe, old, [group, *prepared])
    before = list(pipe.parameters())
    carry_snapshots(old, new)
    _become(pipe, new, *_held_by(new, frontend, options, changes, plan), build, old_hooks)
    retire(before, pipe.parameters())  # a user's optimizer over them is refused at its next step
    release_model(frontend, options)
    for made in stale:
        relayout_wire.release(made)
    clock.lap("release")
    layout = _layout(None if new is None else pipe, chosen, everyone, moved, clock.seconds)
    tell(layout)  # on_relayout listeners (a sampler of one's own)
    return layout


def _guard(part: str, timeout: float, me: int, scope: str | None) -> Guard:
    """The deadline and error board of one part of this re-layout: the board is named by the count of this
    call, which every process makes alike (a count of pipelines built would not do: a retired process builds
    none); its waits judge the peers' collective calls of the pipeline's ``scope``."""
    return Guard(f"relayout/{_calls[0]}/{part}", timeout, f"global rank {me}", scope=scope)


def _failed(ranks: storage.Ranks, err: BaseException) -> PipelineError | None:
    """A process failed during the build or the move: its failure is posted on the re-layout's board, so every
    other process stops at its next wait with the same :class:`PipelineError` (no one passes the commit point,
    so no one takes the new layout), and raised here as one. A refusal raised alike everywhere stays as it is."""
    if isinstance(err, (PipelineError, CheckpointError)) or not isinstance(err, Exception):
        return None
    guard = ranks.guard
    assert guard is not None
    failure = guard.fail(
        f"global rank {ranks.rank}: the re-layout failed ({type(err).__name__}: {err}); every process keeps the "
        "layout from before the call"
    )
    return PipelineError(failure)


class Retired(nn.Module):
    """A process outside a re-layout's members: it holds nothing and refuses every step; a later ``relayout``
    (called on every process of the world, as always) may give it a part again."""

    frontend: Frontend
    options: Options
    build: Build

    def relayout(
        self, members: Sequence[int] | None = None, /, *, plan: Any = None, live: Any = None, **changes: Any
    ) -> Layout:
        """See :meth:`stagewise.Pipeline.relayout`."""
        return relayout(self, members, changes, plan, self.build, live)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"process {groups.global_rank()} holds no part of the pipeline since a re-layout left it out of the "
            "members: it takes part in the next relayout only"
        )

    train_step = train_stream = eval_step = last_step_losses = timeline = _refuse

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse()


# ---- the parts ------------------------------------------------------------------------------
def _groups_ahead(chosen: tuple[int, ...], world: int, options: Any) -> list[Any]:
    """The groups the members' new pipeline makes among themselves, made now by every process of the world (the
    retiring build nothing, so they could not join later): its tied groups, and its snapshot exchange's."""
    prepared = groups.prepare_subgroups(subgroups_ahead(chosen, world))
    if options.snapshot and len(chosen) < world:
        prepared.append(groups.prepare_gloo(chosen, options.timeout))
    return prepared


def _agree(
    ranks: storage.Ranks,
    old: PipelineState | None,
    frontend: Frontend,
    options: Options,
    chosen: tuple[int, ...],
    changes: Mapping[str, Any],
    plan: Any,
    live: Sequence[int] | None,
) -> tuple[Progress, Any]:
    """The one small exchange: every process's request digest, progress, LR schedule and refusals; refused alike."""
    progress = None if old is None else progress_of(old)
    refused = local_refusals(frontend, options, progress, changes) + plan_refusals(plan)
    refused += snapshot_refusals(old, live, ranks.size)
    if (plan is not None or changes.get("parallel", options.parallel) is not None) and len(chosen) != ranks.size:
        refused.append(f"parallel= spans every process of the world: keep all {ranks.size} as members")
    if plan is not None and not isinstance(frontend, (LayerList, FromPlan)):
        refused.append(f"plan= re-cuts a layer list (Pipeline(layers) or from_plan), not {frontend.entry}")
    before = None if old is None else tuple(groups.global_ranks(old.transport.group))
    refused += placement_refusals(frontend, before, chosen)
    asked = {**changes, "live=": None if live is None else sorted(live)}
    mine = {"digest": digest(chosen, asked, plan), "refused": refused, "progress": progress and asdict(progress)}
    mine["scheduler"] = scheduler_state(old)
    everyone = storage.gather(mine, ranks, "every process's re-layout request")
    refuse_alike(everyone)
    return chosen_progress(everyone)


def _new_source(
    frontend: Frontend, options: Options, changes: Mapping[str, Any], plan: Any, group: Any
) -> tuple[Frontend, Options]:
    """The way in and the options of the new layout: the user's own options, the changes on top."""
    frontend = twin_of(frontend, options)  # a model built whole, its other parts freed: its structure on meta
    given = {k: getattr(options, k) for k in options.given if k not in ("group", "parallel")}
    if options.parallel is not None and "parallel" not in changes:
        given["parallel"] = options.parallel
    given.update(changes)
    if given.get("parallel") is None and plan is None:  # a plan's layout makes its own mesh's groups
        given["group"] = group
    if plan is not None:
        layers = frontend.layers if isinstance(frontend, FromPlan) else frontend
        assert isinstance(layers, LayerList)
        frontend = FromPlan(plan, dict(layers.named))
        given = {k: v for k, v in given.items() if k not in plan.pipeline_options()}
    return frontend, Options.of(frontend.entry, None, given)


def _move(
    old: PipelineState | None,
    new: nn.Module | None,
    ranks: storage.Ranks,
    progress: Progress,
    schedule: Any,
    clock: Clock,
    live: Sequence[int] | None,
) -> tuple[int, list[dict[str, Any]]]:
    """Part 4: every tensor of the new stages from its owner (:func:`.primitive.relay`, from this process's old
    pipeline held whole: every tensor is the current step's; with ``live``, a process outside it gives nothing
    live, and the current step's snapshot files are sources); the progress; the LR schedule."""
    held = hold_whole(old, progress.train_steps) if live is None or ranks.rank in live else None
    row: dict[str, Any] = {"stages": [], "layout": None}
    if isinstance(new, PipelineState):
        row.update(stages=sorted(new.local_stages), layout=_described(new))
    files = None if live is None else current_files(old, ranks.rank)
    relaid = relay(held, progress.train_steps, new, ranks, row, files, clock.lap)
    if new is not None:
        assert isinstance(new, PipelineState)
        restore_progress(new, progress)
        restore_schedulers(new, schedule)
    clock.lap("fill")
    return relaid.listing.bytes_moved, relaid.listing.everyone


def owned_groups(pipe: nn.Module) -> list[Any]:
    """The groups ``pipe``'s last re-layout made for its layout, handed to the caller (``pipe.close()``)."""
    return _owned.pop(pipe, [])


def _stale_groups(pipe: nn.Module, old: PipelineState | None, kept: list[Any]) -> list[Any]:
    """The old layout's groups to let go once it is released: those ``pipe``'s last re-layout made and its tied
    modules' (never the user's group nor the default one); ``kept`` become the new layout's own."""
    stale = list(_owned.get(pipe, []))
    if old is not None:
        stale += [g for g in old.tied.groups.values() if g is not old.transport.group and g not in stale]
    _owned[pipe] = kept
    return [g for g in stale if g not in kept]


def _become(
    pipe: nn.Module, new: nn.Module | None, frontend: Frontend, options: Options, build: Build, old_hooks: Any
) -> None:
    """The user's object takes the new state in place; the old state is let go at once (its transport, groups
    and shared memory as the shell holding it goes; its tensors: :mod:`.old_layout`)."""
    shell = object.__new__(type(pipe))
    vars(shell).update(vars(pipe))
    vars(pipe).clear()
    if new is not None:
        vars(pipe).update(vars(new))
        vars(new).clear()
        pipe.__class__ = type(new)
        if isinstance(pipe, PipelineState) and pipe.snapshots is not None:  # built reading ``new``, now emptied
            pipe.snapshots.root = pipe
        _repoint(pipe, new)
    else:
        nn.Module.__init__(pipe)
        pipe.__class__ = Retired
        vars(pipe).update({"frontend": frontend, "options": options, "build": build})
    let_go_old(shell, pipe, old_hooks)


def _held_by(
    new: nn.Module | None, frontend: Frontend, options: Options, changes: Mapping[str, Any], plan: Any
) -> tuple[Frontend, Options]:
    """The way in and options the user's object keeps: a process retired here keeps the ones with the change made
    (the re-layout that brings it back agrees on them with the members, which built with them)."""
    return (frontend, options) if new is not None else _new_source(frontend, options, changes, plan, None)


def _repoint(pipe: nn.Module, new: nn.Module) -> None:
    """The parts built holding ``new`` (``clip=``'s, the reporter's parameter count), emptied once the user's
    object took its state, hold the user's object instead: an attribute that is ``new``, or a method bound to it.
    (``clip=`` failed every step after a re-layout: "'Pipeline' object has no attribute 'hybrid'".)"""
    hooks, metrics = getattr(pipe, "hooks", None), getattr(pipe, "metrics", None)
    for part in [*(hooks.parts if hooks is not None else ()), metrics]:
        for key, value in list(vars(part).items()) if hasattr(part, "__dict__") else ():
            if value is new:
                setattr(part, key, pipe)
            elif inspect.ismethod(value) and value.__self__ is new:
                setattr(part, key, getattr(pipe, value.__name__))


def _described(new: PipelineState) -> dict[str, Any]:
    """The new layout as every process learns it (JSON)."""
    s, hybrid = new.schedule, new.hybrid
    return {
        "schedule": s.name,
        "num_ranks": s.num_ranks,
        "microbatches": s.num_microbatches,
        "placement": list(s.placement),
        "layer_ranges": [[r.start, r.stop] for r in new.layer_ranges],
        "parallel": None if hybrid is None else {a: getattr(hybrid.config, a) for a in ("pp", "dp", "sharding", "tp")},
    }


def _layout(
    new: nn.Module | None,
    chosen: tuple[int, ...],
    everyone: list[dict[str, Any]],
    moved: int,
    seconds: dict[str, float],
) -> Layout:
    """What the call returns: the same on every process, but for this process's own place in it."""
    stages = [e["stages"] for e in everyone]
    first = min(s for ss in stages for s in ss)
    last = max(s for ss in stages for s in ss)
    d = next(e["layout"] for e in everyone if e["layout"] is not None)
    source: Any = new
    return Layout(
        generation=_generations[0],
        members=chosen,
        schedule=d["schedule"],
        num_ranks=d["num_ranks"],
        microbatches=d["microbatches"],
        placement=tuple(d["placement"]),
        layer_ranges=tuple((a, b) for a, b in d["layer_ranges"]),
        parallel=d["parallel"],
        inputs_at=tuple(r for r, ss in enumerate(stages) if first in ss),
        targets_at=tuple(r for r, ss in enumerate(stages) if last in ss),
        pp_rank=None if new is None else source.pp_rank,
        local_stages=() if new is None else tuple(source.local_stages),
        bytes_moved=moved,
        seconds=seconds,
    )
