"""Every rank of a pipeline built with the same options and the same schedule, or a clear error on every rank.

A rank built with other options than its peers (``microbatches=2`` on one rank, another schedule, another
partition, ``parallel=`` of another shape) runs another action list: it waits for messages the others never
send, and the job ends at the deadline blaming a peer that is only waiting too. So before any process group
of the pipeline is made, the ranks of its group (the world, with ``parallel=``) gather what each was given -
the options that shape the run, as plain values, and a digest of the schedule's action lists - and every
rank raises the same ``ValueError`` naming each option that differs and which ranks hold which value.

What may differ between ranks is left out: the device (each rank has its own), the process group and store
objects, the sample inputs, the timeout, an emulated slowdown, where each rank writes its metrics and how often it
logs (``metrics=``, ``progress=``: no rank waits on them), and callables (a loss or optimizer factory is
compared by its type only: two ranks cannot tell whether two functions compute the same).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from typing import Any

import torch

from ...ir import Schedule
from ..comm import collectives, groups
from ..comm.faults.guard import setup_guard
from ..options import Options

#: options each rank may set for itself (``emulate_slowdown``: a float slows this rank alone)
_OWN = frozenset(
    {"device", "group", "store", "sample_inputs", "timeout", "emulate_slowdown", "metrics", "progress", "given"}
)


def check_same_build(entry: str, options: Options, schedule: Schedule, model: Any = None) -> None:
    """Raise ``ValueError`` on every rank of the pipeline's group when its ranks were given different options
    or schedules (a collective over that group, bounded by ``options.timeout``); warn when the ``model`` each
    was given (``from_model``, ``from_hf``) holds other weights (:func:`weights_differ`)."""
    group = None if options.parallel is not None else options.group
    groups.require_initialized()
    if groups.group_size(groups.group_or_world(group)) == 1:
        return
    mine = {"options": described(options), "schedule": schedule_digest(schedule), "weights": fingerprints(model)}
    waits = setup_guard(options.timeout, options.store)
    try:
        everyone = collectives.gather_json(mine, group, waits.wait, f"every rank's options ({entry})")
    finally:
        waits.close()
    problems = differences([e["options"] for e in everyone])
    if not problems and len({e["schedule"] for e in everyone}) > 1:
        held = _who_holds([e["schedule"] for e in everyone])
        problems = [f"the schedule's action lists differ ({held})"]
    if problems:
        raise ValueError(
            f"{entry}: the ranks were built with different options: {'; '.join(problems)}. Every rank must build "
            "its pipelines with the same options, in the same order (ranks running different action lists would "
            "wait for each other until the deadline)"
        )
    differ = weights_differ([e["weights"] for e in everyone])
    if differ and groups.global_rank() == 0:
        warnings.warn(f"{entry}: {differ}", stacklevel=3)


def fingerprints(model: Any) -> dict[str, str]:
    """Per parameter of a model given whole on every rank, a short digest of up to 16 of its values spread over
    it (exact values: no sum, so alike on any device); none for a freed (meta) one, or without a model."""
    if not isinstance(model, torch.nn.Module):
        return {}
    named = [(n, p) for n, p in model.named_parameters() if not p.is_meta and p.numel()]
    if not named:
        return {}
    picks = [p.detach().flatten()[:: max(1, p.numel() // 16)][:16].to(torch.float64) for _, p in named]
    values = torch.cat([v.cpu() for v in picks]).tolist()  # (a model may span devices; a float's repr is exact)
    out, at = {}, 0
    for (name, _), v in zip(named, picks):
        out[name] = hashlib.sha256(repr(values[at : at + v.numel()]).encode()).hexdigest()[:12]
        at += v.numel()
    return out


def weights_differ(everyone: list[dict[str, str]]) -> str:
    """What to say when the ranks' copies of the model hold other values for a parameter (each rank takes its
    stages from its own copy: the pipeline would train a mix no rank holds), or ""."""
    names = [n for n in everyone[0] if len({e[n] for e in everyone if n in e}) > 1]
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"the model given on each rank holds other weights on some ranks ({shown}): each rank takes its stages "
        "from its own copy, so the pipeline trains a mix that no rank's model holds. Seed before building it "
        "(torch.manual_seed on every rank) or load the same checkpoint everywhere; ignore this only if each rank "
        "loaded its own stages' weights itself"
    )


def described(options: Options) -> dict[str, Any]:
    """The options that shape the run, as JSON values (a Schedule by its name; a callable by its type)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.name not in _OWN:
            out[f.name] = _plain(getattr(options, f.name))
    return out


def schedule_digest(schedule: Schedule) -> str:
    """A digest of every rank's action list (what each rank will run, in order)."""
    actions = [[repr(a) for a in rank] for rank in schedule.ranks]
    text = json.dumps([schedule.name, schedule.num_microbatches, list(schedule.placement), actions])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(everyone: list[dict[str, Any]]) -> list[str]:
    """``name: ranks 0, 1, 3 have 4; rank 2 has 2`` for each option whose value is not alike on every rank."""
    out = []
    for name in everyone[0]:
        values = [json.dumps(e.get(name), sort_keys=True) for e in everyone]
        if len(set(values)) > 1:
            out.append(f"{name}: {_who_holds(values)}")
    return out


def _who_holds(values: list[str]) -> str:
    """``ranks 0, 1, 3 have 4; rank 2 has 2``, the largest group first."""
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        who = f"rank {ranks[0]} has" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)) + " have"
        parts.append(f"{who} {value}")
    return "; ".join(parts)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, Schedule):
        return f"Schedule {value.name!r}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    config = getattr(value, "config", value)  # a Mesh by its ParallelConfig
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        inside = ", ".join(f"{f.name}={_plain(getattr(config, f.name))}" for f in dataclasses.fields(config))
        return f"{type(config).__name__}({inside})"
    return f"<{type(value).__name__}>"
