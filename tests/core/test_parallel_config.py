"""ParallelConfig and the rank <-> coordinates arithmetic: pure, no processes, no torch."""

from __future__ import annotations

import doctest
import itertools
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import stagewise as sw
from stagewise import parallel as config_module
from stagewise.parallel import AXES, Coords, ParallelConfig

degrees = st.integers(min_value=1, max_value=4)
configs = st.builds(ParallelConfig, pp=degrees, dp=degrees, tp=degrees, sharding=degrees)


def test_doctests() -> None:
    assert doctest.testmod(config_module, raise_on_error=False).failed == 0


def test_exported_from_the_package() -> None:
    assert sw.ParallelConfig is ParallelConfig
    assert AXES == ("pp", "dp", "sharding", "tp")


@pytest.mark.parametrize("field", ["pp", "dp", "tp", "sharding"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_degrees_must_be_positive_ints(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"ParallelConfig.{field} must be a positive int, got {bad!r}"):
        ParallelConfig(**{field: bad})  # type: ignore[arg-type]


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        ParallelConfig().pp = 2  # type: ignore[misc]


def test_world_mismatch_names_every_factor() -> None:
    with pytest.raises(ValueError) as err:
        ParallelConfig(pp=2, dp=2, tp=2, sharding=2).check_world(8)
    assert str(err.value) == "pp=2 x dp=2 x sharding=2 x tp=2 = 16 processes, but the world has 8"
    ParallelConfig(pp=2, dp=2, tp=2, sharding=2).check_world(16)


def test_paddle_layouts_of_16_devices() -> None:
    """The guide's example: 16 devices as dp 4 x sharding 4, dp 2 x sharding 8, or sharding 16 (ZeRO-DP)."""
    for dp, sharding in ((4, 4), (2, 8), (1, 16)):
        c = ParallelConfig(dp=dp, sharding=sharding)
        c.check_world(16)
        assert c.replicas == 16
        assert len(c.axis_groups("sharding")) == dp and len(c.axis_groups("dp")) == sharding


def test_tp_is_innermost_pp_outermost() -> None:
    c = ParallelConfig(pp=2, dp=2, tp=2, sharding=2)
    assert c.axis_groups("tp")[0] == (0, 1)  # neighbours: the same machine
    assert c.axis_groups("sharding")[0] == (0, 2)
    assert c.axis_groups("dp")[0] == (0, 4)
    assert c.axis_groups("pp")[0] == (0, 8)  # furthest apart: across machines
    assert c.coords(13) == Coords(pp=1, dp=1, sharding=0, tp=1)


def test_coordinates_out_of_range() -> None:
    c = ParallelConfig(pp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the mesh"):
        c.coords(4)
    with pytest.raises(ValueError, match="coordinate tp=2 is outside 0..1"):
        c.rank_of(tp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'mp'"):
        c.axis_groups("mp")


@given(configs)
def test_coords_round_trip(c: ParallelConfig) -> None:
    seen = set()
    for rank in range(c.world_size):
        coords = c.coords(rank)
        assert c.rank_of(**coords._asdict()) == rank
        seen.add(coords)
    assert seen == set(itertools.product(*(range(n) for n in c.shape)))


@given(configs, st.sampled_from(AXES))
def test_axis_groups_partition_the_world(c: ParallelConfig, axis: str) -> None:
    groups = c.axis_groups(axis)
    assert sorted(r for g in groups for r in g) == list(range(c.world_size))
    assert all(len(g) == c.size(axis) for g in groups)
    k = AXES.index(axis)
    for g in groups:
        coords = [c.coords(r) for r in g]
        assert [x[k] for x in coords] == list(range(c.size(axis)))  # ordered by the axis coordinate
        assert len({x[:k] + x[k + 1 :] for x in coords}) == 1  # the same elsewhere


@given(configs)
def test_replicas_number_the_data_slices(c: ParallelConfig) -> None:
    """Every (dp, sharding) pair is one slice of the batch; the pp and tp ranks of a replica share it."""
    by_replica: dict[int, set[tuple[int, int]]] = {}
    for rank in range(c.world_size):
        coords = c.coords(rank)
        by_replica.setdefault(c.replica(rank), set()).add((coords.dp, coords.sharding))
    assert sorted(by_replica) == list(range(c.replicas))
    assert all(len(pairs) == 1 for pairs in by_replica.values())


def test_imports_no_torch() -> None:
    code = "import sys, stagewise.parallel\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_world_of_one_suggests_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python quickstart.py`` with parallel=: the world has 1, most often because no launcher started the ranks."""
    monkeypatch.setattr("sys.argv", ["quickstart.py"])
    with pytest.raises(ValueError) as err:
        ParallelConfig(pp=2, dp=2).check_world(1)
    assert str(err.value) == (
        "pp=2 x dp=2 x sharding=1 x tp=1 = 4 processes, but the world has 1; start 4 processes: "
        "stagewise run -n 4 quickstart.py (or torchrun --nproc-per-node 4 quickstart.py)"
    )
