"""The public API: a small top level, every name reachable, moved names warning for one release, lazy doors."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import stagewise as sw


def test_the_top_level_is_small_and_every_name_resolves() -> None:
    assert 30 <= len(sw.__all__) <= 40, len(sw.__all__)
    assert len(set(sw.__all__)) == len(sw.__all__)
    for name in sw.__all__:
        assert getattr(sw, name) is not None, name
    shown = dir(sw)
    assert set(sw.__all__) <= set(shown)
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "warnings"} & set(shown), shown


def test_the_packages_are_reachable_as_attributes() -> None:
    assert sw.schedules.generate("1f1b", 2, 2).num_ranks == 2
    assert sw.planning.Link(1e-5, 1e9).latency == 1e-5
    assert sw.simulation.CostModel is sw.CostModel
    assert sw.synthesis.synthesize is sw.synthesize  # the function, not the package, at the top
    assert callable(sw.simulate) and callable(sw.synthesize)


@pytest.mark.parametrize(
    ("old", "home"),
    [
        ("generate", "schedules"),
        ("lower", "passes"),
        ("Kind", "ir"),
        ("VersionTable", "asynchronous"),
        ("Link", "planning"),
        ("async_report", "simulation"),
        ("column_parallel", "runtime"),
        ("measure_compute_scale", "runtime"),
    ],
)
def test_a_moved_name_still_works_for_one_release_and_says_where_it_went(old: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"stagewise.{old} moved to stagewise.{home}.{old}"):
        value = getattr(sw, old)
    assert value is getattr(getattr(sw, home), old)


@pytest.mark.parametrize("name", ["async_reference", "wsp_reference"])
def test_the_test_only_replays_left_the_runtime_saying_where_they_went(name: str) -> None:
    for door in (sw, sw.runtime):
        with pytest.raises(AttributeError, match=f"tests/oracles/{name}.py"):
            getattr(door, name)
    assert name not in sw.runtime.__all__


def test_pipeline_from_plan_is_now_a_classmethod() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert callable(sw.pipeline_from_plan)
    assert "Pipeline.from_plan(plan, layers, ...)" in str(caught[0].message)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        sw.no_such_name  # noqa: B018


def _loaded_after(statement: str, prefix: str = "stagewise") -> list[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in sys.modules if m.startswith({prefix!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_the_runtime_door_loads_nothing_until_a_name_is_asked_for() -> None:
    """Importing one runtime room loads that room's own imports, not the whole runtime (an eager door did)."""
    plain = _loaded_after("import stagewise")
    assert not [m for m in plain if m.startswith("stagewise.runtime")], plain
    assert "torch" not in _loaded_after("import stagewise; import sys; assert 'torch' not in sys.modules")
    shm = [m for m in _loaded_after("import stagewise.runtime.comm.shm.transport") if ".runtime." in m]
    assert len(shm) < 25, shm  # (56 runtime modules through the eager door this replaced)
    assert not [m for m in shm if ".engine." in m or ".frontends." in m or m.endswith(".pipeline")], shm


def test_a_pipeline_that_never_checkpoints_never_imports_dcp() -> None:
    """torch.distributed.checkpoint, and the DTensor and FSDP modules it brings, cost a third of a second of CPU
    per process: a rank imports them at its first save or load (checkpoint/dcp_files.py), not with Pipeline."""
    loaded = _loaded_after("import stagewise as sw; sw.Pipeline; sw.checkpoint.save", prefix="")
    assert "stagewise.runtime.checkpoint.storage" in loaded  # the checkpoint package itself is there
    heavy = [m for m in loaded if m.startswith(("torch.distributed.checkpoint", "torch.distributed.fsdp"))]
    assert heavy == [] and "stagewise.runtime.checkpoint.dcp_files" not in loaded, heavy
    assert "torch.distributed.checkpoint" in _loaded_after("from stagewise.runtime.checkpoint import dcp_files", "")
