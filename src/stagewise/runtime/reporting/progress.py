"""Rank 0's line per train step, through this module's logger at INFO (``progress=``: every N steps, or none).

    step 12  loss 3.4512  lr 3.00e-03  412 samples/s  26,368 tokens/s  step 77.6 ms  bubble 41.2%

The values are the step's metrics (:mod:`.record`), those ``metrics=`` writes; a script that logs at INFO
(``logging.basicConfig(level=logging.INFO)``) sees them, one that logs at WARNING sees nothing.
"""

from __future__ import annotations

import logging

progress_log = logging.getLogger(__name__)


def progress_line(step: int, v: dict[str, float]) -> str:
    """``step 12  loss 3.4512  lr 3.00e-03  412 samples/s  26,368 tokens/s  step 77.6 ms  bubble 41.2%``."""
    parts = [f"step {step}", f"loss {v['loss']:.4f}"]
    if "lr" in v:
        parts.append(f"lr {v['lr']:.2e}")
    for what in ("samples", "tokens"):
        if f"throughput/{what}_per_s" in v:
            parts.append(f"{v[f'throughput/{what}_per_s']:,.0f} {what}/s")
    parts.append(f"step {v['time/step'] * 1e3:.1f} ms")
    parts.append(f"bubble {v['bubble']:.1%}")
    if v.get("skipped_steps"):
        parts.append(f"skipped {v['skipped_steps']:.0f}")
    return "  ".join(parts)
