"""What a load checks before it changes anything: the files against the manifest, then the model against the record.

Each check is spread over the ranks and decided together (:func:`.storage.agree`), so either every rank
raises the same :class:`CheckpointError` or every rank goes on to load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import manifest as mf
from . import state, storage

META = "stagewise.json"


def verified(folder: Path, ranks: storage.Ranks) -> dict[str, Any]:
    """Check the manifest and every file's digest (each rank a share, verdicts gathered); the JSON record."""
    problems: list[str] = []
    expected: dict[str, Any] = {}
    try:
        expected = mf.read_manifest(folder)
    except mf.CheckpointError as err:
        problems.append(str(err))
    storage.agree(problems, ranks, f"refusing checkpoint {folder}")
    problems = mf.check_files(folder, expected, mf.share(sorted(expected), ranks.rank, ranks.size))
    if ranks.first:
        problems += mf.unlisted(folder, expected)
        if META not in expected:
            problems.append(f"the manifest of {folder} does not list {META}")
    storage.agree(problems, ranks, f"refusing checkpoint {folder}", patient=True)  # behind the others' hashing
    record: dict[str, Any] = json.loads((folder / META).read_text())
    return record


def optimizer_targets(
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
    everyone = storage.gather(sorted(held), ranks, "the parameters every rank's optimizers hold")
    if saved is not None and strict and any(everyone) and ranks.first:
        covered = set().union(*map(set, everyone))
        problems += [
            f"the checkpoint has optimizer state for {n!r}, which no optimizer here holds"
            for n in sorted(set(saved["params"]) - covered)
        ]
    return targets, problems


def check_model(
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
        if saved[key] != want and saved[key]["shape"] == want["shape"]:
            problems.append(
                f"tensor {name!r}: the checkpoint holds it in {saved[key]['dtype']}, the model in {want['dtype']} "
                f"(the same shape, {tuple(want['shape'])}): build the model in {saved[key]['dtype']} to load it"
            )
        elif saved[key] != want:
            problems.append(
                f"tensor {name!r}: the checkpoint has shape {tuple(saved[key]['shape'])} {saved[key]['dtype']}, "
                f"the model {tuple(want['shape'])} {want['dtype']}"
            )
    everyone = storage.gather(sorted(targets), ranks, "the tensors every rank loads")
    if strict and ranks.first:
        wanted = set().union(*map(set, everyone))
        problems += [
            f"tensor {k[len(state.MODEL) :]!r} is in the checkpoint but not in the model"
            for k in sorted(saved)
            if k.startswith(state.MODEL) and k not in wanted
        ]
    return problems
