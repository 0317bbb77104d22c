"""Per-layer and per-stage costs of a candidate: the profile scaled to its micro-batch, split by tp, recomputed.

**Linear in the batch.** A profile measures one micro-batch of
``profile_batch`` samples. A candidate whose micro-batch holds ``b`` samples
gets every per-layer time and every activation/output size multiplied by
``b / profile_batch``; parameter sizes do not change. That is exact for the
bytes and a fair model for the time of large enough batches; a fixed cost per
action that does not shrink with the batch (kernel launches, Python dispatch)
is the ``overhead``: seconds per layer added to each forward and to each
backward (half to I, half to W) whatever the micro-batch size; the runtime's
own cost per stage action (dispatch, posting transfers) is ``action_overhead``.
Given the layers profiled at several sizes (``plan(..., profiles=)``), each
layer's forward and backward become a line through every size
(:func:`batch_lines`): its fixed parts join ``overhead`` (the backward's apart),
so a small micro-batch is priced as profiled at its size, not at a linear share.

**Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019, Sec. 3): a layer
that supports tp runs ``1/tp`` of its compute, holds ``1/tp`` of its
parameters and (approximately: Megatron without sequence parallelism keeps
some replicated tensors) ``1/tp`` of its activations, and pays two all-reduces
of its output per forward (the ``g`` operators) and two per backward (the
``f`` operators), costed as rings on the tp group's link
(:mod:`stagewise.planning.comm`). Other layers run whole on every tp rank.

**Recompute** ``"stage"``: a stage keeps only its input between a forward and
its backward, and the backward (B, or I where it is split) runs the forward
again first. While one micro-batch's backward runs, its recomputed
internals are alive: the planner adds one micro-batch's full stage
activations to the rank's peak. The loss's saved tensors
(``LayerProfile.loss_bytes``, when the profile was given the loss) are the
last stage's, recompute or not: the loss runs outside the checkpointed
forward. Under a schedule that splits B, a
recomputed stage does its W within I (I = F + I + W, W = 0): the runtime
does, because W in parts would re-run the checkpointed forward once per
part (:mod:`stagewise.runtime.engine.compute`). The checkpoint itself
costs time too (a hook per saved tensor, packed in the forward and again
when the backward re-runs it): the stage's F gains ``k_F c^F_s`` and its
backward ``k_B c^B_s``, where ``c_s`` is the profile's
:class:`~stagewise.partition.profile_data.CheckpointCost` line at the stage's saved
tensors (0 for a profile without one). It does not grow with the batch.
**The step time, as predicted** (what a step is - back to back, what it includes and leaves out - is
defined on :class:`~stagewise.planning.Plan`; here one candidate, ``b`` samples per micro-batch,
``sigma = b / profile_batch``, sums over a stage's layers ``l``):

* ``F_s = k_F (sigma * sum f_l + c_s) + T_s``, ``B_s = k_B (sigma * sum b_l + c_s) + T_s``,
  ``I_s = k_IW (sigma * sum i_l + c_s / 2) + T_s``, ``W_s = k_IW (sigma * sum w_l + c_s / 2)``: each of
  F, B, I and W as the profile measured it (a split backward costs what it costs, not B rescaled), the
  simulator charging a schedule's B actions ``B_s`` and its I and W actions ``I_s`` and ``W_s``,
  with ``T_s`` the stage's tp all-reduces and the fixed cost per action
  ``c_s = sum o_l + action + message * (in_s + out_s) + h u_s``: ``o_l`` the profile's per-layer
  ``overhead``, ``action`` the runtime's measured cost per stage action and ``message`` its
  cost per point-to-point message, ``in_s``, ``out_s`` 1 where the stage before, the stage after is on another
  rank (an F receives an activation and sends one; a B the same gradients back; a V's turn-around neither); on a
  sharded layout, ``h`` is half of FSDP2's measured hooks per unit and micro-batch
  (``Calibration.sharding_hooks``) and ``u_s`` the stage's layers with parameters (a recomputed forward runs
  its hooks again). ``action`` and ``message`` come
  from :class:`~stagewise.planning.Calibration`; ``(k_F, k_B, k_IW)`` is ``compute_scale`` (1 unless
  given): what the runtime's F, B and split I + W actions measured on the group over these predictions
  for them (:func:`stagewise.measure_compute_scale`).
* The simulator runs the schedule with these costs and the pipeline link
  (``latency + bytes / bandwidth`` per transfer), giving ``T_sim``.
* Gradient sync at SYNC (:mod:`stagewise.planning.candidate`): dp all-reduce as a ring,
  overlapping the drain; sharding's gather + reduce-scatter as blocking rank time, from the
  ring model, or when calibrated ``units_s * fixed + bytes_s * per_byte`` (scaled to the group);
  ``bytes_s`` the stage's parameters less the tied weights it holds, which have a sum of their own
  (:func:`stagewise.planning.tied_sum.reduced_bytes`).
* **Oversubscription** (``cores`` per node given, fewer than the node's processes): processes
  share cores. The compute is replayed with the node's cores shared among the processes computing
  at each moment (:mod:`stagewise.simulation.shared`: ``n`` processes computing on ``c`` cores each
  advance at ``min(1, c / n)``; a pipeline rank stands for its replicas on the node, and ranks
  waiting on a message sleep - the transports do not spin), giving ``T_shared``; the step is
  ``T = max(T_sim, T_cpu, T_shared) + step`` with ``T_cpu = max_node sum_{ranks r on it} busy_r / cores``
  (``busy_r`` a rank's compute, F + I + W of its stages times m, plus ``h_r``), the bound that holds
  with perfect packing, and ``T_shared`` at least that wherever the node never idles. ``h_r`` is the
  CPU a process of the layout spends per step beside its compute actions (gloo's transport threads,
  the step's bookkeeping: :attr:`~stagewise.planning.LayoutCost.cpu` at the rank's layers with
  parameters and m; 0 for a layout not calibrated): on shared cores it is taken from the compute of
  the node's processes, so the replay stretches each of rank r's actions by ``busy_r + h_r`` over
  ``busy_r``, less what the rank's blocking SYNC accounts for: its seconds times the share of a core each
  process holds, ``min(1, cores / processes)`` (the SYNC's collectives are that CPU, already timed).
  With a core per process it costs no step time and is left out. ``step``
  (:class:`~stagewise.planning.Calibration`) is the runtime's measured cost per step outside the
  schedule's actions: for a layout the calibration measured, its fitted
  :class:`~stagewise.planning.LayoutCost` at the busiest rank's layers with parameters and the
  micro-batch count (the step-end collectives over every rank, FSDP2's hooks per unit and
  micro-batch); else one number, paid once per step whatever the layout.

"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..partition import CheckpointCost, LayerProfile, shared_bytes
from .comm import Link, ring_all_reduce
from .tied_sum import reduced_bytes


@dataclass(frozen=True)
class LayerArrays:
    """Per-layer costs at the profile's batch, after tp: times, and tp all-reduce bytes per forward/backward."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation: tuple[float, ...]
    keep: tuple[float, ...]
    parameters: tuple[float, ...]
    output: tuple[float, ...]
    tp_layer: tuple[bool, ...]
    backward: tuple[float, ...] = ()  # the full backward B per layer, as measured (() = I + W)
    saved: tuple[float, ...] = ()  # tensors autograd saves per layer (what a checkpoint's hooks pay for)
    checkpoint: CheckpointCost | None = None
    loss: float = 0.0  # bytes the loss saves per micro-batch, held by the last stage (LayerProfile.loss_bytes)
    #: per layer, the bytes it and the next layer both save of the value between them (held once on one stage)
    shared: tuple[float, ...] = ()
    #: the layers tied across stages and their bytes (``LayerProfile.tied``): out of their stage's own all-reduce
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()


def layer_arrays(profile: LayerProfile, tp: int, tp_layers: frozenset[int]) -> LayerArrays:
    """Each layer's times and sizes at the profile batch, divided by ``tp`` where the layer supports it.

    I, W and B as measured, as :meth:`LayerProfile.cost_model` charges them (a layer whose split was not
    measured, I + W = 0, runs its whole backward as I); W's stash as measured, which may exceed the activations.
    """
    f, i, w, b, act, keep, par, out, split, saved = [], [], [], [], [], [], [], [], [], []
    pairs = list(zip(profile.layers, profile.layers[1:]))
    for k, layer in enumerate(profile.layers):
        d = tp if k in tp_layers else 1
        bi, bw = layer.backward_input, layer.backward_weight
        if bi + bw <= 0:
            bi, bw = layer.backward, 0.0
        f.append(layer.forward / d)
        i.append(bi / d)
        w.append(bw / d)
        b.append(layer.backward / d)
        act.append(layer.activation_bytes / d)
        keep.append(layer.weight_activation_bytes / d)
        par.append(layer.parameter_bytes / d)
        out.append(layer.output_bytes)
        split.append(d > 1)
        saved.append(layer.saved_tensors)
    return LayerArrays(  # type: ignore[misc]
        *(tuple(x) for x in (f, i, w, act, keep, par, out)),  # type: ignore[arg-type]
        tp_layer=tuple(split),
        backward=tuple(b),
        saved=tuple(saved),
        checkpoint=profile.checkpoint,
        loss=profile.loss_bytes,
        shared=tuple(shared_bytes(a, b) / (tp if k in tp_layers else 1) for k, (a, b) in enumerate(pairs)),
        tied=profile.tied,
    )


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of one candidate (times in seconds, bytes per micro-batch), ready for a CostModel."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation: tuple[float, ...]
    keep: tuple[float, ...]
    parameters: tuple[float, ...]
    output: tuple[float, ...]
    full_activation: tuple[float, ...]  # without recompute: what a recomputed backward brings back
    tp_comm: tuple[float, ...]  # seconds of tp all-reduce per micro-batch (forward + backward)
    units: tuple[int, ...] = ()  # layers with parameters per stage
    backward: tuple[float, ...] = ()  # the full backward B per stage (() = I + W)
    reduced: tuple[float, ...] = ()  # bytes the stage's own all-reduce moves, its tied weights out (() = parameters)

    def backward_times(self) -> tuple[float, ...]:
        """B per stage: ``backward``, or I + W where it is left out."""
        return self.backward or tuple(i + w for i, w in zip(self.backward_input, self.backward_weight))

    def reduced_bytes(self) -> tuple[float, ...]:
        """Per stage, the bytes its SYNC's collectives over the replicas move: ``reduced``, or its parameters where
        no weight is tied (:func:`~stagewise.planning.tied_sum.reduced_bytes`)."""
        return self.reduced or self.parameters


@dataclass(frozen=True)
class StageBase:
    """Per-stage sums at the profile batch, so a candidate's costs are a linear function of its micro-batch.

    A tp all-reduce of ``S * scale`` bytes costs ``2 (n-1) latency + scale * 2 (n-1) S / (n bandwidth)``:
    ``tp_fixed`` holds the first terms of a stage's forward all-reduces, ``tp_per_scale`` the second.
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation: tuple[float, ...]
    keep: tuple[float, ...]
    parameters: tuple[float, ...]
    output: tuple[float, ...]
    input: tuple[float, ...]
    backward: tuple[float, ...]
    tp_fixed: tuple[float, ...]
    tp_per_scale: tuple[float, ...]
    fixed: tuple[float, ...]  # seconds of each F and of each B that do not scale with the batch
    units: tuple[int, ...]  # layers with parameters (FSDP2 units when sharded)
    recompute: str | None
    factor: tuple[float, float, float] = (1.0, 1.0, 1.0)  # measured / predicted compute: F, B, I and W
    checkpoint_forward: tuple[float, ...] = ()  # seconds a recompute segment adds to each F (fixed)
    checkpoint_backward: tuple[float, ...] = ()  # ... and to each backward, beyond the forward again
    loss: tuple[float, ...] = ()  # bytes the loss saves (the last stage's; recompute does not reach it)
    fixed_backward: tuple[float, ...] = ()  # seconds of each B (I and W half each) that do not scale; () = fixed
    reduced: tuple[float, ...] = ()  # StageCosts.reduced

    def at(self, scale: float, per_unit: float = 0.0) -> StageCosts:
        """The stage costs for a micro-batch of ``scale`` times the profile batch: F, B, and the split I and W,
        each with its own measured factor (see the module docstring); ``per_unit``: seconds each forward and each
        backward costs per layer with parameters beyond the layers (FSDP2's hooks on a sharded layout)."""
        f, i, w, b, act, keep, full, comm = [], [], [], [], [], [], [], []
        kf, kb, kiw = self.factor
        for s in range(len(self.forward)):
            tp_fwd = self.tp_fixed[s] + self.tp_per_scale[s] * scale
            hooks = per_unit * (self.units[s] if self.units else 0)
            fixed = self.fixed[s] + hooks
            back = (self.fixed_backward[s] + hooks) if self.fixed_backward else fixed
            fs = kf * (self.forward[s] * scale + fixed) + tp_fwd
            is_ = kiw * (self.backward_input[s] * scale + back / 2) + tp_fwd  # the f all-reduces mirror the g ones
            bs = kb * (self.backward[s] * scale + back) + tp_fwd
            acts = self.activation[s] * scale  # the last stage's includes the loss's saved tensors
            lost = (self.loss[s] if self.loss else 0.0) * scale
            kp = self.keep[s] * scale
            full.append(acts - lost)  # what a recompute brings back: the stage's own internals
            ws = kiw * (self.backward_weight[s] * scale + back / 2)
            if self.recompute == "stage":  # the forward again, W within I, the checkpoint's hooks (see above)
                is_ += fs + ws + kiw * self.checkpoint_backward[s]
                bs += fs + kb * self.checkpoint_backward[s]
                fs += kf * self.checkpoint_forward[s]
                ws = 0.0
                acts = self.input[s] * scale + lost
                kp = 0.0  # W within I: nothing is held for it
            f.append(fs)
            i.append(is_)
            w.append(ws)
            b.append(bs)
            act.append(acts)
            keep.append(kp)
            comm.append(2 * tp_fwd)
        out = tuple(x * scale for x in self.output)
        return StageCosts(
            tuple(f),
            tuple(i),
            tuple(w),
            tuple(act),
            tuple(keep),
            self.parameters,
            out,
            tuple(full),
            tuple(comm),
            self.units,
            tuple(b),
            self.reduced,
        )


def stage_base(
    arrays: LayerArrays,
    bounds: Sequence[int],
    *,
    tp: int,
    tp_link: Link,
    recompute: str | None,
    overhead: Sequence[float],
    action_overhead: float = 0.0,
    message: float = 0.0,
    factor: tuple[float, float, float] = (1.0, 1.0, 1.0),
    backward_overhead: Sequence[float] = (),
    crossing: Sequence[int] | None = None,
) -> StageBase:
    """Sum the layers of each stage (``bounds`` as in :class:`~stagewise.partition.cut.Partition`);
    ``backward_overhead``: per layer, the backward's fixed seconds where they differ from ``overhead``'s
    (:func:`batch_lines`), ``()`` the same; ``crossing``: each stage's boundaries across ranks, a ``message`` each
    (the placement's :func:`~stagewise.ir.boundary_crossings`; None: all)."""
    per_ar_fixed = 2 * (tp - 1) * tp_link.latency if tp > 1 else 0.0
    per_byte = 2 * (tp - 1) / (tp * tp_link.bandwidth) if tp > 1 else 0.0
    cols: list[list[float]] = [[] for _ in range(12)]
    last = len(bounds) - 2
    cross = crossing if crossing is not None else [(s > 0) + (s < last) for s in range(last + 1)]
    actions = [action_overhead + message * c for c in cross]  # the fixed seconds of each stage's F and B
    units = [sum(1 for k in range(a, b) if arrays.parameters[k] > 0) for a, b in zip(bounds, bounds[1:])]
    ck: list[tuple[float, float]] = []  # each stage's checkpoint's extra forward and backward
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ck.append(arrays.checkpoint.stage(sum(arrays.saved[a:b])) if arrays.checkpoint and arrays.saved else (0.0, 0.0))
        n_tp = sum(1 for k in range(a, b) if arrays.tp_layer[k])
        tp_bytes = sum(arrays.output[k] for k in range(a, b) if arrays.tp_layer[k])
        values = (
            sum(arrays.forward[a:b]),
            sum(arrays.backward_input[a:b]),
            sum(arrays.backward_weight[a:b]),
            sum(arrays.activation[a:b]) - sum(arrays.shared[a : b - 1]) + (arrays.loss if s == last else 0.0),
            sum(arrays.keep[a:b]),
            sum(arrays.parameters[a:b]),
            arrays.output[b - 1],
            arrays.output[a - 1] if a > 0 else 0.0,
            sum(arrays.backward[a:b])
            if arrays.backward
            else sum(arrays.backward_input[a:b] + arrays.backward_weight[a:b]),
            2 * n_tp * per_ar_fixed,
            2 * tp_bytes * per_byte,
            sum(overhead[a:b]) + actions[s],
        )
        for col, value in zip(cols, values):
            col.append(value)
    fixed_b = tuple(sum(backward_overhead[a:b]) + x for (a, b), x in zip(zip(bounds, bounds[1:]), actions))
    return StageBase(  # type: ignore[misc]
        *(tuple(c) for c in cols),  # type: ignore[arg-type]
        fixed_backward=fixed_b if backward_overhead else (),
        units=tuple(units),
        recompute=recompute,
        factor=factor,
        checkpoint_forward=tuple(f for f, _ in ck),
        checkpoint_backward=tuple(b for _, b in ck),
        loss=tuple(arrays.loss if s == last else 0.0 for s in range(last + 1)),
        reduced=reduced_bytes(cols[5], bounds, arrays.tied) if arrays.tied else (),  # cols[5]: parameters
    )


def partition_weights(
    arrays: LayerArrays, *, tp: int, tp_link: Link, recompute: str | None, overhead: Sequence[float],
    backward_overhead: Sequence[float] = (),
) -> list[float]:  # fmt: skip
    """What the partitioner balances per layer at the profile batch: F + B (+ F again and the checkpoint's hooks
    under recompute) + its tp all-reduces + its fixed costs (so one cut serves every micro-batch count: exact when
    nothing is fixed)."""
    weights = []
    for k in range(len(arrays.forward)):
        fwd = arrays.forward[k] + overhead[k]
        tp_time = 4 * ring_all_reduce(arrays.output[k], tp, tp_link) if arrays.tp_layer[k] else 0.0
        back = arrays.backward[k] if arrays.backward else arrays.backward_input[k] + arrays.backward_weight[k]
        back += backward_overhead[k] if backward_overhead else overhead[k]
        hooks = 0.0
        if recompute and arrays.checkpoint is not None and arrays.saved:  # the checkpoint's cost per saved tensor
            hooks = arrays.saved[k] * (arrays.checkpoint.per_saved_forward + arrays.checkpoint.per_saved_backward)
        weights.append(fwd + back + tp_time + (fwd + hooks if recompute else 0))
    return weights


@dataclass(frozen=True)
class BatchLines:
    """Each layer's time as a line in the micro-batch, from profiles at several sizes (:func:`batch_lines`):
    ``profile`` holds the lines' slopes at its own batch (the scaled part; sizes as profiled), ``forward`` and
    ``backward`` each layer's fixed seconds per F and per B, the planner's ``overhead`` for each."""

    profile: LayerProfile
    forward: tuple[float, ...]
    backward: tuple[float, ...]


def batch_lines(profiles: Sequence[LayerProfile]) -> BatchLines:
    """Fit ``t(b) = fixed + slope * b`` per layer, for F and for the fused B, by least squares through the
    profiles' sizes (``LayerProfile.batch``, at least two; exact through two), the fixed part at least 0 (else
    the slope through the origin). A layer call has a fixed part (the operators' dispatch, the autograd graph)
    that the planner's linear scaling would shrink with the batch (issue 49: a layer at 1 sample ran ~1.4x its
    linear share). The split I and W share B's slope as the first profile splits its B. The result is at the
    first profile's batch, whose bytes it keeps (bytes are linear in the batch)."""
    sizes = [p.batch for p in profiles]
    if len(profiles) < 2 or None in sizes or len(set(sizes)) != len(sizes):
        raise ValueError(f"plan: profiles must be two or more LayerProfiles of distinct recorded batches, got {sizes}")
    names = profiles[0].names
    for p in profiles[1:]:
        if p.names != names:
            raise ValueError(f"plan: profiles must hold the same layers, got {list(names)} and {list(p.names)}")
    b0 = float(profiles[0].batch)  # type: ignore[arg-type]
    bs = [float(b) for b in sizes]  # type: ignore[arg-type]
    layers, fixed_f, fixed_b = [], [], []
    for k, x in enumerate(profiles[0].layers):
        of, sf = _line(bs, [p.layers[k].forward for p in profiles])
        ob, sb = _line(bs, [p.layers[k].backward for p in profiles])
        split = x.backward_input + x.backward_weight
        i_share = x.backward_input / split if split > 0 else 0.5
        layers.append(replace(x, forward=sf * b0, backward=sb * b0, backward_input=sb * b0 * i_share,
                              backward_weight=sb * b0 * (1 - i_share)))  # fmt: skip
        fixed_f.append(of)
        fixed_b.append(ob)
    return BatchLines(replace(profiles[0], layers=tuple(layers)), tuple(fixed_f), tuple(fixed_b))


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` through ``(xs, ys)``, the intercept at least 0."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope < 0:  # a layer no slower at more samples: its mean, fixed
        return my, 0.0
    intercept = my - slope * mx
    if intercept >= 0 or n == 0:
        return intercept, slope
    return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
