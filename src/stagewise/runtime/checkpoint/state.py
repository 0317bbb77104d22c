"""What a checkpoint holds, by the one-process model's names: model tensors, optimizer state, RNG, layout.

Keys in the tensor file (flat, for DCP):

* ``model/NAME``: a parameter or buffer, NAME as in ``sw.build_model(...).state_dict()`` (without
  ``torch.compile``'s ``_orig_mod``: :func:`canonical`);
* ``optim/NAME/KEY``: a tensor of the optimizer state of parameter NAME (``exp_avg``, ``step``, ...).

A pipeline rank saves what its ``state_dict()`` holds: a tied module once,
where its first use is. It loads into every holder, including a rank that has
the module only for a later use (``Pipeline.tied_copies``, kept out of
``state_dict()``), so every copy is restored.

Optimizer state is keyed by parameter name, never by index: the index of a
parameter in a per-stage optimizer means different layers under different
layouts. Hyper-parameters (``lr``, ``betas`` ...) are recorded per parameter
name in the JSON metadata and given back to each param group on load.
"""

from __future__ import annotations

import base64
import random
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .declared import PipelineState, progress_of, restore_progress
from .manifest import CheckpointError
from .recorded_cut import partition_mode

MODEL, OPTIM = "model/", "optim/"


# ---- the model ------------------------------------------------------------------------------
def canonical(name: str) -> str:
    """``name`` without ``torch.compile``'s wrapper (an ``OptimizedModule`` holds its module as ``_orig_mod``), as
    torch.distributed.checkpoint's state-dict helpers write it: what compiled layers save loads into the same
    layers uncompiled, and back."""
    return name if "_orig_mod" not in name else ".".join(part for part in name.split(".") if part != "_orig_mod")


def saved_tensors(target: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """What this rank writes of the model: its ``state_dict()`` (DTensors stay DTensors, so DCP writes shards;
    ``keep_vars``: the parameters themselves, which a snapshot's capture tells from the buffers it copies)."""
    return {canonical(k): t for k, t in target.state_dict(keep_vars=keep_vars).items()}


def load_targets(target: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The tensors this rank fills on load, by name: its ``state_dict()`` plus every tied copy it holds
    (``keep_vars``: the parameters and buffers themselves, not detached views, as ``state_dict`` takes it)."""
    out = saved_tensors(target, keep_vars)
    if not isinstance(target, PipelineState):
        return out
    for first, module in target.tied_copies.items():
        for inner, t in module.state_dict(keep_vars=keep_vars).items():
            out[canonical(tied_name(first, inner))] = t
    return out


def tied_name(first: str, inner: str) -> str:
    """The one-process name of a tied copy's tensor ``inner``: ``first`` is where the one-process model holds
    the module (``Pipeline.tied_copies`` keys: the first use, or ``first.module`` when it has a ``forward_fn``)."""
    return f"{first}.{inner}"


def describe(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``{name: {"shape": global shape, "dtype": "float64"}}`` (a DTensor's shape is the whole tensor's)."""
    return {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for name, t in tensors.items()}


# ---- optimizers -----------------------------------------------------------------------------
def optimizers_of(target: nn.Module, optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers to save or load: ``optimizer`` (one, a list, or a dict stage -> optimizer), or else the
    pipeline's own per-stage ones (``Pipeline(optimizer=factory)``)."""
    if optimizer is None:
        own = target.optimizers if isinstance(target, PipelineState) else None
        return [own[s] for s in sorted(own)] if own else []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    items = [optimizer[k] for k in sorted(optimizer)] if isinstance(optimizer, Mapping) else list(optimizer)
    for opt in items:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer= takes an Optimizer, a list or a dict of them; got a {type(opt).__name__}")
    return items


def parameter_names(target: nn.Module) -> dict[int, str]:
    """id(parameter) -> its one-process name, as ``named_parameters()`` gives it: a pipeline's lists a tied
    parameter under the name one process lists it by (its first name, on a rank that holds it under another
    only) and its tied copies under their first use (:func:`tied_name`), so the optimizer state of a tie is
    keyed alike on every rank and under every layout."""
    out: dict[int, str] = {}
    for name, p in target.named_parameters():
        out.setdefault(id(p), canonical(name))
    return out


def _name(names: Mapping[int, str], p: torch.Tensor) -> str:
    if id(p) not in names:
        raise CheckpointError(
            f"an optimizer holds a parameter of shape {tuple(p.shape)} that the model does not have: build the "
            "optimizer over the model's (or the pipeline's) parameters"
        )
    return names[id(p)]


def optimizer_state(
    optimizers: list[torch.optim.Optimizer], names: Mapping[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (``optim/NAME/KEY``) and JSON metadata (hyper-parameters and other state, per NAME)."""
    tensors: dict[str, torch.Tensor] = {}
    params: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            hyper = encode({k: v for k, v in group.items() if k != "params"}, "optimizer param group")
            for p in group["params"]:
                name = _name(names, p)
                params[name] = hyper
                entries: dict[str, Any] = {}
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):  # (detached only if it needs it: ~465 per snapshot)
                        tensors[f"{OPTIM}{name}/{key}"] = value.detach() if value.requires_grad else value
                        entries[key] = {"tensor": True}
                    else:
                        entries[key] = {"value": encode(value, f"optimizer state {key!r} of {name}")}
                if entries:
                    state[name] = entries
    classes = sorted({type(opt).__name__ for opt in optimizers})  # (a resume into another optimizer is refused)
    return tensors, {"params": params, "state": state, "classes": classes}


def optimizer_targets(
    optimizers: list[torch.optim.Optimizer], names: Mapping[int, str], saved: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Empty tensors for the optimizer state this rank loads, shaped as saved (a DTensor like its parameter
    when the shapes agree, so DCP reshards it), and the problems found (missing names)."""
    tensors: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    described = saved["tensors"]
    classes = saved["optimizer"].get("classes")  # (None: saved before they were recorded)
    for opt in optimizers:
        if classes and type(opt).__name__ not in classes:
            problems.append(
                f"the checkpoint's optimizer state is {' and '.join(classes)}'s, and this optimizer is "
                f"{type(opt).__name__}: it would take another optimizer's state and hyper-parameters; build the "
                "optimizer the saved run used, or load the model alone (optimizer=[])"
            )
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                name = _name(names, p)
                if name not in saved["optimizer"]["params"]:
                    problems.append(f"the checkpoint has no optimizer entry for parameter {name!r}")
                    continue
                for key, entry in saved["optimizer"]["state"].get(name, {}).items():
                    if "tensor" not in entry:
                        continue
                    full = f"{OPTIM}{name}/{key}"
                    meta = described[full]
                    dtype = getattr(torch, meta["dtype"])
                    if list(p.shape) == meta["shape"]:
                        tensors[full] = torch.empty_like(p, dtype=dtype)
                    else:
                        local = p.to_local() if hasattr(p, "to_local") else p
                        tensors[full] = torch.empty(meta["shape"], dtype=dtype, device=local.device)
    return tensors, problems


def restore_optimizers(
    optimizers: list[torch.optim.Optimizer],
    names: Mapping[int, str],
    saved: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Give each optimizer its state and hyper-parameters back, through its own ``load_state_dict``."""
    for opt in optimizers:
        current = opt.state_dict()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for group, index_group in zip(opt.param_groups, current["param_groups"]):
            hyper = None
            for p, index in zip(group["params"], index_group["params"]):
                name = _name(names, p)
                if name not in saved["optimizer"]["params"]:  # (strict=False) not in the checkpoint: left fresh
                    continue
                mine = saved["optimizer"]["params"][name]
                if hyper is not None and mine != hyper[1]:
                    raise CheckpointError(
                        f"parameters {hyper[0]!r} and {name!r} share a param group but were saved with different "
                        "hyper-parameters: group the parameters as the saved run did"
                    )
                hyper = hyper or (name, mine)
                entries = {}
                for key, entry in saved["optimizer"]["state"].get(name, {}).items():
                    entries[key] = tensors[f"{OPTIM}{name}/{key}"] if "tensor" in entry else decode(entry["value"])
                if entries:
                    state[index] = entries
            restored = dict(index_group)
            if hyper is not None:
                restored.update(decode(hyper[1]))
            groups.append(restored)
        opt.load_state_dict({"state": state, "param_groups": groups})


# ---- JSON values ----------------------------------------------------------------------------
def encode(value: Any, what: str) -> Any:
    """A JSON value that :func:`decode` turns back into ``value`` (tuples and scalar tensors tagged)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, what) for v in value]}
    if isinstance(value, list):
        return [encode(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode(v, what) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not hasattr(value, "to_local"):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"__tensor__": value.item(), "dtype": dtype, "shape": list(value.shape)}
    raise CheckpointError(f"{what}: cannot store a {type(value).__name__} ({value!r:.60}) as JSON")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
        return {k: decode(v) for k, v in value.items()}
    return value


# ---- random number generators ---------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's generators: torch CPU, every CUDA device (if CUDA is up), Python's, NumPy's (if loaded)."""
    return rng_encoded(rng_taken())


def rng_taken() -> dict[str, Any]:
    """The generators' states as they come (copies: nothing later changes them), for :func:`rng_encoded`
    elsewhere - a snapshot takes them on the step's thread and encodes them on its helper."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state(legacy=True)
    return out


def rng_encoded(taken: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`rng_taken`'s states as JSON (what :func:`set_rng_state` reads)."""
    out: dict[str, Any] = {"torch": _b64(taken["torch"])}
    if "cuda" in taken:
        out["cuda"] = [_b64(s) for s in taken["cuda"]]
    version, internal, gauss = taken["python"]
    out["python"] = [version, list(internal), gauss]
    if "numpy" in taken:
        kind, keys, pos, has_gauss, cached = taken["numpy"]
        out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]  # (Python ints)
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")  # (a uint8 tensor's bytes; not per element)


def _unb64(s: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(s)), dtype=torch.uint8)


# ---- the layout -----------------------------------------------------------------------------
def layout_of(target: object, world: int) -> dict[str, Any]:
    """How the model was laid out when saved (for the record, and to tell whether RNG states still apply)."""
    if not isinstance(target, PipelineState):
        return {"world": world, "pipeline": None}
    s = target.schedule
    out: dict[str, Any] = {
        "world": world,
        "pipeline": {
            "ranks": s.num_ranks,
            "schedule": s.name,
            "microbatches": s.num_microbatches,
            "virtual_stages": s.virtual_stages,
            "placement": list(s.placement),
            "layers": [[r.start, r.stop] for r in target.layer_ranges],
            "partition": partition_mode(getattr(target.options, "partition", None), target.replanned_cut),
        },
        "parallel": None,
    }
    if target.hybrid is not None:
        c = target.hybrid.config
        out["parallel"] = {"pp": c.pp, "dp": c.dp, "sharding": c.sharding, "tp": c.tp}
    return out


def dropout_of(target: object, train_steps: int | None = None) -> dict[str, int] | None:
    """A pipeline's dropout seed and its count of trained mini-batches (``train_steps``, else the pipeline's
    own), the step of its masks' seeds: a resumed run draws the masks it would have (not a layout: the same on
    every rank and under any layout, restored whatever the layout). None for another model."""
    if not isinstance(target, PipelineState):
        return None
    progress = progress_of(target)
    steps = progress.train_steps if train_steps is None else train_steps
    return {"train_steps": int(steps), "seed": progress.dropout_seed}


def restore_dropout(target: object, saved: dict[str, int] | None) -> None:
    """A pipeline's dropout seed and trained mini-batches as :func:`dropout_of` saved them (if it did)."""
    if saved is None or not isinstance(target, PipelineState):
        return
    now = progress_of(target)
    restore_progress(target, replace(now, train_steps=saved["train_steps"], dropout_seed=saved["seed"]))


def scheduler_state(target: object) -> Any:
    """A pipeline's own LR schedule (``lr_scheduler=``: its schedulers step in lockstep, so the first one's state,
    JSON as a checkpoint records it, holds their common position), or None."""
    schedulers = target.schedulers if isinstance(target, PipelineState) else {}
    return encode(schedulers[min(schedulers)].state_dict(), "the LR scheduler's state") if schedulers else None


def restore_scheduler(target: object, saved: Any) -> bool:
    """Load :func:`scheduler_state`'s ``saved`` into every scheduler of ``target`` (nothing when None), each keeping
    its own stage's learning rates (:func:`restore_position`); whether some scheduler took it."""
    if saved is None or not isinstance(target, PipelineState) or not target.schedulers:
        return False
    restore_position(list(target.schedulers.values()), decode(saved))
    return True


# A scheduler's entries that belong to its own optimizer's param groups, not to the lockstep position: the base
# LRs its stage's optimizer was built with (``initial_lr``), a cycle's bounds, a plateau's floors, its lambdas.
OWN_ENTRIES = ("base_lrs", "max_lrs", "min_lrs", "lr_lambdas")


def restore_position(schedulers: list[Any], saved: dict[str, Any]) -> None:
    """Give schedulers in lockstep the position one of them saved (``last_epoch``, step counts, a plateau's count)
    while each keeps what is its own stage's: the entries of :data:`OWN_ENTRIES` and, as its last LRs, its
    optimizer's LRs (restored by parameter name before it). Loading one stage's whole state into another would
    give every stage the first stage's base LRs, wrong where stages were built with different ones."""
    for scheduler in schedulers:
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None) or []
        scheduler.load_state_dict(_positioned(scheduler.state_dict(), saved, groups))


def _positioned(own: dict[str, Any], saved: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(saved)
    out.update({key: own[key] for key in OWN_ENTRIES if key in own})
    if groups and "base_lrs" in own and all("initial_lr" in g for g in groups):
        out["base_lrs"] = [g["initial_lr"] for g in groups]  # as the optimizer's restore gave them back
    if groups and "_last_lr" in own:
        out["_last_lr"] = [g["lr"] for g in groups]
    inner, theirs = own.get("_schedulers"), saved.get("_schedulers")  # SequentialLR, ChainedScheduler
    if isinstance(inner, list) and isinstance(theirs, list) and len(inner) == len(theirs):
        out["_schedulers"] = [_positioned(o, t, groups) for o, t in zip(inner, theirs)]
    return out


def refuse_merging(model: object, what: str) -> None:
    """A pipeline in the middle of a gradient merge (``no_sync()``) is refused, alike on every rank, before any rank
    communicates: a checkpoint holds no gradients, and the merged steps' partial sums (each replica's its own, not
    yet reduced) would be lost on save, or added to the loaded weights' next step on load."""
    pending = model.merged_steps if isinstance(model, PipelineState) else 0
    if pending:
        raise CheckpointError(
            f"cannot {what} a checkpoint in the middle of a gradient merge: {pending} train_step"
            f"{'s' if pending != 1 else ''} under no_sync() accumulated gradients that no reduction or optimizer "
            f"step has used, and a checkpoint holds none; {what} after the train_step outside no_sync() that ends "
            "the merge"
        )
