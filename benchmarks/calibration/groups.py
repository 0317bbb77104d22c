"""The process groups a pipeline makes, let go when the benchmark is done with it (issue 49 item 2).

A ``sw.Pipeline`` makes its process groups when it is built (the stages' group, a gloo side group, the
replicas' groups at dp > 1) and nothing destroys them when it is dropped: each gloo group keeps its threads
(``pt_gloo_runloop`` x 2, ``gloo_tcp_loop``) and their CPU. A benchmark that builds ~100 pipelines in one job
leaks them all. Measured here (gpt64, 4 processes, 1F1B pp 2 x dp 2, loaded machine): 15 threads a build, and
the CPU a rank burns while idle grew by about 0.0045 s a second per build (30 builds: 0.13 s/s a rank, a
quarter of the 2 cores at 4 ranks); the quiet 4-process run of 2026-12-02 (99 builds) ran every plan 1.07x
its prediction at its start and 3.9x at its end. :func:`released` destroys every group made inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


def groups() -> list[object]:
    """The process groups this rank belongs to (torch's own registry: no public listing exists)."""
    return list(dist.distributed_c10d._world.pg_map)


@contextmanager
def released() -> Iterator[None]:
    """Every process group made inside destroyed at the end (each rank destroys its own: no collective).
    Drop the pipelines built inside before it ends: their groups no longer work."""
    before = {id(g) for g in groups()}
    try:
        yield
    finally:
        gc.collect()
        for group in [g for g in groups() if id(g) not in before]:
            dist.destroy_process_group(group)  # type: ignore[arg-type]
