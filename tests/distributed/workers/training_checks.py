"""The training checks of issue 42 on 4 gloo ranks, one torchrun job: gradient merge (merge_checks.py) and
reproducible dropout (dropout_checks.py).

    torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks training_checks --out DIR
"""

from __future__ import annotations

import merge_checks
from worker import Check


def checks(world: int) -> dict[str, Check]:
    return {**merge_checks.checks(world)}
