"""A snapshot file checked where a resume uses it (``recover._check``): a file replaced since it was listed is
refused - by another step, and by the same step redone in a later membership generation (an in-place job redoes
the step in flight at the new layout: same lineage, step and owner, other bytes)."""

from __future__ import annotations

import torch

from stagewise.runtime.elastic.choose import Copy
from stagewise.runtime.elastic.recover import _check
from stagewise.runtime.elastic.snapshot_file import fill_payload, header_bytes, layout_payload


def encode(step: int, generation: int) -> bytes:
    ts = {"model/w": torch.arange(6, dtype=torch.float64).reshape(2, 3) + generation}
    entries, total = layout_payload(ts)
    buffer = torch.zeros(total, dtype=torch.uint8)
    fill_payload(buffer, ts, entries)
    header = {"step": step, "lineage": "ab12", "owner": 3, "generation": generation, "tensors": entries}
    return header_bytes(header, buffer) + buffer.numpy().tobytes()


def listed(step: int, generation: int) -> Copy:
    return Copy("m0", 0, "/shm/x", "ab12", step, 3, 4, None, frozenset({"model/w"}), membership=generation)


def checked(data: bytes, c: Copy) -> tuple[dict[tuple[str, str], object], list[list[str]]]:
    got: dict[tuple[str, str], object] = {}
    problems: list[list[str]] = []
    _check(c, memoryview(data), got, problems)  # type: ignore[arg-type]
    return got, problems


def test_the_file_that_was_listed_is_used() -> None:
    got, problems = checked(encode(7, 2), listed(7, 2))
    assert problems == [] and list(got) == [("m0", "/shm/x")]


def test_the_same_step_redone_by_a_later_generation_is_refused() -> None:
    got, problems = checked(encode(7, 3), listed(7, 2))
    assert got == {}
    assert problems == [["m0", "/shm/x", "it was replaced since it was listed (now step 7 of generation 3, "
                         "was step 7 of generation 2)"]]  # fmt: skip


def test_another_step_is_refused() -> None:
    got, problems = checked(encode(8, 2), listed(7, 2))
    assert got == {} and "now step 8" in problems[0][2]
