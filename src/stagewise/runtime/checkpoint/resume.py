"""``resume``: load the newest complete checkpoint if there is one, the same call on a fresh start and a restart.

A job under ``stagewise run --max-restarts N`` is started again from the top
after a rank dies; its script calls ``resume`` once, before training, and
continues from ``info.step`` (or from 0 when it returns None). Rank 0 looks
for the checkpoint and tells the others, so every rank takes the same branch
even while a stale ``.step-N.tmp`` of the killed attempt is still on disk.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from ..comm.generations import count_from
from . import retention, state, storage
from .api import _ranks, agreed_newest, load, virtual_worker
from .declared import CheckpointInfo, Offer, PipelineState, StateSource
from .newest import DISK, SNAPSHOTS, Report, ranked
from .recorded_cut import recorded_counts

log = logging.getLogger(__name__)


def resume(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    collective: bool = True,
    timeout: float = 600.0,
) -> CheckpointInfo | None:
    """Load the newest checkpoint under ``path`` into ``model`` (see :func:`load`); None if there is none.

    A collective, like :func:`load`: every rank gets None, or every rank loads
    the same folder. A checkpoint that is there but damaged raises
    :class:`CheckpointError` rather than silently starting afresh - and so does
    a newest ``step-N`` that lost its manifest, rather than silently resuming
    from an older one (:func:`.retention.choose`). What it loads, and why, is
    logged and in ``info.reason``.

        info = sw.checkpoint.resume("ckpt", pipe)
        start = 0 if info is None else info.step

    A pipeline built with ``snapshot=`` also weighs the snapshots in its machines' memory and takes the newer
    (:mod:`stagewise.runtime.elastic.recover`); a resume logs one line on rank 0 saying from where, at which
    step, and on how many processes (``resumed step 10 on 4 processes (was 6): pp 2 x dp 2 (was pp 2 x dp 3),
    from peer snapshots``).
    """
    part = virtual_worker(model, path)  # a HetPipe: every virtual worker resumes its own folder, alike
    root, holder = (part[0], part[1]) if part is not None else (Path(path), model)
    disk = DiskCheckpoints(root, Path(path), model, optimizer, scheduler, collective, timeout)
    sources: list[StateSource] = [disk]
    if isinstance(holder, PipelineState):
        sources += holder.state_sources()  # snapshot=: the peers' memory
    if len(sources) > 1 and optimizer is not None:
        raise ValueError(
            "a pipeline with snapshot= resumes its own optimizers (Pipeline(optimizer=factory)): call "
            "sw.checkpoint.resume(root, pipe) without optimizer="
        )
    ranks = _ranks(holder, collective, timeout)
    try:
        offers = [(source, source.newest(ranks)) for source in sources]
    finally:
        ranks.close()
    restored = _restore_newest(offers)
    if restored is None:
        if ranks.first:
            _say_afresh(root, disk.why)
        return None
    info, said = restored
    line, cut = "", None
    if isinstance(holder, PipelineState):
        now = state.layout_of(holder, ranks.size)
        cut = recorded_counts(now, info.layout)  # the cut the saving run decided, where this build decided another
        line = resumed_line(info.step, now, info.layout, said) + notes(info) + cut_note(cut, holder)
        if ranks.first:
            log.warning("stagewise: %s", line)
    for source in sources:
        source.resumed(info.step, line)
    if cut is not None:  # every rank alike (the same record): the state moves exactly
        _take_back(holder, cut)
    return info


def _say_afresh(root: Path, why: str) -> None:
    """A resume that starts afresh says so (a job's first run: a note; a near name holding steps: a warning)."""
    near = retention.misspelt(root)
    if near is not None:
        log.warning(
            "stagewise.checkpoint.resume: starting afresh: no %s, but %s holds checkpoints: a misspelt path?",
            root,
            near,
        )
    else:
        log.info("stagewise.checkpoint.resume: starting afresh: %s", why)


def _take_back(pipe: Any, cut: list[int]) -> None:
    """The recorded cut, re-laid out to, and recorded as the run's own (``"re-planned"``): a later restart takes it
    back too (recorded as counts given it would not, and the third run of a job would decide a cut of its own)."""
    pipe.relayout(partition=cut)
    pipe.replanned_cut = list(cut)


def _restore_newest(offers: list[tuple[StateSource, Offer | None]]) -> tuple[CheckpointInfo, str] | None:
    """The one choice (:func:`.newest.ranked`: the newest step, a tie going to memory before disk); a source whose
    state turns out unusable hands over to the next newest."""
    reports = {
        Report(kind, offer.step, generation=offer.generation, holder=k): (source, offer)  # meta46: the generation
        for k, (source, offer) in enumerate(offers)
        if offer is not None
        for kind in [DISK if isinstance(source, DiskCheckpoints) else SNAPSHOTS]
    }
    order = ranked(reports)
    for k, report in enumerate(order):
        source, offer = reports[report]
        floor = order[k + 1].step if k + 1 < len(order) else -1
        info = source.restore(offer, floor)
        if info is not None:
            count_from(report.generation)  # meta46: the states trained from here on are of its generation or later
            return info, source.said(offer)
    return None


class DiskCheckpoints:
    """The checkpoints under a root on disk, as a resume's :class:`.declared.StateSource`."""

    def __init__(
        self, root: Path, path: Path, model: nn.Module, optimizer: Any, scheduler: Any, collective: bool, timeout: float
    ) -> None:
        self.root, self.path, self.model = root, path, model  # path: what load is given (a HetPipe's root)
        self.optimizer, self.scheduler, self.collective, self.timeout = optimizer, scheduler, collective, timeout
        self.why = ""

    def newest(self, ranks: storage.Ranks) -> Offer | None:
        """Rank 0's choice (see :func:`.retention.choose`), the same on every rank; logged."""
        what = f"which checkpoint under {self.root} to resume from"
        chosen, self.why, generation = agreed_newest(self.root, ranks, what)  # meta46: its generation too
        if ranks.first and chosen is not None:
            log.info("stagewise.checkpoint.resume: %s: %s", chosen, self.why)
        return None if chosen is None else Offer(step_of(chosen), chosen, generation)

    def restore(self, offer: Offer, floor: int) -> CheckpointInfo | None:
        """Load the chosen folder (a damaged one raises: never a silent start from something older)."""
        target = offer.detail if self.root == self.path else self.path  # a HetPipe loads its parts from the root
        options = {"scheduler": self.scheduler, "timeout": self.timeout}
        if self.root == self.path:
            options["collective"] = self.collective
        info = load(target, self.model, self.optimizer, **options)
        return replace(info, reason=self.why)

    def said(self, offer: Offer) -> str:
        return f"from checkpoint {offer.detail}"

    def resumed(self, step: int, line: str) -> None:
        pass


def resumed_line(step: int, now: dict[str, Any], was: dict[str, Any], source: str) -> str:
    """``resumed step 1200 on 4 processes (was 8): pp 2 x dp 2 (was pp 2 x dp 4), from peer snapshots``; the
    ``(was ...)`` parts only where they differ. ``now`` / ``was``: layouts as :func:`.state.layout_of` writes them."""
    world, before = now.get("world"), was.get("world")
    line = f"resumed step {step} on {world} processes" + (f" (was {before})" if before != world else "")
    mesh, old = _mesh(now), _mesh(was)
    return f"{line}: {mesh}" + (f" (was {old})" if old != mesh else "") + f", {source}"


def _mesh(layout: dict[str, Any]) -> str:
    """``pp 2 x dp 2`` (the degrees above 1; pp always), or ``one process`` for a plain module's checkpoint."""
    parallel, pipeline = layout.get("parallel"), layout.get("pipeline")
    if parallel:
        named = [(a, parallel[a]) for a in ("pp", "dp", "sharding", "tp") if parallel[a] > 1 or a == "pp"]
        return " x ".join(f"{a} {n}" for a, n in named)
    return f"pp {pipeline['ranks']}" if pipeline else "one process"


def cut_note(cut: list[int] | None, pipe: PipelineState) -> str:
    """What the resumed line adds when the recorded cut is taken back (:mod:`.recorded_cut`)."""
    return (
        ""
        if cut is None
        else f"; the recorded cut {cut} kept (this build decided {[len(r) for r in pipe.layer_ranges]})"
    )


def notes(info: CheckpointInfo) -> str:
    """What the resumed line adds for the state the checkpoint held that went nowhere."""
    return optimizer_note(info) + scheduler_note(info)


def optimizer_note(info: CheckpointInfo) -> str:
    """What the resumed line adds when the checkpoint's optimizer state went nowhere (Adam's moments and step
    counts start over, silently before: ``info.optimizer_restored`` said so only to a script that looked)."""
    if not info.optimizer_saved or info.optimizer_restored:
        return ""
    return (
        "; its optimizer state was NOT restored (none given): pass your optimizer to resume (optimizer=), or build "
        "the Pipeline with optimizer=, as the saving run did, else the optimizer starts over"
    )


def scheduler_note(info: CheckpointInfo) -> str:
    """What the resumed line adds when the checkpoint's LR scheduler state went nowhere (the warm-up restarts)."""
    if not info.scheduler_saved or info.scheduler_restored:
        return ""
    if info.reason.startswith("peer snapshots"):  # (elastic.recover's reason) they hold lr_scheduler='s only
        return "; its LR scheduler state was NOT restored: build the Pipeline with lr_scheduler=, as the saving run was"
    return (
        "; its LR scheduler state was NOT restored (none given): pass scheduler= to resume, or build the "
        "Pipeline with lr_scheduler=, else the schedule starts over"
    )


def step_of(folder: Path) -> int:
    """The step of a ``step-N`` checkpoint folder (its manifest's record says the same)."""
    return int(folder.name.removeprefix("step-"))
