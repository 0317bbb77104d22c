"""``save`` and ``load``: the checkpoint of a pipeline (or a plain module), collective over its ranks.

A save, on every rank of the mesh (or pipeline group):

1. gathers what rank 0 records (names and shapes, optimizer hyper-parameters, every rank's RNG) and the
   pieces each rank holds, so that each piece is written once;
2. rank 0 makes ``ROOT/.step-N.tmp``; every rank writes its share of the tensors there with DCP;
3. a barrier: every rank has finished writing;
4. the files are hashed, each rank a share; rank 0 writes ``stagewise.json`` (JSON, no pickle), then
   ``MANIFEST.json`` last, and renames the folder to ``ROOT/step-N``; old ones beyond ``keep`` go.

Every wait goes through the pipeline's guard (:mod:`.storage`): a rank that stops or dies anywhere in a save
or a load gives every other rank a :class:`~stagewise.PipelineError` naming it within the pipeline's timeout;
only a wait behind the others' writing or hashing may last the call's ``timeout``, and only while every rank
shows signs of life.

A load verifies before it touches anything: every rank hashes a share of the
files and the verdicts are gathered (a shared file system is assumed, as DCP
assumes it), then each rank checks the names and shapes it needs against the
checkpoint and the problems are gathered again, so either every rank raises
the same error or every rank loads. Spreading the hashing costs each rank
``1/world`` of the reading; deciding together keeps a rank from reading a
checkpoint another has refused. Which folder a load of a root takes, and why,
is logged (:func:`.retention.choose`, which refuses a newest checkpoint that
lost its manifest rather than fall back silently) and kept in
:attr:`CheckpointInfo.reason`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._util import is_count
from ..comm.faults import calls
from ..comm.generations import recorded
from ..interrupt import note_checkpoint
from . import agreement, retention, state, storage, verify
from . import manifest as mf
from .declared import CheckpointInfo, PipelineState
from .manifest import CheckpointError
from .parts import SavedInParts
from .verify import META

log = logging.getLogger(__name__)


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    step: int,
    extra: Any = None,
    scheduler: Any = None,
    keep: int | None = None,
    timeout: float = 600.0,
    collective: bool = True,
) -> Path:
    """Save ``model`` (a Pipeline, or a one-process module), its optimizer state and RNG as ``path/step-N``.

    A collective: every rank of the pipeline's mesh calls it with the same
    arguments. ``optimizer``: an optimizer, a list, or a dict stage ->
    optimizer; by default a Pipeline's own (``Pipeline(optimizer=factory)``).
    ``scheduler``: an LR scheduler (or several in lockstep: the first one's
    state is saved). ``extra``: JSON-like user data (rank 0's is saved), e.g.
    the sampler's position. ``keep``: how many checkpoints to keep under ``path``
    (this one and the newest ``keep - 1`` others by step).
    ``timeout``: seconds a rank may wait for the others to finish writing and
    hashing their shares, as long as every rank shows signs of life (any other
    wait ends within the pipeline's own ``timeout``; for a plain module saved by
    every process, within this one).
    ``collective=False`` saves a plain module from this process alone (a
    Pipeline is always saved by all its ranks). Returns the checkpoint's folder.
    """
    if not is_count(step, 0):
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    state.refuse_merging(model, "save")
    part = virtual_worker(model, path)
    if part is not None:  # a HetPipe: each virtual worker saves its own pipeline, under ROOT/vwK
        folder, pipe, mine = part
        wrapped = {"virtual_worker": mine, "extra": extra}
        return save(folder, pipe, optimizer, step=step, extra=wrapped, scheduler=scheduler, keep=keep, timeout=timeout)
    retention.check_keep(keep)
    scheduler = scheduler if scheduler is not None else _own_schedulers(model)
    ranks = _ranks(model, collective, timeout)
    try:
        with _counted("save", ranks):
            final = _save(Path(path), model, optimizer, scheduler, extra, step, keep, ranks)
        note_checkpoint(final, step)  # named by the line a Ctrl-C prints
        return final
    finally:
        ranks.close()


def _save(
    root: Path, model: nn.Module, optimizer: Any, scheduler: Any, extra: Any, step: int, keep: int | None, ranks: Any
) -> Path:
    tensors, mine = _contribution(model, optimizer, scheduler, extra, ranks)
    everyone = storage.gather(mine, ranks, "what every rank saves", patient=True)  # behind the others' hashing
    staging, final = retention.staging_for(root, step), retention.folder_for(root, step)
    storage.agree(_staged(staging, everyone, ranks), ranks, f"cannot start checkpoint {final}")
    pieces = storage.assigned([m["pieces"] for m in everyone], ranks.rank) if ranks.distributed else None
    storage.save_tensors(tensors, staging, ranks, pieces)
    storage.barrier(ranks, f"finished writing checkpoint {final}")
    files = mf.files_of(staging)
    share = mf.digests(staging, mf.share(files, ranks.rank, ranks.size))
    hashed = storage.gather(share, ranks, f"the digests of checkpoint {final}", patient=True)
    problems = []
    if ranks.first:
        try:
            replaced = retention.job_of(final, META)  # a save of this step, by which job ("" none; None: unknown)
            _publish(staging, final, _record(everyone, model, ranks, step), hashed)
            retention.sweep(root, _job(), staging)  # this job's half-written saves (a restart's, a lost machine's)
            retention.prune(root, keep, final)
            retention.warn_unexpected(root, final, replaced not in ("", _job()))
        except (OSError, CheckpointError) as err:
            problems.append(f"cannot publish {final}: {err}")
    storage.agree(problems, ranks, f"checkpoint {final} was not saved", patient=True)
    return final


def _contribution(
    model: nn.Module, optimizer: Any, scheduler: Any, extra: Any, ranks: storage.Ranks
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors to write, and what it tells rank 0 about them (names, shapes, optimizer
    hyper-parameters, its RNG; rank 0 adds ``extra`` and the scheduler's state)."""
    saved = state.saved_tensors(model)
    names = state.parameter_names(model)
    optimizers = state.optimizers_of(model, optimizer)
    model_tensors = {state.MODEL + k: v for k, v in saved.items()}
    optim_tensors, optim_meta = state.optimizer_state(optimizers, names)
    tensors = {**model_tensors, **optim_tensors}
    first = _first(scheduler)
    mine = {
        "tensors": state.describe(tensors),
        "optimizer": optim_meta if optimizers else None,
        "rng": state.rng_state(),
        "extra": state.encode(extra, "extra=") if ranks.first else None,
        "scheduler": state.encode(first.state_dict(), "scheduler state") if ranks.first and first else None,
        "digests": agreement.digests(tensors) if ranks.size > 1 else {},
        "pieces": storage.pieces(tensors) if ranks.distributed else [],
    }
    return tensors, mine


def _staged(staging: Path, everyone: list[dict[str, Any]], ranks: storage.Ranks) -> list[str]:
    """Rank 0 checks the replicas agree, then makes the empty staging folder; the problems (none elsewhere)."""
    problems: list[str] = []
    if ranks.first:
        problems += agreement.disagreements([m["digests"] for m in everyone])  # before anything is written
    if ranks.first and not problems:
        try:
            if staging.exists():  # a save of this step that died half-way
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            retention.claim(staging, _job())
        except OSError as err:
            problems.append(f"cannot make {staging}: {err}")
    return problems


def _job() -> str:
    """The job a save belongs to, alike across its restarts: torchrun's run id (``--rdzv-id``), else this process."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"


def _publish(staging: Path, final: Path, record: dict[str, Any], hashed: list[dict[str, dict[str, object]]]) -> None:
    """Rank 0: ``stagewise.json``, then ``MANIFEST.json`` last (its presence means complete), then the rename."""
    mf.write_durably(staging / META, json.dumps(record, indent=1, allow_nan=True))
    digests = {name: d for share in hashed for name, d in share.items()}
    digests[META] = mf.digest(staging / META)
    mf.write_manifest(staging, digests)  # last: its presence means complete
    retention.publish(staging, final)
    note_checkpoint(final, record["step"])  # at once: a Ctrl-C during the others' wait names this one


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    collective: bool = True,
    timeout: float = 600.0,
) -> CheckpointInfo:
    """Verify the checkpoint at ``path`` (a ``step-N`` folder, or a root: its newest) and load it.

    A collective, like :func:`save`. The layout may differ from the saving
    run's: another pipeline degree, partition, schedule or placement,
    other dp/sharding/tp degrees, or one process (``sw.build_model``). The
    model's names and shapes must match the checkpoint's (``strict=False``:
    only the names both have are loaded). ``optimizer``: as for :func:`save`; a
    Pipeline's own optimizers are loaded when the checkpoint has optimizer
    state, and left as they are when it has none (a model-only "seed" checkpoint).
    Raises :class:`CheckpointError` on every rank, before anything is changed,
    if the checkpoint is partial, corrupted, or for another model.
    ``restore_rng``: the saving ranks' RNG states (with as many ranks) and a
    pipeline's dropout seed and step (``Pipeline.dropout_seed``, ``train_steps``:
    any layout), so a resumed run draws the masks it would have.
    ``collective=False`` loads a plain module in this process alone (e.g. on
    one rank of a running job). ``timeout``: as for :func:`save`, for the
    others' hashing. A root whose newest ``step-N`` lost its manifest is refused
    (see :func:`.retention.choose`); the folder loaded, and why, is logged.
    """
    state.refuse_merging(model, "load")
    if virtual_worker(model, path) is not None:
        options = {"scheduler": scheduler, "strict": strict, "restore_rng": restore_rng, "timeout": timeout}
        return _load_virtual_worker(path, model, optimizer, **options)
    scheduler = scheduler if scheduler is not None else _own_schedulers(model)
    ranks = _ranks(model, collective, timeout)
    try:
        with _counted("load", ranks):
            info = _load(Path(path), model, optimizer, scheduler, strict, restore_rng, ranks)
        note_checkpoint(info.path, info.step, loaded=True)  # a resumed job counts on from here
        if isinstance(model, PipelineState):  # snapshot=: its step counter goes on from the loaded step
            for source in model.state_sources():
                source.resumed(info.step, "")
        return info
    finally:
        ranks.close()


def _load(
    path: Path, model: nn.Module, optimizer: Any, scheduler: Any, strict: bool, restore_rng: bool, ranks: Any
) -> CheckpointInfo:
    folder, reason = _resolve(path, ranks)
    record = verify.verified(folder, ranks)
    optimizers = state.optimizers_of(model, optimizer)
    if optimizers and record.get("optimizer") is None and optimizer is None:  # the pipeline's own stay fresh:
        optimizers = []  # a model-only checkpoint
    targets = {state.MODEL + k: v for k, v in state.load_targets(model).items()}
    problems = verify.check_model(record, targets, ranks, strict)
    if not strict:
        targets = {k: v for k, v in targets.items() if k in record["tensors"]}
    names = state.parameter_names(model)
    opt_targets, found = verify.optimizer_targets(record, optimizers, names, ranks, strict)
    problems += found
    storage.agree(problems, ranks, f"checkpoint {folder} does not fit this model")
    storage.load_tensors({**targets, **opt_targets}, folder, ranks)
    if optimizers:
        state.restore_optimizers(optimizers, names, record, opt_targets)
    scheduler_restored = _restore_schedulers(scheduler, record)
    rng_restored = restore_rng and record["layout"]["world"] == ranks.size
    if rng_restored:
        state.set_rng_state(record["rng"][ranks.rank])
    if restore_rng:
        state.restore_dropout(model, record.get("dropout"))
    return CheckpointInfo(
        path=folder,
        step=record["step"],
        extra=state.decode(record["extra"]),
        layout=record["layout"],
        versions=record["versions"],
        optimizer_restored=bool(optimizers),
        scheduler_restored=scheduler_restored,
        rng_restored=rng_restored,
        reason=reason,
        scheduler_saved=record.get("scheduler") is not None,
        optimizer_saved=record.get("optimizer") is not None,
    )


def _restore_schedulers(scheduler: Any, record: dict[str, Any]) -> bool:
    """Load the saved scheduler state into every scheduler given (each keeping its own stage's learning rates:
    :func:`.state.restore_position`); whether there was one to load."""
    if scheduler is None or record.get("scheduler") is None:
        return False
    state.restore_position(_all(scheduler), state.decode(record["scheduler"]))
    return True


def _load_virtual_worker(path: str | os.PathLike[str], model: Any, optimizer: Any, **options: Any) -> CheckpointInfo:
    """A HetPipe: each virtual worker loads its own pipeline, then rebases its wave rule on what it loaded."""
    part = virtual_worker(model, path)
    assert part is not None
    folder, pipe, _ = part
    info = load(folder, pipe, optimizer, **options)
    model.restore_part(info.extra["virtual_worker"])
    return replace(info, extra=info.extra["extra"])


def virtual_worker(model: Any, path: str | os.PathLike[str]) -> tuple[Path, nn.Module, dict[str, Any]] | None:
    """For a model saved in parts (:class:`.parts.SavedInParts`: a :class:`~stagewise.HetPipe`'s virtual workers):
    where this rank's part keeps its checkpoints under ``path``, its pipeline, and the state saved beside it;
    else None."""
    return model.checkpoint_part(Path(path)) if isinstance(model, SavedInParts) else None


def latest(path: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``path`` (see :func:`stagewise.checkpoint.load`), or None."""
    return retention.latest(path)


# ---- helpers --------------------------------------------------------------------------------
def _ranks(model: Any, collective: bool, timeout: float) -> storage.Ranks:
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if isinstance(model, PipelineState):
        if not collective:
            raise ValueError("collective=False is for a plain module: every rank of a Pipeline saves and loads it")
        return storage.pipeline_ranks(model, timeout)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a stagewise.Pipeline or an nn.Module, got {type(model).__name__}")
    return storage.module_ranks(collective, timeout)


def _counted(kind: str, ranks: storage.Ranks) -> AbstractContextManager[None]:
    """A save or load by every rank, counted as a collective call of the pipeline (:mod:`..comm.faults.calls`)."""
    return calls.call(kind, ranks.guard.scope) if ranks.distributed and ranks.guard is not None else nullcontext()


def _own_schedulers(model: Any) -> Any:
    """A Pipeline's own schedulers (``lr_scheduler=``: stage -> scheduler, in lockstep), or None."""
    return (model.schedulers or None) if isinstance(model, PipelineState) else None


def _first(scheduler: Any) -> Any:
    items = _all(scheduler)
    return items[0] if items else None


def _all(scheduler: Any) -> list[Any]:
    if scheduler is None:
        return []
    if isinstance(scheduler, dict):
        return [scheduler[k] for k in sorted(scheduler)]
    if isinstance(scheduler, (list, tuple)):
        return list(scheduler)
    return [scheduler]


def _record(everyone: list[dict[str, Any]], model: Any, ranks: storage.Ranks, step: int) -> dict[str, Any]:
    """``stagewise.json``: what every rank contributed, merged (a name saved on two ranks must agree)."""
    from ..._util import VERSION

    tensors: dict[str, Any] = {}
    optimizer: dict[str, Any] | None = None
    for r, mine in enumerate(everyone):
        for name, meta in mine["tensors"].items():
            if tensors.setdefault(name, meta) != meta:
                raise CheckpointError(f"tensor {name!r} is {meta} on rank {r} but {tensors[name]} on another rank")
        if mine["optimizer"] is not None:
            optimizer = optimizer or {"params": {}, "state": {}}
            optimizer["params"].update(mine["optimizer"]["params"])
            optimizer["state"].update(mine["optimizer"]["state"])
            optimizer["classes"] = sorted({*optimizer.get("classes", ()), *mine["optimizer"]["classes"]})
    return {
        "step": step,
        "generation": recorded(),  # the membership generation that trained it (a resume prefers the newest)
        "job": _job(),  # (a later save of the same step by another job says it replaced this one)
        "extra": everyone[0]["extra"],
        "scheduler": everyone[0]["scheduler"],
        "layout": state.layout_of(model, ranks.size),
        "dropout": state.dropout_of(model),
        "versions": {"stagewise": VERSION, "torch": torch.__version__},
        "tensors": dict(sorted(tensors.items())),
        "optimizer": optimizer,
        "rng": [mine["rng"] for mine in everyone],
    }


def _resolve(path: Path, ranks: storage.Ranks) -> tuple[Path, str]:
    """The checkpoint folder and why: ``path`` itself if it is one, else :func:`.retention.choose` under it (rank 0
    decides and logs; every rank raises alike)."""
    named = (path / mf.MANIFEST).exists() or (path / META).exists()
    chosen, why, _ = agreed_newest(path, ranks, f"which checkpoint under {path} to load", named=named)
    if chosen is None:
        raise CheckpointError(retention.nothing_at(path))
    if ranks.first and chosen != path:
        log.info("stagewise.checkpoint: loading %s: %s", chosen, why)
    return chosen, why


def agreed_newest(root: Path, ranks: storage.Ranks, what: str, *, named: bool = False) -> tuple[Path | None, str, int]:
    """Rank 0's choice under ``root`` (:func:`.retention.choose`; ``named``: ``root`` is itself a checkpoint,
    as rank 0 sees it), why, and the membership generation its record names, the same on every rank; a root
    rank 0 refuses raises alike on every rank."""
    found: list[Any] = [None, "", None, 0]
    if ranks.first:
        try:
            newest, why = (root, f"{root} was named") if named else retention.choose(root)
            found = [None if newest is None else str(newest), why, None, mf.generation_of(newest, META)]
        except CheckpointError as err:
            found = [None, "", str(err), 0]
    chosen, why, refused, generation = storage.gather(found, ranks, what)[0]
    if refused is not None:
        raise CheckpointError(refused)
    return (None if chosen is None else Path(chosen)), why, int(generation)
