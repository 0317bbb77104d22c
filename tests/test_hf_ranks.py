"""``Pipeline.from_hf`` on 2 and 4 gloo ranks (issue 15): GPT-2, Llama (untied and tied), Mistral and Qwen2 against
the one-process model under every schedule at 2 ranks and a subset at 4; one torchrun job per rank count runs
tests/workers/hf_checks.py, each test asserts one check on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_checks import checks  # noqa: E402

from _mp import suites_by_ranks  # noqa: E402

CASES = [(ranks, name) for ranks in (2, 4) for name in checks(ranks)]

suites = suites_by_ranks("hf_checks", "hf", timeout=480)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_check(suites, ranks: int, name: str) -> None:
    suites(ranks).get(name)
