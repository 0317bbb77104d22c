"""``HetPipe``: virtual workers (one pipeline each) trained by wave-synchronous parallel (Park et al., ATC 2020).

The rule is :mod:`stagewise.asynchronous.wsp`'s (equations there); the parameter-server
role is delayed collectives (:mod:`stagewise.runtime.comm.wsp`, which says
why). Per rank, a run is::

    for wave c = 0, 1, ...:
        wait for the sums of clocks <= c - 1 - D     (check each: every rank pushed exactly that clock)
        check the lead c - (known + 1) <= D, record it
        W <- W0 + (1/K) [G(known) + own updates of clocks c-D .. c-1]          (this rank's parameters)
        train the wave on the VW's pipeline (one asynchronous window, or N synchronous steps)
        start the sum of [u^c on this rank's parameters, zeros elsewhere | clock slots | more? | wave loss]
    wait for every sum left; W <- W0 + (1/K) G(C - 1): every VW ends on the global model

Each VW is an ordinary :class:`~stagewise.Pipeline` on its own process group,
partitioned for its own ranks (``speeds``, ``memory_caps`` per global rank),
so VWs may have different stage counts; all VWs share one error board, so a
failure in any stops all. Buffers (BatchNorm statistics) stay each VW's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._util import is_count
from ..asynchronous import VWLayout, WaveRule, check_clocks, check_more
from ..schedules import async_schedule, is_asynchronous, registry_minibatch
from .assembly.combinations import refuse_hetpipe, refuse_no_sync
from .checkpoint.declared import PipelineState
from .checkpoint.parts import SavedInParts
from .checkpoint.through import StateThrough
from .comm import groups
from .comm import wsp as comm
from .comm.choose_transport import TransportChoice, resolve
from .comm.transport.protocol import TransportSpec
from .errors import PipelineError
from .frontends.layer_list import LayerList
from .frontends.layers import Layers
from .options import Options
from .pipeline import Pipeline

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import PipelineOptions

_made = [0]  # HetPipes built in this process (alike on every rank, SPMD): names their shared error board


@dataclass
class WSPStats:
    """Per wave of this rank's VW: the clock through which it knew every VW's updates, and its lead."""

    waves: int = 0
    known: list[int] = field(default_factory=list)
    leads: list[int] = field(default_factory=list)
    global_losses: list[float] = field(default_factory=list)  # per wave: the mean over VWs of their wave's loss

    @property
    def max_lead(self) -> int:
        """The most waves this VW ran ahead of the slowest (never above the staleness bound D)."""
        return max(self.leads, default=0)


class HetPipe(StateThrough, SavedInParts):
    """K virtual workers, each a Pipeline over its ranks, synchronised wave by wave with staleness bound D.

    ``virtual_workers``: global ranks per VW in stage order, e.g. ``[[0, 1], [2]]``
    (every rank in one). ``staleness``: D, in waves. ``schedule``: a registered
    name; an asynchronous one (``pipedream``, ``pipedream-2bw``, ``xpipe``) runs
    each wave as one window of ``wave`` mini-batches of ``microbatches``
    micro-batches; a synchronous one runs ``wave`` train steps of
    ``microbatches`` micro-batches. ``wave``: an int, or one per VW (default:
    the deepest VW's stage count for asynchronous schedules, 1 otherwise).
    ``optimizer``: the per-stage factory each VW's pipeline steps. ``speeds``,
    ``memory_caps``, ``emulate_slowdown``: one value per global rank (the last
    an EMULATION of slower devices, see :class:`~stagewise.Pipeline`). Other
    keyword options go to every VW's Pipeline.

    Every rank calls :meth:`train_stream` with its VW's own mini-batches
    (:meth:`local_batch` cuts a global batch); every VW must run as many waves: as many mini-batches, or with
    a wave size per VW, ``wave[v]`` per wave on VW v.
    :meth:`eval_step` runs this VW's pipeline forward. A checkpoint saves each VW's pipeline under its own
    folder (the protocol :class:`~stagewise.runtime.checkpoint.parts.SavedInParts`). The declared state
    (:class:`~stagewise.runtime.checkpoint.declared.PipelineState`) is, on each rank, its VW's pipeline's
    (:mod:`~stagewise.runtime.checkpoint.through`); the wave rule's is saved beside it, in parts.
    """

    def __init__(
        self,
        layers: Layers,
        options: Options | None = None,
        /,
        *,
        virtual_workers: Sequence[Sequence[int]],
        staleness: int = 0,
        wave: int | Sequence[int] | None = None,
        **keywords: Unpack[PipelineOptions],
    ) -> None:
        groups.require_initialized()
        opts = Options.of("HetPipe", options, keywords).with_defaults(schedule="pipedream")
        refuse_hetpipe(layers, opts)  # every refusal is in .assembly.combinations
        rank, world = comm.world()
        self.layout = VWLayout.of(virtual_workers, world)
        self.rule = WaveRule(staleness)
        self.rank, self.vw = rank, self.layout.worker_of(rank)
        self.count = self.layout.count
        p = self.layout.stages(self.vw)
        sched, pipe_m, self.wave_size = _vw_schedule(
            opts.schedule, p, opts.microbatches, _wave_of(wave, self.layout, self.vw), self.layout
        )
        vw_group, self.group = comm.make_groups(self.layout.workers, opts.timeout)
        board = f"hetpipe{_made[0]}"
        _made[0] += 1
        vw = replace(
            opts,
            schedule=sched,
            microbatches=pipe_m,
            group=vw_group,
            speeds=self.layout.per_rank(opts.speeds, "speeds", self.vw),
            memory_caps=self.layout.per_rank(opts.caps, "memory_caps", self.vw),
            emulate_slowdown=self.layout.per_rank(_listed(opts.emulate_slowdown), "emulate_slowdown", self.vw),
            transport=_on_board(opts.transport, board),
        )
        self.pipe = Pipeline(LayerList(layers, entry="HetPipe"), vw)
        self.names, self.size, index = self._parameter_index()
        self.params = [q for _, q in self.pipe.named_parameters()]
        self.index = torch.tensor(index, dtype=torch.long)
        self.w0 = self._flat()
        self.global_sum = torch.zeros_like(self.w0)  # G(known), on this rank's parameters
        self.own: dict[int, torch.Tensor] = {}  # this VW's updates not yet in the global sum, by clock
        self.known = -1
        self.sums = comm.DelayedSum(self.group, self.pipe.transport.guard.wait)
        self.stats = WSPStats()
        self._pull_lag = 0  # tests only: > 0 pulls that many waves too early (a mutant the run-time check catches)

    # ---- setup ----------------------------------------------------------------
    def _parameter_index(self) -> tuple[list[str], int, list[int]]:
        """The one-process parameter order (VW 0's stages in order), its size, and where this rank's values go.

        Each parameter must have exactly one owner per VW: tied modules (a copy on two stages) are refused.
        """
        mine = [(n, q.numel()) for n, q in self.pipe.named_parameters()]
        record = {"params": mine, "counts": [len(r) for r in self.pipe.layer_ranges]}
        everyone = comm.gather_records(record, self.group, self.pipe.transport.guard.wait)
        #: layers per stage of every VW (each partitioned for its own ranks), (a one-process replay needs them)
        self.stage_counts = [everyone[ranks[0]]["counts"] for ranks in self.layout.workers]
        per_vw = [[(n, k) for r in ranks for n, k in everyone[r]["params"]] for ranks in self.layout.workers]
        for v, listed in enumerate(per_vw):
            names = [n for n, _ in listed]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(
                    f"HetPipe: VW {v} holds parameters {twice} on more than one stage (tied modules); each parameter "
                    "must have one owner per VW, whose update it pushes: untie them or keep both uses on one stage"
                )
            if sorted(listed) != sorted(per_vw[0]):
                raise ValueError(f"HetPipe: VW {v}'s parameters (names, sizes) differ from VW 0's: not the same model")
        offsets, total = {}, 0
        for n, k in per_vw[0]:
            offsets[n] = total
            total += k
        index = [offsets[n] + j for n, k in mine for j in range(k)]
        return [n for n, _ in per_vw[0]], total, index

    def _flat(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([q.detach().reshape(-1).to(torch.float64, copy=True).cpu() for q in self.params])

    def _load(self, flat: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(flat[at : at + q.numel()].view_as(q).to(q.dtype))
                at += q.numel()

    # ---- the rule -------------------------------------------------------------
    def _absorb_through(self, clock: int) -> None:
        """Wait for the sums of every clock <= ``clock``, check their clock slots, add them to the global sum."""
        world = self.layout.world
        while self.sums.oldest() is not None and self.sums.oldest() <= clock:  # type: ignore[operator]
            c, buf = self.sums.finish_oldest()
            check_clocks(buf[self.size : self.size + world].tolist(), c, self.layout)
            check_more(buf[self.size + world : self.size + 2 * world].tolist(), c, self.layout)
            self.global_sum += buf[self.index]
            self.stats.global_losses.append(float(buf[-1]) / self.count)
            self.own.pop(c, None)
            self.known = c

    def _pull(self, wave: int) -> None:
        """Before ``wave``: the sums the bound requires, the lead check, and the weights of the rule."""
        self._absorb_through(self.rule.needed_before(wave) - self._pull_lag)
        lead = self.rule.check_start(self.vw, wave, self.known)
        self.stats.known.append(self.known)
        self.stats.leads.append(lead)
        own = torch.zeros_like(self.w0)
        for c in self.rule.own_terms(wave):
            if c > self.known:
                own += self.own[c]
        self._load(self.w0 + (self.global_sum + own) / self.count)

    def _push(self, wave: int, start: torch.Tensor, losses: list[float], more: bool) -> None:
        world = self.layout.world
        update = self._flat() - start
        self.own[wave] = update
        buf = torch.zeros(self.size + 2 * world + 1, dtype=torch.float64)
        buf[self.index] = update
        buf[self.size + self.rank] = wave + 1
        buf[self.size + world + self.rank] = 1.0 if more else 0.0
        if self.pipe.rank == 0:
            buf[-1] = sum(losses) / len(losses)
        self.sums.start(wave, buf)

    # ---- training -------------------------------------------------------------
    def local_batch(self, inputs: Any = None, targets: Any = None) -> tuple[Any, Any]:
        """This VW's equal share (1/K along dim 0) of a global batch: K VWs on one batch are data parallelism."""
        return _share(inputs, self.vw, self.count, "inputs"), _share(targets, self.vw, self.count, "targets")

    def train_stream(self, batches: Iterable[tuple[Any, Any]], steps: int | None = None) -> Iterator[float]:
        """Train this VW on ``batches`` wave by wave; yields each mini-batch's loss (this VW's), in order.

        ``steps``: mini-batches at most (None: until the stream ends); every VW must train as many. Consume
        the whole iterator: its end waits for every VW and loads the global model on every rank.
        """
        if steps is not None and steps < 0:
            raise ValueError(f"HetPipe.train_stream: steps must be >= 0 or None, got {steps}")
        stream = iter(batches) if steps is None else islice(batches, steps)
        try:
            current = _take(stream, self.wave_size)
            wave = self.stats.waves
            while current:
                self._pull(wave)
                start = self._flat()
                losses = self._train_wave(current)
                upcoming = _take(stream, self.wave_size)
                self._push(wave, start, losses, bool(upcoming))
                self.stats.waves = wave = wave + 1
                yield from losses
                current = upcoming
            self._absorb_through(wave - 1)
            self._rebase()
        except PipelineError as err:
            if self.pipe.transport.guard.failure is None:  # found on this VW alone (its step's check): tell every VW
                self.pipe.transport.guard.fail(f"rank {self.rank} (VW {self.vw}): {err}")
            raise
        except BaseException as err:
            if not isinstance(err, GeneratorExit):
                self.pipe.transport.guard.fail(f"rank {self.rank} (VW {self.vw}): {type(err).__name__}: {err}")
            raise

    @property
    def declared(self) -> PipelineState:
        """This rank's VW's pipeline: every member of the declared state is its."""
        return self.pipe

    def no_sync(self) -> Any:
        """Refused: a gradient merge cannot hold a wave's update back (see
        :func:`.assembly.combinations.refuse_no_sync`)."""
        refuse_no_sync("HetPipe", None)

    def relayout(self, *args: Any, **changes: Any) -> Any:
        """Refused: a HetPipe's layout is its virtual workers' and the wave rule's, which a re-layout does not
        move; save a checkpoint and build a new HetPipe (or re-layout a Pipeline)."""
        raise ValueError(
            "HetPipe.relayout: refused - each virtual worker's pipeline and the wave rule's global sums are laid out "
            "together; save a checkpoint (sw.checkpoint.save) and build the new HetPipe from it"
        )

    def _rebase(self) -> None:
        """Every VW ends on the global model W0 + G/K, and it becomes the base W0 of the waves to come (with G
        counted afresh): the same rule, so that a checkpoint of the global model resumes it exactly."""
        self._load(self.w0 + self.global_sum / self.count)
        self.w0 = self._flat()
        self.global_sum = torch.zeros_like(self.w0)

    # ---- checkpoints ----------------------------------------------------------
    def checkpoint_part(self, path: Path) -> tuple[Path, Pipeline, dict[str, Any]]:
        """What ``sw.checkpoint.save(path, het)`` writes on this rank: this VW's pipeline (the global model and
        its own optimizer state) under ``path/vwK``, and the wave count. Call it after ``train_stream`` ends."""
        if self.own or self.sums.oldest() is not None:
            raise ValueError("HetPipe: save after train_stream has ended (every wave's sums absorbed)")
        return path / f"vw{self.vw}", self.pipe, {"waves": self.stats.waves, "vw": self.vw}

    def restore_part(self, state: dict[str, Any]) -> None:
        """After ``sw.checkpoint.load(path, het)``: the loaded global model is the base of the waves to come."""
        if state.get("vw") != self.vw:
            raise ValueError(f"HetPipe: this checkpoint is virtual worker {state.get('vw')}'s, not {self.vw}'s")
        self.w0 = self._flat()
        self.global_sum = torch.zeros_like(self.w0)
        self.own = {}
        self.stats.waves = int(state["waves"])
        self.known = self.stats.waves - 1

    def _train_wave(self, batches: list[tuple[Any, Any]]) -> list[float]:
        """One wave on this VW's pipeline: an asynchronous window, or synchronous steps one after another."""
        return list(self.pipe.train_stream(batches))

    def eval_step(self, inputs: Any = None, *, merge_outputs: bool = True) -> Any:
        """Forward only on this VW's pipeline, with the weights it holds (after :meth:`train_stream`: the global
        model); the rank holding the VW's last stage gets the outputs, the others None. A collective of the VW's
        ranks; ``inputs`` on the rank holding its first stage (:meth:`local_batch` cuts a global batch)."""
        return self.pipe.eval_step(inputs, merge_outputs=merge_outputs)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their one-process names."""
        return self.pipe.named_parameters()


def _wave_of(wave: int | Sequence[int] | None, layout: VWLayout, v: int) -> int | None:
    if wave is None or isinstance(wave, int):
        return wave
    if len(wave) != layout.count:
        raise ValueError(f"wave needs one size per VW ({layout.count}), got {len(wave)}")
    return wave[v]


def _vw_schedule(name: Any, p: int, m: int | None, wave: int | None, layout: VWLayout) -> tuple[Any, int | None, int]:
    """The VW's schedule (an asynchronous window, or a synchronous name), the micro-batches to pass, the wave.

    An asynchronous schedule's default wave is the deepest VW's stage count, alike on every VW: each VW then runs
    as many waves on as many mini-batches (a wave of its own stage count each would end a shallower VW's stream
    waves later than a deeper one's, and the wave rule needs every VW at the same wave)."""
    if not isinstance(name, str) or name == "auto":
        raise ValueError(
            f"HetPipe: schedule must be a registered name (each VW builds it for its own stage count), got {name!r}: "
            "an asynchronous one (pipedream, pipedream-2bw, xpipe) or a synchronous one (1f1b, ...)"
        )
    if wave is not None and not is_count(wave):
        raise ValueError(f"HetPipe: wave (mini-batches per wave) must be an integer >= 1, got {wave!r}")
    if not is_asynchronous(name):
        return name, m, wave or 1
    n = wave or max(layout.stages(v) for v in range(layout.count))
    return async_schedule(name, p, n, m or registry_minibatch(name, p, 1)), None, n


def _listed(value: float | Sequence[float] | None) -> Sequence[float] | None:
    """A factor per global rank (HetPipe's ``emulate_slowdown`` is per rank; one number applies to every rank)."""
    if value is None or not isinstance(value, (int, float)):
        return value
    return [float(value)] * comm.world()[1]


def _on_board(choice: TransportChoice, board: str) -> Any:
    """The transport factory ``choice`` names, on the board every VW shares (a failure anywhere stops all)."""
    factory = resolve(choice)
    return lambda spec: factory(replace(spec, board=board)) if isinstance(spec, TransportSpec) else factory(spec)


def _take(stream: Iterator[Any], n: int) -> list[Any]:
    out = []
    for item in stream:
        out.append(item)
        if len(out) == n:
            break
    return out


def _share(value: Any, v: int, k: int, what: str) -> Any:
    if value is None or k == 1:
        return value
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"HetPipe.local_batch cuts tensors along dim 0; the {what} are a {type(value).__name__}")
    if value.shape[0] % k:
        raise ValueError(f"the {what} hold a batch of {value.shape[0]}, which does not split evenly over {k} VWs")
    return value.tensor_split(k)[v]


__all__ = ["HetPipe", "WSPStats"]


if TYPE_CHECKING:
    _declares: type[PipelineState] = HetPipe  # mypy checks that a HetPipe declares its state
