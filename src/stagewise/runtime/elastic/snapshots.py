"""Snapshots in the peers' memory: after every k-th step, each rank's state on its machine and on the next one.

At the end of a train step whose number is a multiple of ``every`` (:meth:`Snapshotter.after_step`, the one
call from the step path), a rank takes what a restart needs:

* at once, on the step's thread: its generators' states, the data position (``Snapshots.extra``), the
  optimizers' hyper-parameters, and a copy of its buffers (a forward changes BatchNorm's statistics);
* on a helper thread, overlapping the next step's forward and backward: its parameters' and optimizer
  state's bytes, copied straight into the pages of its next file on this machine's memory file system
  (:mod:`.mapped`, :mod:`.folder`; from a GPU: on a side stream, into pinned memory, written after). Nothing
  changes them before the next optimizer step, and that step waits for the copy (:meth:`before_step`, a
  stage part at each STEP); then, still on the helper: the digest, the head, the file renamed into place, and
  the same bytes sent to a rank of the next machine (:mod:`.snapshot_copies` over :mod:`..comm.snapshot_exchange`,
  a gloo group of its own), which receives them straight into their file's pages in its machine's folder.

Machines are told apart by torchrun's ``GROUP_RANK`` (the agent's rank in the round); rank ``j`` of machine
``i`` sends to rank ``j`` (modulo its size) of machine ``i + 1`` (modulo their number), so every machine's
state is also on the next one, and a machine lost for good costs at most ``every`` steps. A snapshot's step is
*committed* (``committed``, ``Pipeline.committed_step``) once every rank's copies of it landed
(:func:`.snapshot_copies.commit`): then a resume goes on from it or later while one copy survives; ``train_step``
waits only for the commit before its own. With one machine the copies stay local (they still outlive a restart
of the workers). Each writer keeps the two newest generations (``step`` and ``step - every``): while one is being
written the one before is whole. A job that ends cleanly removes its snapshots and leaves a marker saying so
(:func:`.folder.mark_ended`); one that fails leaves them for the restart. A job is named by a nonce (``job``)
drawn at its first start and taken over by every resume from its snapshots, so the marker refuses exactly that
job's files, wherever they were left.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint import state
from ..comm import groups, lifecycle, snapshot_exchange, snapshot_wire
from ..comm.machine import agent_number
from ..errors import PipelineError
from . import folder as folders
from . import idle, mapped
from . import snapshot_copies as copies
from .config import Snapshots
from .ending import _ENDINGS, Ending
from .membership import check_fence
from .peers import peers_of
from .snapshot_file import Layout, Places, fill_payload, head_need, header_bytes, host_buffer, host_bytes, layout_for
from .snapshot_file import versions as versions  # (relayout.takeover reads it here)

if TYPE_CHECKING:
    from .recover import PeerSnapshots

log = logging.getLogger(__name__)

RUN_ENV = "TORCHELASTIC_RUN_ID"


@dataclass
class Capture:
    """One snapshot on its way: the tensors (references until copied), where each goes, the header."""

    step: int
    tensors: dict[str, torch.Tensor]
    header: dict[str, Any]
    entries: dict[str, Any] = field(default_factory=dict)
    total: int = 0
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_done: Any = None  # a CUDA event on the copy stream, when some tensor is on a GPU


@dataclass(frozen=True)
class Mark:
    """The live state at a snapshot's capture: each tensor's version counter, and the buffers' values."""

    versions: dict[str, int]
    copies: dict[str, torch.Tensor]


class Snapshotter:
    """``snapshot=``: this rank's snapshots (a stage part: each STEP waits for the copy of the last one)."""

    def __init__(
        self,
        config: Snapshots,
        root: nn.Module,
        group: Any,
        timeout: float,
    ) -> None:
        self.config, self.timeout = config, timeout
        self._due = False  # a snapshot is due, and waits for the gradient merge to end
        self._fixed: tuple[dict[int, str], dict[str, Any]] | None = None  # see _capture
        self.root = root  # the pipeline read at each snapshot (a re-layout in place rebinds it)
        self.priority = idle.Priority()  # the snapshot's threads run in the core's idle time (see .idle)
        with idle.new_threads_idle(self.priority.group):
            self.group = snapshot_wire.snapshot_group(group, timeout)
        self.policy: int | None = None  # the helper thread's scheduling policy, as it found it
        self.rank = groups.group_rank(self.group)
        self.run = os.environ.get(RUN_ENV) or "local"
        self.folder = folders.machine_folder(config.root(), self.run)
        mine = {"machine": agent_number(), "folder": folders.identity(config.root())}
        mine |= {"lineage": secrets.token_hex(6), "job": secrets.token_hex(6)}
        everyone = snapshot_wire.gather(mine, self.group, timeout, "every rank's machine (snapshot=)")
        folders.refuse_shared(everyone, config.root())
        self.lineage = str(everyone[0]["lineage"])  # group rank 0's: one generation's files share it
        self.end = Ending(self.folder, str(everyone[0]["job"]), weakref.ref(self))  # the job's name: see Ending
        self.peers = peers_of([str(e["machine"]) for e in everyone], self.rank)
        self.world, self.end.step = len(everyone), 0
        self.stats: dict[str, float] = dict.fromkeys(("snapshots", "capture_s", "gate_s", "stall_s", "sync_s"), 0.0)
        self._inflight: tuple[Capture, threading.Thread] | None = None
        self.dropped = False  # forgotten (a failed generation's): its helper writes no more files
        self._failure: str | None = None
        self._buffer: torch.Tensor | None = None
        self._places: Places | None = None  # where each tensor goes in the buffer (see fill_payload)
        self._layout: Layout | None = None  # the last payload's layout (its entries' JSON kept)
        self._received: dict[int, torch.Tensor] = {}  # by source: buffers for copies not received in place
        self._agreed = snapshot_exchange.Agreed()  # the copies' lengths by peer (one round: see there)
        self._maps, self._room, self._used = mapped.Files(), 0, 0  # written in place (.mapped); the head's room
        self._written = folders.Written(self.folder, self.rank)  # the files written here, by source
        self._stream: Any = None
        self.marks: dict[int, Mark] = {}  # snapshot step -> each live tensor's version at its capture
        if self.rank == 0 and self.peers.dest is None:
            log.info("stagewise snapshots: one machine, so the copies stay on it (they outlive a worker restart)")
        _ENDINGS.append(self.end)  # held to the end: the clean exit's work must not depend on the pipeline's life
        lifecycle.release_at_exit(self.end)

    @property
    def root(self) -> nn.Module:
        return self._root  # the pipeline whose state a snapshot takes

    @root.setter
    def root(self, value: nn.Module) -> None:
        self._root, self._fixed = value, None  # (a re-layout in place rebinds it: the old names and layout go)

    @property
    def step(self) -> int:
        """Train steps taken (a resume sets it to the resumed step)."""
        return self.end.step

    @step.setter
    def step(self, value: int) -> None:
        """A resume (or a re-layout going on): the step the job goes on from is committed (a snapshot's step)."""
        self.end.step, self.committed = value, (value if value % self.config.every == 0 else self.committed)

    @property
    def committed(self) -> int:
        """The newest step held on two machines (:func:`.snapshot_copies.commit`), or the one a resume went on from."""
        return self.end.committed

    @committed.setter
    def committed(self, value: int) -> None:
        self.end.committed = value

    @property
    def job(self) -> str:
        return self.end.job  # the job's nonce (a resume from the snapshots of a job takes its name over)

    @job.setter
    def job(self, value: str) -> None:
        self.end.job = value

    # ---- the step path -----------------------------------------------------------------------------
    @contextmanager
    def around(self, run: Any) -> Iterator[None]:
        """(A step part: nothing while a step runs.)"""
        yield

    def after(self, run: Any) -> None:
        """A step part: at the end of a train step, :meth:`after_step`."""
        if run.mode == "train":
            self.after_step(run.first + run.minibatches, merging=run.accumulate)

    def after_step(self, trained: int | None = None, merging: bool = False) -> None:
        """The end of a train step: count it, and take a snapshot when its number is a multiple of ``every``;
        inside a gradient merge (``merging``: the step only accumulated, ``no_sync()``, whose partial gradients a
        snapshot does not hold) at the step that ends the merge instead."""
        self.end.step += 1  # (not the setter: a step taken is not committed yet)
        self._check()
        self._due = self._due or self.step % self.config.every == 0
        if not self._due or merging:
            return
        self._due = False
        self._finish_inflight("stall_s")  # one snapshot in flight at a time
        started = time.perf_counter()
        capture = self._capture(trained)
        thread = threading.Thread(target=self._copy, args=(capture,), name="stagewise-snapshot", daemon=True)
        self._inflight = (capture, thread)
        thread.start()
        self.stats["capture_s"] += time.perf_counter() - started
        self.stats["snapshots"] += 1
        if self.config.commit == "sync":  # (Snapshots.commit) this step committed before train_step returns
            self._finish_inflight("sync_s")

    def on_sync(self, run: Any, stage: int) -> None:
        pass  # (a stage part: nothing at SYNC)

    def before_step(self, run: Any, stage: int) -> None:
        """A stage part: the optimizer may change the parameters only once the last snapshot has copied them."""
        if self._inflight is None:
            return
        capture = self._inflight[0]
        if not capture.copied.is_set():
            started = time.perf_counter()
            with self.priority.raised_while():
                copied = capture.copied.wait(self.timeout)
            if not copied:
                raise PipelineError(
                    f"rank {self.rank}: the snapshot of step {capture.step} was not copied within "
                    f"{self.timeout:g} s (snapshot=)"
                )
            self.stats["gate_s"] += time.perf_counter() - started
        if capture.cuda_done is not None:
            torch.cuda.current_stream().wait_event(capture.cuda_done)  # on the device: no host wait

    # ---- taking one ----------------------------------------------------------------------------------
    def _capture(self, trained: int | None) -> Capture:
        """What a restart needs, taken now (``trained``: the mini-batches trained, this step's included)."""
        root = self.root
        tensors, live = {}, {}
        for name, t in state.saved_tensors(root, keep_vars=True).items():  # (parameters told apart, no 2nd walk)
            live[state.MODEL + name] = view = t.detach()
            tensors[state.MODEL + name] = view if isinstance(t, nn.Parameter) else view.clone()  # (buffers change)
        if self._fixed is None:  # what a pipeline's life does not change: its parameters' names, its layout
            self._fixed = (state.parameter_names(root), state.layout_of(root, self.world))
        names, layout = self._fixed
        optim_tensors, meta = state.optimizer_state(state.optimizers_of(root, None), names)
        tensors.update(optim_tensors)
        self._mark({**live, **optim_tensors}, {n: t for n, t in tensors.items() if n in live and t is not live[n]})
        extra = self.config.extra() if self.config.extra is not None else None
        header = {
            "run": self.run,
            "job": self.job,
            "lineage": self.lineage,
            "step": self.step,
            "owner": self.rank,
            "world": self.world,
            "layout": layout,
            "dropout": state.dropout_of(root, trained),
            "scheduler": state.scheduler_state(root),  # lr_scheduler=: a recovery goes on where the schedule was
            "optimizer": meta,
            "rng": state.rng_taken(),  # (encoded on the helper: _copy)
            "extra": state.encode(extra, "Snapshots.extra"),
        }
        capture = Capture(self.step, tensors, header)  # (where each tensor's bytes go: on the helper thread)
        if any(t.is_cuda for t in tensors.values()):
            ready = torch.cuda.Event()
            ready.record()  # the step's work queued so far, the optimizer's last update among it
            capture.cuda_done = ready
        return capture

    def _mark(self, live: dict[str, torch.Tensor], copies: dict[str, torch.Tensor]) -> None:
        """Each live tensor's version counter at this capture, and the buffers' copies (the two newest kept): a
        recovery takes a live tensor for this step's value only while it is unchanged (:mod:`..relayout.sources`;
        BatchNorm's forward writes its running statistics without counting a version: they are compared)."""
        self.marks[self.step] = Mark(versions(live), copies)
        for old in sorted(self.marks)[:-2]:
            del self.marks[old]

    def _copy(self, capture: Capture) -> None:
        """The helper thread: the bytes into this rank's file's pages (:mod:`.mapped`; from a GPU, a pinned
        buffer) - then the next STEP may go -, the file made whole, the copy to the peer and the peers' copies
        here, the old generations pruned."""
        try:
            self.policy = self.priority.enter()  # only the core's idle time: see .idle
            time.sleep(0)  # the interpreter's lock let go at once: the step's thread, waiting in start(), goes on
            clock = idle.Clock(self.stats)
            self._layout = layout = layout_for(self._layout, capture.tensors)  # (kept while it holds)
            capture.entries, capture.total = layout.entries, layout.total
            capture.header["rng"] = state.rng_encoded(capture.header["rng"])
            capture.header["tensors"] = capture.entries  # (last: header_bytes keeps its JSON)
            name = folders.file_name(capture.step, self.lineage, self.rank)
            staged = self._stage(capture, name)
            payload = self._fill(staged, capture)
            capture.copied.set()
            clock.lap("fill_s")
            head = header_bytes(capture.header, payload, self._room, layout)  # (padded from a GPU too: peer's size)
            self._used = len(head.rstrip(b" "))  # (the JSON ends in "}": what follows is the padding)
            clock.lap("digest_s")
            check_fence(f"the snapshot of step {capture.step}")  # a worker woken behind its job writes nothing
            spare, final = self._written.spare(self.rank), self.folder / name
            if staged is None:
                final = folders.write(self.folder, name, head, host_bytes(payload), spare)
            else:
                mapped.publish(self._maps, self.rank, staged, head, payload, final)
            self._written.keep(self.rank, final)
            clock.lap("write_s")
            label = copies.label(name, capture.total)  # (the receiver stages the file from it)
            copies.deliver(self, capture.step, head, payload, clock, label)  # sent, received, then committed
            # what no writer here retires (an old lineage's, a gone peer's), one generation later than this
            # writer's own: a rank of this machine at the same step would otherwise take another's spare;
            # nothing once dropped (the next generation may be listing the folder)
            if not self.dropped:
                folders.prune(self.folder, capture.step - 2 * self.config.every)
            clock.lap("prune_s")
        except BaseException as err:  # handed to the step path
            self._failure = f"the snapshot of step {capture.step}: {type(err).__name__}: {err}"
        finally:
            self.priority.leave()
            capture.copied.set()

    def _stage(self, capture: Capture, name: str) -> mapped.Staged | None:
        """This rank's next file under its dot-name, mapped (None from a GPU: the bytes go to pinned memory)."""
        need = self._used + 64 if self._used else head_need(capture.header, capture.total)  # (JSON only once)
        self._room = mapped.room_for(need, self._room)  # the last head's length, and its numbers' growth
        if capture.cuda_done is not None:
            return None
        check_fence(f"the snapshot of step {capture.step}")  # (a worker behind its job takes no spare)
        spare = self._written.spare(self.rank)
        return self._maps.stage(self.rank, self.folder, name, spare, self._room, capture.total)

    def _fill(self, staged: mapped.Staged | None, capture: Capture) -> torch.Tensor:
        if staged is not None:
            places = staged.mapping.places
            staged.mapping.places = fill_payload(staged.payload, capture.tensors, capture.entries, places)
            return staged.payload
        self._buffer = buffer = host_buffer(self._buffer, capture.total, True)
        device = next(t.device for t in capture.tensors.values() if t.is_cuda)  # (a helper thread's own is 0)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            self._stream.wait_event(capture.cuda_done)
            self._places = fill_payload(buffer, capture.tensors, capture.entries, self._places)
            done = torch.cuda.Event()
            done.record(self._stream)
        capture.cuda_done = done  # what the next STEP waits for on the device
        capture.copied.set()
        done.synchronize()  # the bytes are on the host before they are hashed
        return buffer[: capture.total]

    # ---- waiting and failing -------------------------------------------------------------------------
    def _finish_inflight(self, what: str) -> None:
        if self._inflight is None:
            return
        capture, thread = self._inflight
        started = time.perf_counter()
        if thread.is_alive():
            with self.priority.raised_while():
                thread.join(self.timeout)
        self.stats[what] += time.perf_counter() - started
        if thread.is_alive():
            raise PipelineError(
                f"rank {self.rank}: the snapshot of step {capture.step} is still being copied after "
                f"{self.timeout:g} s (snapshot=): is the next machine's rank {self.peers.dest} gone?"
            )
        self._inflight = None
        self._check()

    def _check(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise PipelineError(f"rank {self.rank}: {failure} (snapshot=)")

    def wait(self) -> None:
        """Wait until the last snapshot is written here and at the peer, and committed (raises if it failed)."""
        self._finish_inflight("stall_s")

    def forget(self) -> None:
        """This pipeline is given up mid-job (an in-place elastic job's failed generation): its snapshots stay
        for the next generation, and its end is not marked at exit."""
        self.dropped = True
        if self.end in _ENDINGS:
            _ENDINGS.remove(self.end)
        self._inflight, self._buffer, self.marks, self._received = None, None, {}, {}  # its tensors go too
        self._places, self._maps, self._layout = None, mapped.Files(), None

    def release_at_exit(self) -> None:
        """What a clean exit does (:class:`Ending`), now."""
        self.end.release_at_exit()

    def finish_at_exit(self, quiet: bool = False) -> None:
        """The last snapshot finished (a warning if it failed; ``quiet``: info, where a failed generation's own
        line says why - a copy to the lost peer fails on every rank of the generation)."""
        try:
            self._finish_inflight("stall_s")
        except PipelineError as err:
            (log.info if quiet else log.warning)("stagewise snapshots: %s", err)

    # ---- resuming --------------------------------------------------------------------------------------
    @property
    def machines(self) -> list[str]:
        """Each rank's machine (by group rank), as torchrun's agents numbered them in this round."""
        return self.peers.machines

    def source(self, model: nn.Module) -> PeerSnapshots:
        """The snapshots as a place ``sw.checkpoint.resume`` takes the state from (see :mod:`.recover`); the
        snapshot in flight is finished first."""
        from .recover import PeerSnapshots

        self.wait()
        return PeerSnapshots(self, model)
