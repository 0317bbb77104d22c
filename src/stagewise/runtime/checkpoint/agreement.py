"""Replicas must agree before one of them is written: a digest per replicated tensor, compared across ranks.

DCP writes a name held by several ranks (data-parallel replicas, the copies
of a tied module) once, from one rank, without looking at the others: if the
replicas have drifted apart (a missed gradient sync, a rank that stepped
twice), the checkpoint silently keeps one of them and the run that loads it
differs from the run that saved it. Each rank hashes its whole, unsharded
tensors (a DTensor's shards are its own, not copies: skipped), rank 0 compares
the digests of every name held more than once, and the save is refused,
naming the tensor and which ranks hold which value. Hashing costs about what
the manifest's hashing of the written files does.
"""

from __future__ import annotations

import hashlib

import torch


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """A short digest of every plain tensor's bytes (dtype and shape are compared elsewhere)."""
    out = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or _is_dtensor(t):
            continue
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        out[name] = hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()
    return out


def disagreements(everyone: list[dict[str, str]], limit: int = 10) -> list[str]:
    """One problem per name whose copies differ between ranks, naming the ranks that hold each value."""
    holders: dict[str, dict[str, list[int]]] = {}
    for rank, mine in enumerate(everyone):
        for name, digest in mine.items():
            holders.setdefault(name, {}).setdefault(digest, []).append(rank)
    problems = []
    for name in sorted(holders):
        values = holders[name]
        if len(values) > 1:
            groups = " vs ".join(
                ("ranks " if len(rs) > 1 else "rank ") + ", ".join(map(str, rs)) for rs in values.values()
            )
            shown = name.removeprefix("model/")
            problems.append(f"tensor {shown!r} differs between its copies ({groups}): the replicas diverged")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more tensors"]
    return problems


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"
