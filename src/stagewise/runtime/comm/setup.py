"""``stagewise.init()``: join the process group torchrun describes, with an explicit timeout."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...parallel import NNODES_ENV, world_sizes
from .attempt_store import attempt_store
from .coordinator import agree_run_scope
from .faults import exit_hook, heartbeat

log = logging.getLogger(__name__)

_warned = False
_STORE_CALL_S = 60.0  # the heartbeat's store calls give up after this (the pipelines' boards use their timeout)


@dataclass(frozen=True)
class Env:
    """Where this process stands: its global rank, the world size, its local rank and device; and every world
    size the job may take (``stagewise run -n N --nnodes MIN:MAX``: N times MIN..MAX; else this one)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    world_sizes: tuple[int, ...] = ()


def init(
    backend: str | None = None,
    timeout: timedelta | float = timedelta(minutes=10),
    *,
    device: torch.device | str | None = None,
) -> Env:
    """Initialise ``torch.distributed`` from torchrun's environment and pick this process's device.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise; on
    CUDA the device is ``cuda:LOCAL_RANK`` and is made current. Without
    torchrun's variables (``python script.py``) a one-process group is made, so
    the same script runs unchanged on one rank. ``timeout`` bounds every
    collective and point-to-point wait of the backend. Calling it again returns
    the existing setup.

    Right after the group exists the ranks agree on the run's scope in the
    store (torchrun's run id and restart count, and a nonce of rank 0's for
    this job: :mod:`.coordinator`), so no key of a previous job on the same store is
    ever read; and an exception that ends the process then leaves it with exit
    code 1 after posting it for the other ranks, never with an abort
    (:mod:`.faults.exit_hook`). The heartbeat starts too, so that a wait anywhere -
    calibration's probes before any pipeline exists - can name a rank that
    stopped.
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if device is None:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            store = attempt_store(timeout)  # torchrun: this restart attempt's own keys (see .attempt_store)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            _no_launcher()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        backend = str(dist.get_backend())
    agree_run_scope(timeout.total_seconds())  # keys of this run in the store: see .coordinator
    exit_hook.install()
    heartbeat.start(min(timeout.total_seconds(), _STORE_CALL_S), pipeline=False)  # names a silent rank from now on
    world = dist.get_world_size()
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    sizes = world_sizes(os.environ.get(NNODES_ENV, ""), nproc, world)
    env = Env(dist.get_rank(), world, local_rank, device, backend, sizes)
    log.info("stagewise.init: rank %d of %d, %s on %s", env.rank, env.world_size, env.backend, env.device)
    return env


def _no_launcher() -> None:
    """Say, once per process, that no launcher started this one: the script runs as one process (a one-rank
    pipeline holds every stage), and how to start several. A warning, as forgetting the launcher is the usual
    reason; a one-process run on purpose can filter it (``warnings.filterwarnings``)."""
    global _warned
    if _warned:
        return
    _warned = True
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "your_script.py"
    warnings.warn(
        "stagewise.init: no launcher (RANK and WORLD_SIZE are not set), so this runs as one process, every stage "
        f"on it; to start several: stagewise run -n 4 {script} (or torchrun --nproc-per-node 4 {script})",
        stacklevel=3,
    )
