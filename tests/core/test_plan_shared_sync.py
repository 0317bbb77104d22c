"""On shared cores, a blocking SYNC's collectives are counted once: their measured seconds, and only the hidden
CPU they cannot account for stretches the compute (closed forms, binary-exact costs)."""

from __future__ import annotations

import pytest

from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Calibration, LayoutCost, search

F, B = 2.0**-10, 2.0**-9  # seconds per layer's forward and backward
T = 2.0**-8  # FSDP2's measured seconds per unit (layer with parameters) per step


def _sharded_step(hidden: float) -> float:
    """pp=1 x sharding=4 of two layers on 4 processes sharing 2 cores, one micro-batch, ``hidden`` CPU seconds per
    process per step beyond the compute (the layout's measured LayoutCost.cpu)."""
    layer = LayerCost("l", F, B / 2, B / 2, B, 8.0, 4.0, 64.0, 8.0)
    profile = LayerProfile((layer, layer), "synthetic", 1, 0, batch=1)
    cal = Calibration(
        sharding_fixed=T,
        sharding_per_byte=0.0,
        sharding_group=4,
        cores=2.0,
        layouts=(LayoutCost(1, 1, 1, 4, 0.0, cpu=(hidden, 0.0, 0.0, 0.0)),),
    )
    plans = search(profile, 4, global_batch=4, calibration=cal, schedules=["1f1b"], recompute=(None,), top=1000).plans
    (plan,) = [p for p in plans if (p.layout.pp, p.layout.sharding) == (1, 4)]
    return plan.step_time


@pytest.mark.parametrize("hidden", [0.0, 2.0**-9, 3 * 2.0**-8, 2.0**-6])
def test_the_blocking_sync_takes_its_share_of_the_hidden_cpu(hidden: float) -> None:
    """Each of the 4 processes gets 2/4 of a core: the compute runs at half speed, the SYNC's 2T seconds (two
    units) take no core but account for 2T * 2/4 of each process's hidden CPU; the rest stretches the compute:
    step = 2 * (F + B) * 2 + 2 * max(0, hidden - T) + 2T. Charging all of it (as before) added 2 * min(hidden, T)."""
    busy = 2 * (F + B)
    expected = 2 * (busy + max(0.0, hidden - 2 * T * 0.5)) + 2 * T
    assert _sharded_step(hidden) == pytest.approx(expected, rel=1e-12)
