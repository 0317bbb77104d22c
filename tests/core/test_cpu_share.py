"""The share of a collective's time that is CPU work, from its time alone and with the cores contended (issue 49)."""

from __future__ import annotations

import pytest

from stagewise.planning.comm import cpu_share


@pytest.mark.parametrize(
    ("alone", "together", "sharing", "share"),
    [(0.020, 0.030, 2.0, 0.5), (0.020, 0.040, 2.0, 1.0), (0.020, 0.060, 2.0, 1.0), (0.020, 0.018, 2.0, 0.0),
     (0.020, 0.030, 3.0, 0.25), (0.020, 0.030, 1.0, 1.0)],
)  # fmt: skip
def test_cpu_share_arithmetic(alone: float, together: float, sharing: float, share: float) -> None:
    """alone = wait + cpu, together = wait + sharing x cpu; clipped to [0, 1]; nothing contending: 1."""
    assert cpu_share(alone, together, sharing) == pytest.approx(share)
    with pytest.raises(ValueError, match="need alone > 0"):
        cpu_share(0.0, together, sharing)
