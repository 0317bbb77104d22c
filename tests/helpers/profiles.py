"""Synthetic layer profiles: costs written down instead of measured (pure, no torch: tests/core uses them too)."""

from __future__ import annotations

from stagewise.partition import LayerCost, LayerProfile


def fake_profile(
    times: list[float], params: list[float] | None = None, acts: list[float] | None = None
) -> LayerProfile:
    """One layer per entry of ``times`` (split evenly over forward, input grad and weight grad), with ``params``
    parameter bytes and ``acts`` activation bytes (0 when not given)."""
    params = params or [0.0] * len(times)
    acts = acts or [0.0] * len(times)
    layers = tuple(
        LayerCost(str(k), t / 3, t / 3, t / 3, 2 * t / 3, a, a / 2, p, 1.0)
        for k, (t, p, a) in enumerate(zip(times, params, acts))
    )
    return LayerProfile(layers=layers, device="cpu", repeats=1, warmup=0)
