"""The first train step's check that a pipeline's ranks were given one batch.

Stage 0's rank reads the inputs and the last stage's the targets, so two ranks of one pipeline handed different
samples - a ``DistributedSampler`` over every process, as DDP is fed - train inputs against another batch's
targets, and nothing else could tell. On the first train step every rank fingerprints what it was given
(:func:`fingerprint`; nothing for what it was not) and the pipeline group gathers the numbers in one small
collective: ranks given inputs (or targets) that differ are named in a warning. Later steps pay nothing. (The
data-parallel replicas, which must differ, check the opposite: :mod:`..hybrid.replica_inputs`.)
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..comm import collectives, groups
from .tree import flatten

#: the most numbers of one tensor a fingerprint reads: a batch of images would otherwise be copied whole to float64
SAMPLED = 1 << 20


def fingerprint(value: Any) -> float | None:
    """A number that differs, almost surely, between two different values and is equal, bit for bit, for equal
    ones (the same arithmetic on the same numbers); None without a real tensor in ``value``. Each number is
    weighted by its position; of a tensor over :data:`SAMPLED` numbers, an evenly strided sample is read."""
    if value is None:
        return None
    total, found = 0.0, False
    for k, leaf in enumerate(flatten(value)[0]):
        if not isinstance(leaf, torch.Tensor) or leaf.is_complex():
            continue
        found = True
        flat = leaf.detach().reshape(-1)
        flat = flat[:: max(1, -(-flat.numel() // SAMPLED))].to(torch.float64)  # (a large one: an evenly strided sample)
        weights = torch.cos(torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) * 0.618 + k)
        total += float((flat * weights).sum()) + flat.numel() * (k + 1)
    return total if found else None


def unlike_batches(inputs: Any, targets: Any, group: Any, wait: Any) -> str | None:
    """Every rank of the pipeline ``group``: the words for two of them given different inputs, or different
    targets (a rank given None for either is left out of it), warned on the group's first rank; None when they
    agree. A warning, not a refusal: only the unread copies can disagree, and a script may fill those with
    anything (a placeholder), so the sign is strong but not a proof."""
    mine = [_finite(fingerprint(inputs)), _finite(fingerprint(targets))]
    everyone = collectives.gather_json(mine, group, wait, "what every rank was given to train")
    for k, what in enumerate(("inputs", "targets")):
        given = [(r, f[k]) for r, f in enumerate(everyone) if f[k] is not None]
        for rank, value in given[1:]:
            first, seen = given[0]
            if not math.isclose(value, seen, rel_tol=1e-9, abs_tol=1e-9):
                text = (
                    f"pipeline ranks {first} and {rank} were given different {what} on the first train step: stage "
                    "0's rank reads the inputs and the last stage's the targets, so ranks fed different samples (a "
                    "DistributedSampler over every process, as DDP is fed) train inputs against another batch's "
                    "targets. Give the pipeline's ranks one batch (one loader, one seed; None where a rank reads "
                    "nothing) and shard only over the data-parallel replicas (pipe.local_batch, or "
                    "DistributedSampler(num_replicas=pipe.num_replicas, rank=pipe.replica))"
                )
                if groups.group_rank(group) == 0:
                    warnings.warn(text, stacklevel=4)
                return text
    return None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
