"""(b) the steady state's host synchronisations: one per step (the loss), none hidden.

On CUDA, twice: under ``torch.cuda.set_sync_debug_mode("warn")`` every synchronising call of a steady-state step
is recorded with where it was made (expected: the loss's read, and with ``nan_policy="raise"`` the check's
too); under ``"error"`` the first one raises, and it must be the loss's read, after every action of the step
ran. On a CPU nothing synchronises; the same calls are counted by wrapping the reads of tensor values
(``.item()``, ``.tolist()``, ``float(t)``, ...) that stagewise's own code makes.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import stagewise as sw
from stagewise.runtime import counted_reads

from .common import Row, Sizes, adamw, lm_data, lm_layers, lm_loss


def pipeline(s: Sizes, device: torch.device, nan_policy: str | None) -> sw.Pipeline:
    """A steady pipeline: 4 stages on this rank, token counts kept on the device, AdamW, two steps warm."""
    dtype = torch.float32
    pipe = sw.Pipeline(lm_layers(s, dtype), loss_fn=lm_loss, schedule="interleaved-1f1b", virtual_stages=4,
                       microbatches=s.microbatches, optimizer=adamw, nan_policy=nan_policy, device=device,
                       loss_weights=lambda y: (y != -100).sum(), seed=3)  # fmt: skip
    for k in range(2):
        pipe.train_step(*lm_data(s, k, device))
    return pipe


@contextmanager
def cuda_syncs() -> Iterator[Counter[str]]:
    """The synchronising CUDA calls, by the ``file:line`` torch attributes each warning to."""
    sites: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in seen:
        if "synchroniz" in str(w.message):
            sites[f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}"] += 1


def counted(s: Sizes, device: torch.device, nan_policy: str | None, steps: int = 3) -> Counter[str]:
    pipe = pipeline(s, device, nan_policy)
    with cuda_syncs() if device.type == "cuda" else counted_reads() as sites:
        for k in range(steps):
            pipe.train_step(*lm_data(s, 10 + k, device))
    return Counter({site: n // steps for site, n in sites.items()})


def first_sync_under_error(s: Sizes, device: torch.device) -> str:
    """Run a step under ``set_sync_debug_mode("error")``: where the first synchronisation stopped it."""
    pipe = pipeline(s, device, None)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pipe.train_step(*lm_data(s, 20, device))
        return "none (the step never synchronised)"
    except RuntimeError as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "stagewise" in f.filename]
        if not frames:
            return "outside stagewise"
        return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} {frames[-1].name}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(s: Sizes, device: torch.device) -> list[Row]:
    kind = "CUDA synchronisations" if device.type == "cuda" else "reads of tensor values (CPU: the same calls)"
    rows = []
    for policy, want in ((None, 1), ("raise", 2)):
        sites = counted(s, device, policy)
        total = sum(sites.values())
        rows.append(Row("b", f"{kind} per steady step, nan_policy={policy!r}", f"{total} at {dict(sites)}",
                        f"{want} (the loss{', the check' if policy else ''})", total == want))  # fmt: skip
    if device.type == "cuda":
        where = first_sync_under_error(s, device)
        ok = "runner.py" in where and "_share_losses" in where
        rows.append(Row("b", 'a step under set_sync_debug_mode("error"): the first sync', where,
                        "the loss's read (runner.py _share_losses)", ok))  # fmt: skip
    return rows
