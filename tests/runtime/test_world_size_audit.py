"""The world-size audit (issue 46; docs/design/elastic-membership.md): what runs on a re-layout's members asks
their group, not the world. In one process: the agreement on a plan is spied on."""

from __future__ import annotations

from typing import Any

import pytest

from stagewise.runtime.frontends import plan_agreement


class _Plan:
    def digest(self) -> str:
        return "d"

    def describe(self) -> str:
        return "pp=2"


def test_the_plan_agreement_asks_the_pipelines_group_not_the_world(
    one_rank: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipe.relayout([0, 1], plan=...)`` on four processes builds on ranks 0 and 1 only: a gather over the
    world would wait for ranks 2 and 3, which never come (they retire)."""
    members = object()  # the new layout's group (two of the world's four processes)
    sizes = {id(members): 2}
    asked: list[Any] = []
    monkeypatch.setattr(plan_agreement.groups, "world_size", lambda: 4)
    monkeypatch.setattr(plan_agreement.groups, "group_size", lambda g: sizes.get(id(g), 4))

    def gather(obj: Any, group: Any, wait: Any, what: str) -> list[Any]:
        asked.append(group)
        return [obj, obj]

    monkeypatch.setattr(plan_agreement.collectives, "gather_json", gather)
    plan_agreement.check_same_plan(_Plan(), "Pipeline.from_plan", 5.0, None, members)  # type: ignore[arg-type]
    assert asked == [members]
    sizes[id(members)] = 1  # a one-process layout agrees with nobody
    plan_agreement.check_same_plan(_Plan(), "Pipeline.from_plan", 5.0, None, members)  # type: ignore[arg-type]
    assert asked == [members]
