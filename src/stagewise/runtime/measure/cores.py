"""One core (or an equal share of the cores) per local rank: ``stagewise run --pin-cores`` (issue 49 item 2).

Left to the kernel, the ranks of a job on a small machine move between cores, and under other load two of
them can end a step on one core while another core serves someone else (the calibration benchmark's
``--builds`` probe, 2 ranks on 2 cores, load 3-14: free, 22 of 96 steps with both ranks on one core and a
median step 806 ms; each rank held to its own core, none and 465 ms). Pinned, a rank's speed no longer
depends on where the scheduler put it, so a build of a plan runs like the next one and a calibration taken on
one build holds for the others.

torch's launcher has ``--numa-binding`` (node, socket, exclusive, core-complex), but every mode places a
worker by the NUMA node of the GPU of its local rank (``torch.cuda.get_device_properties``): on a machine
without a GPU it has nothing to place by. So the launcher runs each worker through this module instead
(``torchrun ... -m stagewise.runtime.measure.cores SCRIPT ARGS``), which pins the process before the script
(and torch, and every thread they start, which inherit it) runs. Local rank r of n on the cores C this
process may use (sorted) gets ``C[r k : (r + 1) k]``, ``k = len(C) // n`` (the remainder, ``len(C) mod n``
cores, left to the rest of the machine); more ranks than cores is refused: ranks sharing a core is what the
cost model's ``min(1, c / k)`` sharing prices for unpinned ranks, and pinned it would be another machine.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
from collections.abc import Sequence
from typing import Any

from ..comm import collectives, groups
from ..comm.machine import machine_id


def core_sets(nproc: int, cores: Sequence[int]) -> list[list[int]]:
    """Each local rank's cores (module docstring): ``nproc`` equal, disjoint, contiguous shares of ``cores``."""
    mine = sorted(set(cores))
    if nproc < 1:
        raise ValueError(f"pin cores: the local ranks must be >= 1, got {nproc}")
    if nproc > len(mine):
        raise ValueError(
            f"pin cores: {nproc} processes on {len(mine)} cores ({_listed(mine)}): each rank needs a core of its "
            f"own; run at most {len(mine)} processes on this machine, or leave the cores unpinned (the ranks then "
            "share them)"
        )
    k = len(mine) // nproc
    return [mine[r * k : (r + 1) * k] for r in range(nproc)]


def pin_local_rank(local_rank: int | None = None, nproc: int | None = None) -> list[int]:
    """This process (and the threads it starts from now on) on its local rank's cores (:func:`core_sets`);
    by default the rank and the count from torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. Returns them."""
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    count = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if nproc is None else nproc
    if not 0 <= rank < count:
        raise ValueError(f"pin cores: local rank {rank} is not one of {count} local ranks")
    share = core_sets(count, sorted(os.sched_getaffinity(0)))[rank]
    os.sched_setaffinity(0, share)
    return share


def node_layout(wait: Any = None) -> tuple[list[list[int]], list[str]]:
    """:func:`node_affinity`, and each global rank's machine (:func:`machine_id`), from one gather over every rank
    of the job (a collective; ``wait``: the pipeline guard's, else plain); this process's alone without a process
    group. The machines say which of a pipeline's transfers cross the network
    (:mod:`stagewise.planning.recalibrate`)."""
    host, cpus = socket.gethostname(), sorted(os.sched_getaffinity(0))
    if not groups.initialized():
        return [cpus], [machine_id()]
    everyone = collectives.gather_json([host, cpus, machine_id()], None, wait, "the ranks' CPU affinity")
    return [[int(c) for c in theirs] for at, theirs, _ in everyone if at == host], [str(m) for _, _, m in everyone]


def node_affinity(wait: Any = None) -> list[list[int]]:
    """The CPUs each rank on this node may run on (``os.sched_getaffinity``), gathered over every rank of the job
    (a collective; ``wait``: the pipeline guard's, else plain) and kept for this host's ranks; this process's alone
    without a process group. Pinned, each rank sees only its own share: the node's cores are their union
    (:func:`stagewise.planning.core_share.node_cores`)."""
    return node_layout(wait)[0]


def _listed(cores: list[int]) -> str:
    return ", ".join(map(str, cores[:8])) + (", ..." if len(cores) > 8 else "")


def main(argv: list[str] | None = None) -> None:
    """``python -m stagewise.runtime.measure.cores SCRIPT ARGS``: pin, then run SCRIPT as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m stagewise.runtime.measure.cores SCRIPT [ARGS...] (under torchrun)")
    try:
        pin_local_rank()
    except ValueError as err:
        raise SystemExit(str(err)) from None
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
