"""The first train step's check that a pipeline's ranks were given one batch (runtime/engine/given_batches.py):
the decision on what every rank reported, without processes (tests/distributed/workers/runtime_checks.py's
``ranks-given-unlike-batches`` runs it on 2 ranks)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from stagewise.runtime.engine import given_batches


def _decide(monkeypatch: pytest.MonkeyPatch, given: list[tuple[Any, Any]], me: int = 0) -> str | None:
    """``unlike_batches`` on rank ``me`` of a group whose ranks were given ``given``: its words, and that the
    group's first rank alone warns them."""
    reported = [[given_batches._finite(given_batches.fingerprint(v)) for v in pair] for pair in given]
    monkeypatch.setattr(given_batches.collectives, "gather_json", lambda mine, *a: reported)
    monkeypatch.setattr(given_batches.groups, "group_rank", lambda group: me)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said = given_batches.unlike_batches(*given[me], group=None, wait=None)
    assert [str(w.message) for w in caught] == ([said] if said is not None and me == 0 else [])
    return said


def test_ranks_given_one_batch_or_nothing_are_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = torch.randn(6, 3, generator=torch.Generator().manual_seed(0)), torch.arange(6)
    assert _decide(monkeypatch, [(x, y), (x.clone(), y.clone()), (x, y)]) is None  # equal values: one batch
    assert _decide(monkeypatch, [(x, None), (None, None), (None, y)]) is None  # each rank what it reads
    assert _decide(monkeypatch, [({"ids": y, "mask": x > 0}, y), (None, y)]) is None  # nested values


def test_ranks_given_different_samples_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)
    said = _decide(monkeypatch, [(a, None), (None, None), (b, None)])
    assert said is not None and said.startswith("pipeline ranks 0 and 2 were given different inputs")
    assert "DistributedSampler(num_replicas=pipe.num_replicas, rank=pipe.replica)" in said
    said = _decide(monkeypatch, [(a, None), (a, a[:, 0]), (a, b[:, 0])], me=2)  # said on every rank, warned on 0
    assert said is not None and said.startswith("pipeline ranks 1 and 2 were given different targets")
    assert _decide(monkeypatch, [(a, None), (a.flip(0), None)]) is not None  # the same numbers in another order


def test_a_large_tensor_is_read_through_an_even_sample() -> None:
    g = torch.Generator().manual_seed(2)
    big = torch.randn(given_batches.SAMPLED * 3 + 1, generator=g)
    assert given_batches.fingerprint(big) == given_batches.fingerprint(big.clone())
    assert given_batches.fingerprint(big) != given_batches.fingerprint(big + 1e-3)  # another batch differs throughout
    assert given_batches.fingerprint(big.view(-1, 1)) == given_batches.fingerprint(big)  # (its shape aside)
