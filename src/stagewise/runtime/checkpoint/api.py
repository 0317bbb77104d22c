"""``save`` and ``load``: the checkpoint of a pipeline (or a plain module), collective over its ranks.

A save, on every rank of the mesh (or pipeline group):

1. gathers what rank 0 records (names and shapes, optimizer hyper-parameters, every rank's RNG);
2. rank 0 makes ``ROOT/.step-N.tmp``; every rank writes its share of the tensors there with DCP;
3. a barrier with a deadline: every rank has finished writing;
4. the files are hashed, each rank a share; rank 0 writes ``stagewise.json`` (JSON, no pickle), then
   ``MANIFEST.json`` last, and renames the folder to ``ROOT/step-N``; old ones beyond ``keep`` go.

A load verifies before it touches anything: every rank hashes a share of the
files and the verdicts are gathered (a shared file system is assumed, as DCP
assumes it), then each rank checks the names and shapes it needs against the
checkpoint and the problems are gathered again, so either every rank raises
the same error or every rank loads. Spreading the hashing costs each rank
``1/world`` of the reading; deciding together keeps a rank from entering DCP's
collectives while another has given up.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._util import is_count
from . import agreement, retention, state, storage
from . import manifest as mf
from .manifest import CheckpointError

META = "stagewise.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` restored, and what it read about the run that saved it.

    ``extra``: the ``extra=`` dict given to :func:`save` (e.g. the data position).
    ``layout``: how the model was laid out (world size, pipeline ranks, schedule,
    placement, layer ranges, parallel degrees). ``rng_restored``: the RNG states
    are per rank, so they are restored only when the number of ranks is the same.
    """

    path: Path
    step: int
    extra: Any
    layout: dict[str, Any]
    versions: dict[str, str]
    optimizer_restored: bool
    scheduler_restored: bool
    rng_restored: bool


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
    ``timeout``: seconds every rank may take to finish writing.
    ``collective=False`` saves a plain module from this process alone (a
    Pipeline is always saved by all its ranks). Returns the checkpoint's folder.
    """
    if not is_count(step, 0):
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    part = virtual_worker(model, path)
    if part is not None:  # a HetPipe: each virtual worker saves its own pipeline, under ROOT/vwK
        folder, pipe, mine = part
        wrapped = {"virtual_worker": mine, "extra": extra}
        return save(folder, pipe, optimizer, step=step, extra=wrapped, scheduler=scheduler, keep=keep, timeout=timeout)
    retention.check_keep(keep)
    root = Path(path)
    ranks = _ranks(model, collective)
    tensors, mine = _contribution(model, optimizer, scheduler, extra, ranks)
    everyone = storage.gather(mine, ranks)
    staging, final = retention.staging_for(root, step), retention.folder_for(root, step)
    storage.agree(_staged(staging, everyone, ranks), ranks, f"cannot start checkpoint {final}")
    storage.save_tensors(tensors, staging, ranks)
    storage.barrier(ranks, timeout, f"finished writing checkpoint {final}")
    files = mf.files_of(staging)
    hashed = storage.gather(mf.digests(staging, mf.share(files, ranks.rank, ranks.size)), ranks)
    problems = []
    if ranks.first:
        try:
            _publish(staging, final, _record(everyone, model, ranks, step), hashed)
            retention.prune(root, keep, final)
        except (OSError, CheckpointError) as err:
            problems.append(f"cannot publish {final}: {err}")
    storage.agree(problems, ranks, f"checkpoint {final} was not saved")
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
        except OSError as err:
            problems.append(f"cannot make {staging}: {err}")
    return problems


def _publish(staging: Path, final: Path, record: dict[str, Any], hashed: list[dict[str, dict[str, object]]]) -> None:
    """Rank 0: ``stagewise.json``, then ``MANIFEST.json`` last (its presence means complete), then the rename."""
    mf.write_durably(staging / META, json.dumps(record, indent=1, allow_nan=True))
    digests = {name: d for share in hashed for name, d in share.items()}
    digests[META] = mf.digest(staging / META)
    mf.write_manifest(staging, digests)  # last: its presence means complete
    retention.publish(staging, final)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    collective: bool = True,
) -> CheckpointInfo:
    """Verify the checkpoint at ``path`` (a ``step-N`` folder, or a root: its :func:`latest`) and load it.

    A collective, like :func:`save`. The layout may differ from the saving
    run's: another pipeline degree, partition, schedule or placement,
    other dp/sharding/tp degrees, or one process (``sw.build_model``). The
    model's names and shapes must match the checkpoint's (``strict=False``:
    only the names both have are loaded). ``optimizer``: as for :func:`save`; a
    Pipeline's own optimizers are loaded when the checkpoint has optimizer
    state, and left as they are when it has none (a model-only "seed" checkpoint).
    Raises :class:`CheckpointError` on every rank, before anything is changed,
    if the checkpoint is partial, corrupted, or for another model.
    ``collective=False`` loads a plain module in this process alone (e.g. on
    one rank of a running job).
    """
    if virtual_worker(model, path) is not None:
        return _load_virtual_worker(path, model, optimizer, scheduler=scheduler, strict=strict, restore_rng=restore_rng)
    ranks = _ranks(model, collective)
    folder = _resolve(Path(path), ranks)
    record = _verified(folder, ranks)
    optimizers = state.optimizers_of(model, optimizer)
    if optimizers and record.get("optimizer") is None and optimizer is None:
        optimizers = []  # the pipeline's own optimizers stay fresh: a model-only checkpoint
    targets = {state.MODEL + k: v for k, v in state.load_targets(model).items()}
    problems = _check_model(record, targets, ranks, strict)
    if not strict:
        targets = {k: v for k, v in targets.items() if k in record["tensors"]}
    names = state.parameter_names(model)
    opt_targets, found = _optimizer_targets(record, optimizers, names, ranks, strict)
    problems += found
    storage.agree(problems, ranks, f"checkpoint {folder} does not fit this model")
    storage.load_tensors({**targets, **opt_targets}, folder, ranks)
    if optimizers:
        state.restore_optimizers(optimizers, names, record, opt_targets)
    scheduler_restored = _restore_schedulers(scheduler, record)
    rng_restored = restore_rng and record["layout"]["world"] == ranks.size
    if rng_restored:
        state.set_rng_state(record["rng"][ranks.rank])
    return CheckpointInfo(
        path=folder,
        step=record["step"],
        extra=state.decode(record["extra"]),
        layout=record["layout"],
        versions=record["versions"],
        optimizer_restored=bool(optimizers),
        scheduler_restored=scheduler_restored,
        rng_restored=rng_restored,
    )


def _restore_schedulers(scheduler: Any, record: dict[str, Any]) -> bool:
    """Load the saved scheduler state into every scheduler given; whether there was one to load."""
    if scheduler is None or record.get("scheduler") is None:
        return False
    for s in _all(scheduler):
        s.load_state_dict(state.decode(record["scheduler"]))
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
    """For a model made of virtual workers (:class:`~stagewise.HetPipe`): where this rank's worker keeps its
    checkpoints under ``path``, its pipeline, and the state of the rule it saves beside it; else None."""
    part = getattr(model, "checkpoint_part", None)
    return None if part is None else part(Path(path))


def latest(path: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``path`` (see :func:`stagewise.checkpoint.load`), or None."""
    return retention.latest(path)


# ---- helpers --------------------------------------------------------------------------------
def _ranks(model: Any, collective: bool) -> storage.Ranks:
    if state.is_pipeline(model):
        if not collective:
            raise ValueError("collective=False is for a plain module: every rank of a Pipeline saves and loads it")
        return storage.pipeline_ranks(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a stagewise.Pipeline or an nn.Module, got {type(model).__name__}")
    return storage.module_ranks(collective)


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
    import stagewise

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
    return {
        "step": step,
        "extra": everyone[0]["extra"],
        "scheduler": everyone[0]["scheduler"],
        "layout": state.layout_of(model, ranks.size),
        "versions": {"stagewise": stagewise.__version__, "torch": torch.__version__},
        "tensors": dict(sorted(tensors.items())),
        "optimizer": optimizer,
        "rng": [mine["rng"] for mine in everyone],
    }


def _resolve(path: Path, ranks: storage.Ranks) -> Path:
    """The checkpoint folder: ``path`` itself if it is one, else the newest complete one under it (rank 0 decides)."""
    found = None
    if ranks.first:
        if (path / mf.MANIFEST).exists() or (path / META).exists():
            found = str(path)
        else:
            newest = retention.latest(path)
            found = None if newest is None else str(newest)
    chosen = storage.gather(found, ranks)[0]
    if chosen is None:
        if path.is_dir() and any(path.glob("step-*")):
            raise CheckpointError(f"no complete checkpoint under {path}: every step-* folder lacks its {mf.MANIFEST}")
        raise CheckpointError(f"no checkpoint at {path}: neither a checkpoint folder nor a folder holding step-* ones")
    return Path(chosen)


def _verified(folder: Path, ranks: storage.Ranks) -> dict[str, Any]:
    """Check the manifest and every file's digest (each rank a share, verdicts gathered); the JSON record."""
    problems: list[str] = []
    expected: dict[str, Any] = {}
    try:
        expected = mf.read_manifest(folder)
    except CheckpointError as err:
        problems.append(str(err))
    storage.agree(problems, ranks, f"refusing checkpoint {folder}")
    problems = mf.check_files(folder, expected, mf.share(sorted(expected), ranks.rank, ranks.size))
    if ranks.first:
        problems += mf.unlisted(folder, expected)
        if META not in expected:
            problems.append(f"the manifest of {folder} does not list {META}")
    storage.agree(problems, ranks, f"refusing checkpoint {folder}")
    record: dict[str, Any] = json.loads((folder / META).read_text())
    return record


def _optimizer_targets(
    record: dict[str, Any],
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
    ranks: storage.Ranks,
    strict: bool,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The optimizer state tensors this rank loads, and the problems: no state saved, names missing on either side
    (saved names no optimizer on any rank holds: gathered)."""
    saved = record.get("optimizer")
    targets: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    if optimizers and saved is None:
        problems.append("the checkpoint holds no optimizer state (it was saved without an optimizer)")
    elif optimizers:
        targets, found = state.optimizer_targets(optimizers, names, record)
        problems += found if strict else []
    held = {names[id(p)] for opt in optimizers for g in opt.param_groups for p in g["params"]}
    everyone = storage.gather(sorted(held), ranks)
    if saved is not None and strict and any(everyone) and ranks.first:
        covered = set().union(*map(set, everyone))
        problems += [
            f"the checkpoint has optimizer state for {n!r}, which no optimizer here holds"
            for n in sorted(set(saved["params"]) - covered)
        ]
    return targets, problems


def _check_model(
    record: dict[str, Any], targets: dict[str, torch.Tensor], ranks: storage.Ranks, strict: bool
) -> list[str]:
    """Missing names, extra names (over every rank's), and shape or dtype mismatches."""
    saved = record["tensors"]
    problems = []
    for key, t in targets.items():
        name = key[len(state.MODEL) :]
        if key not in saved:
            if strict:
                problems.append(f"tensor {name!r} of the model is missing from the checkpoint")
            continue
        want = state.describe({key: t})[key]
        if saved[key] != want:
            problems.append(
                f"tensor {name!r}: the checkpoint has shape {tuple(saved[key]['shape'])} {saved[key]['dtype']}, "
                f"the model {tuple(want['shape'])} {want['dtype']}"
            )
    everyone = storage.gather(sorted(targets), ranks)
    if strict and ranks.first:
        wanted = set().union(*map(set, everyone))
        problems += [
            f"tensor {k[len(state.MODEL) :]!r} is in the checkpoint but not in the model"
            for k in sorted(saved)
            if k.startswith(state.MODEL) and k not in wanted
        ]
    return problems
