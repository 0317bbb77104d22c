"""One-process pieces of fault handling (issue 17): plain-data metadata, the store deadline, forensics text."""

from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch

from stagewise.ir import Action, Kind
from stagewise.runtime.comm.coordinator import DeadlineStore
from stagewise.runtime.engine.forensics import position
from stagewise.runtime.engine.messages import Meta
from stagewise.runtime.engine.tree import flatten, spec_from_plain, spec_to_plain, unflatten

Pair = namedtuple("Pair", ["h", "mask"])


def test_meta_round_trips_through_json_not_pickle() -> None:
    value = (
        {"x": torch.zeros(2, 3, dtype=torch.float64), 7: [torch.ones(1, dtype=torch.int64), "tag", None, 2.5]},
        Pair(torch.zeros(4, requires_grad=True), True),
    )
    meta, leaves = Meta.of(value)
    blob = meta.to_bytes("output")
    assert blob.startswith(b"{") and b"pickle" not in blob
    back = Meta.from_bytes(blob)
    assert back == meta  # spec (namedtuple type found again), shapes, dtypes, grad flags
    rebuilt = back.rebuild([torch.empty(s, dtype=d) for s, d in zip(back.shapes, back.dtypes)])
    assert isinstance(rebuilt[1], Pair) and rebuilt[1].mask is True and rebuilt[1].h.requires_grad
    assert rebuilt[0][7][1:] == ["tag", None, 2.5]
    assert unflatten(spec_from_plain(spec_to_plain(flatten(value)[1])), leaves)[0][7][1] == "tag"


def test_a_constant_json_cannot_carry_is_named() -> None:
    _, spec = flatten({"h": torch.zeros(1), "cfg": {"dtype": torch.float32}})
    with pytest.raises(TypeError, match=r"output\['cfg'\]\['dtype'\] holds a constant of type dtype"):
        spec_to_plain(spec, "output")


def test_an_unknown_namedtuple_from_a_peer_is_refused() -> None:
    with pytest.raises(TypeError, match="not a namedtuple among this rank's loaded modules"):
        spec_from_plain(["namedtuple", "os:system", []])


class _StuckStore:
    """A store whose ``check`` never answers (a stopped host), and whose ``get`` does."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.release.wait()
        return False

    def get(self, key: str) -> bytes:
        return b"value"


def test_a_store_call_that_never_returns_times_out_and_the_client_stays_refused() -> None:
    inner = _StuckStore()
    store = DeadlineStore(inner, timeout=0.2)
    with pytest.raises(TimeoutError, match=r"did not answer check\(\)"):
        store.check(["k"])
    with pytest.raises(TimeoutError, match="an earlier store call has not returned"):
        store.get("k")  # the helper is still stuck: no second call queues behind it
    inner.release.set()
    assert DeadlineStore(inner, timeout=5.0).get("k") == b"value"


def test_position_before_the_first_step_has_no_empty_plan() -> None:
    text = position(2, (), None, None, "the run id")
    assert text == "rank 2 before its first step, waiting for the run id"
    text = position(0, (Action(0, Kind.F, 0), Action(0, Kind.B, 0)), Action(0, Kind.B, 0), None, "")
    assert text.startswith("rank 0 at 0B0 (action 2 of 2; last completed: none)") and ">>0B0<<" in text
