"""The torchtitan recipe (stagewise.interop.torchtitan) run through torch's own loader, as torchtitan runs it: the
class the recipe names decides the stages each rank builds (torchtitan's rule, written out here against torch's
class objects), torch's ``_PipelineScheduleRuntime`` is built with them and ``num_pp_microbatches``, and
``_load_csv(path)`` reads the file in its default format, compute_only. One process, stand-in stages.

And the other way: each wrong setting (a looped class for a one-stage-per-rank file, a looped class for a V file,
a compute_comms file, another micro-batch count) is one torch refuses or runs wrongly, and the checker names it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.interop import torchtitan_problems, torchtitan_settings
from stagewise.interop.torchtitan import CLASSES, ONE_STAGE, V_SHAPED, torchtitan_placement
from stagewise.runtime.interop import torch_pipelining_missing

pytestmark = pytest.mark.skipif(torch_pipelining_missing() is not None, reason=str(torch_pipelining_missing()))


def _synthesized(p: int, m: int, v: int) -> sw.Schedule:
    costs = sw.CostModel.uniform(p * v, forward=1.0, backward_input=1.5, backward_weight=0.5, comm_time=0.1)
    return sw.synthesize(costs, p, m, virtual_stages=v)


#: (what, schedule): every placement torchtitan can build, the guide's synthesize commands included
CASES = {
    "1f1b p4": lambda: sw.build_schedule("1f1b", 4, 8),
    "zb-h1 p4": lambda: sw.build_schedule("zb-h1", 4, 8),
    "synthesized p4": lambda: _synthesized(4, 8, 1),  # the guide's first `stagewise synthesize`
    "interleaved p2 v2": lambda: sw.build_schedule("interleaved-1f1b", 2, 4, 2),
    "interleaved p2 v3": lambda: sw.build_schedule("interleaved-1f1b", 2, 6, 3),
    "zb-v p2": lambda: sw.build_schedule("zb-v", 2, 4),
    "dualpipe-v p2": lambda: sw.build_schedule("dualpipe-v", 2, 4),
    "synthesized p2 v2": lambda: _synthesized(2, 8, 2),
}


def _torch_class(name: str) -> type:
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(name)


def _torchtitan_stages(class_name: str, p: int, rank: int, layers_per_stage_gives: int | None) -> tuple[int, ...]:
    """The stages torchtitan builds on ``rank`` for ``pipeline_parallel_schedule = class_name``: one for a
    single-stage class, else two or what ``pipeline_parallel_layers_per_stage`` gives; in a V for ZBVZeroBubble
    and DualPipeV, else looped."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleDualPipeV, ScheduleZBVZeroBubble

    cls = _torch_class(class_name)
    v = 1 if issubclass(cls, PipelineScheduleSingle) else (layers_per_stage_gives or 2)
    if cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        assert v == 2
        return (rank, 2 * p - 1 - rank)
    return tuple(rank + k * p for k in range(v))


def _load_as_torchtitan(path: Path, p: int, stages: tuple[int, ...], rank: int, n: int, m: int) -> Any:
    from torch import nn
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    built = [
        SimpleNamespace(
            num_stages=n, group_size=p, group_rank=rank, stage_index=s, stage_index_to_group_rank={}, submod=nn.Module()
        )
        for s in stages
    ]
    runtime = _PipelineScheduleRuntime(built, n_microbatches=m)
    runtime._load_csv(str(path))  # torchtitan passes no format: compute_only
    return runtime


@pytest.mark.parametrize("case", list(CASES))
def test_the_recipe_loads_in_torchs_loader_with_the_stages_torchtitan_builds(case: str, tmp_path: Path) -> None:
    schedule = CASES[case]()
    settings = torchtitan_settings(schedule)
    p, m = settings.pipeline_parallel_degree, settings.num_pp_microbatches
    path = tmp_path / "recipe.csv"
    path.write_text(sw.to_torch_csv(schedule))
    extra = settings.stages_per_rank if settings.stages_note else None  # more than 2: layers_per_stage sets it
    for rank in range(p):
        stages = _torchtitan_stages(settings.pipeline_parallel_schedule, p, rank, extra)
        assert len(stages) == settings.stages_per_rank, (case, rank, stages)
        loaded = _load_as_torchtitan(path, p, stages, rank, p * len(stages), m)
        assert {s: loaded.stage_index_to_group_rank[s] for s in stages} == dict.fromkeys(stages, rank)
        assert loaded.stage_index_to_group_rank == dict(enumerate(schedule.placement))
    read = sw.from_torch(path)
    assert torchtitan_problems(read, settings.pipeline_parallel_schedule, m, stages_per_rank=extra) == []
    if extra:  # without the setting that makes more than 2 stages per rank, the checker says what to set
        (problem,) = torchtitan_problems(read, settings.pipeline_parallel_schedule, m)
        assert "pipeline_parallel_layers_per_stage" in problem
    if schedule.virtual_stages == 1:
        assert settings.pipeline_parallel_schedule in ("1F1B", "GPipe") and settings.placement == "one stage per rank"


def test_the_class_table_is_torchs() -> None:
    """The pure table of class names against torch's classes: the single-stage ones, and the V-placed ones."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleDualPipeV, ScheduleZBVZeroBubble

    for name in CLASSES:
        cls = _torch_class(name)
        assert issubclass(cls, PipelineScheduleSingle) == (name in ONE_STAGE), name
        assert (cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV)) == (name in V_SHAPED), name
        v = 1 if name in ONE_STAGE else 2
        built = torchtitan_placement(name, 3, v)
        assert all(s in _torchtitan_stages(name, 3, r, None) for s, r in enumerate(built)), name


def test_each_wrong_setting_fails_in_torch_and_is_named_by_the_checker(tmp_path: Path) -> None:
    one = tmp_path / "one.csv"
    one.write_text(sw.to_torch_csv(sw.build_schedule("zb-h1", 2, 4)))
    with pytest.raises(AssertionError, match=r"Got 0 \S*F\S* microbatches for stage 2"):  # the looped class: 2 stages
        _load_as_torchtitan(one, 2, _torchtitan_stages("Interleaved1F1B", 2, 0, None), 0, 4, 4)
    (problem,) = torchtitan_problems(sw.from_torch(one), "Interleaved1F1B", 4)
    assert "builds 2 stages per rank, 4 on 2 ranks; the file has 2 stages (the file fits 1F1B" in problem

    v = tmp_path / "v.csv"
    v.write_text(sw.to_torch_csv(sw.build_schedule("zb-v", 2, 4)))
    loaded = _load_as_torchtitan(v, 2, _torchtitan_stages("Interleaved1F1B", 2, 0, None), 0, 4, 4)
    assert loaded.stage_index_to_group_rank[2] == 1  # torch loads it, yet rank 0 built stage 2: step() goes wrong
    (problem,) = torchtitan_problems(sw.from_torch(v), "Interleaved1F1B", 4)
    assert "rank 0: Interleaved1F1B builds stages [0, 2], the file runs stages [0, 3]" in problem

    comms = tmp_path / "comms.csv"
    comms.write_text(sw.to_torch_csv(sw.build_schedule("zb-v", 2, 4), format="compute_comms"))
    with pytest.raises(ValueError, match="Expected compute-only schedule"):
        _load_as_torchtitan(comms, 2, (0, 3), 0, 4, 4)
    (problem,) = torchtitan_problems(sw.from_torch(comms), "ZBVZeroBubble", 4)
    assert problem.startswith("the file is compute_comms")

    with pytest.raises(AssertionError, match=r"Got 4 \S*F\S* microbatches for stage 0, expected 8"):
        _load_as_torchtitan(v, 2, (0, 3), 0, 4, 8)
    (problem,) = torchtitan_problems(sw.from_torch(v), "ZBVZeroBubble", 8)
    assert "num_pp_microbatches 8: the file runs 4 micro-batches per stage" in problem


def test_simulate_checks_a_file_against_a_torchtitan_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "auto.csv"
    assert main(["synthesize", "-p", "2", "-m", "4", "-v", "2", "--torch-csv", str(path)]) == 0
    assert "pipeline_parallel_schedule ZBVZeroBubble, num_pp_microbatches 4" in capsys.readouterr().out
    check = ["simulate", "--from-torch", str(path), "-p", "2", "-m", "4", "--torchtitan"]
    assert main([*check, "ZBVZeroBubble"]) == 0
    assert "ZBVZeroBubble with num_pp_microbatches 4 loads it as is" in capsys.readouterr().out
    assert main([*check, "Interleaved1F1B"]) == 1
    assert "builds stages [0, 2], the file runs stages [0, 3]" in capsys.readouterr().err
    assert main(["simulate", "--from-torch", str(path), "-p", "2", "-m", "8"]) == 1
    assert "-m 8: the file has 4" in capsys.readouterr().err
