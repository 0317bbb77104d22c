"""The default cut, ``partition="balanced"``: per-layer costs estimated from counted work, no timing.

A timed profile differs from run to run and needs every rank to wait for one; a count does not. The
runtime (:mod:`stagewise.runtime.measure.counting`) runs one micro-batch of the sample inputs forward and
backward on the ``meta`` device, where no arithmetic happens, and counts per layer the floating-point
operations (``torch.utils.flop_counter``), the bytes every operator reads and writes, and the operators
themselves; a :class:`CountedLayer` holds the counts. A layer's time is then a roofline sum::

    seconds = flops / Rates.flops + bytes / Rates.bytes + operators * Rates.per_op

Only the ratios between layers decide a cut, so the rates need only be of the right order for the device
(:data:`RATES`); the per-operator term is what makes a small layer (an embedding, a norm) cost more than its
arithmetic. Without sample inputs the counts are the layers' parameters (what ``"parameters"`` balances),
where parameters can stand for work at all (:func:`parameters_as_work`: not over convolutions).

The cut is the exact min-max cut of those costs (:func:`stagewise.partition.cut.partition_costs`), except that
the even cut is kept when it is as good within :data:`KEEP_UNIFORM` by both the slowest stage and the busiest
rank (the V placements of ``zb-v`` and ``dualpipe-v`` put stage 0 and the last stage on one rank, so a rank's
load is what its stages sum to): a stack of equal layers is cut as before. The busiest rank counts the loss,
charged to the last layer (:func:`estimated_profile`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cut import partition_costs, uniform_counts
from .profile_data import LayerCost, LayerProfile

#: the even cut is kept when the balanced one improves neither its slowest stage nor its busiest rank by more
KEEP_UNIFORM = 0.02


@dataclass(frozen=True)
class CountedLayer:
    """One layer's counted work for one micro-batch: forward and backward separately.

    ``flops`` as ``torch.utils.flop_counter`` counts them (a multiply-add is 2); ``bytes``: the sizes of every
    operator's tensor arguments and results (views excluded), what a memory-bound operator moves;
    ``ops``: operators dispatched (views excluded); ``parameters``: trainable elements; ``output_bytes``: what
    the layer hands on (floating tensors).
    """

    name: str
    forward_flops: float
    backward_flops: float
    forward_bytes: float
    backward_bytes: float
    forward_ops: int
    backward_ops: int
    parameters: float
    parameter_bytes: float
    output_bytes: float


@dataclass(frozen=True)
class Rates:
    """A device's rough throughputs: floating-point operations and bytes per second, seconds per operator."""

    flops: float
    bytes: float
    per_op: float

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.bytes > 0 and self.per_op >= 0):
            raise ValueError(f"Rates: need flops > 0, bytes > 0, per_op >= 0, got {self}")

    def seconds(self, flops: float, nbytes: float, ops: float) -> float:
        return flops / self.flops + nbytes / self.bytes + ops * self.per_op


#: one thread of a current x86 core (FMA, 8 float lanes, ~50 % of peak; a core's share of memory bandwidth;
#: eager PyTorch's dispatch per operator), and a data-centre GPU (a fraction of peak; launch cost)
RATES = {
    "cpu": Rates(flops=50e9, bytes=10e9, per_op=8e-6),
    "cuda": Rates(flops=100e12, bytes=2e12, per_op=10e-6),
}


@dataclass(frozen=True)
class LinkPrior:
    """A rough link between two ranks of one machine (seconds per message, bytes per second) and the runtime's
    seconds per compute action."""

    latency: float
    bandwidth: float
    per_action: float


#: the link a word prices a schedule's transfers with when nothing was measured, and the runtime's own work per
#: compute action (its dispatch, posting the action's messages): on CPU, what this project's runs measured
#: between two processes of one machine (ping-pong 0.1 ms, 2-3.5 GB/s; 0.1-0.13 ms per action, the calibration
#: and regret pages); on GPUs, NVLink's order and the same interpreter on the host
LINKS = {
    "cpu": LinkPrior(latency=100e-6, bandwidth=3e9, per_action=100e-6),
    "cuda": LinkPrior(latency=20e-6, bandwidth=50e9, per_action=100e-6),
}


def link_for(device: str) -> LinkPrior:
    """:data:`LINKS` for a device's type; an unknown type counts as a CPU."""
    return LINKS.get(device.split(":")[0], LINKS["cpu"])


def rates_for(device: str) -> Rates:
    """:data:`RATES` for a device's type (``"cuda:1"`` -> ``"cuda"``); an unknown type counts as a CPU."""
    return RATES.get(device.split(":")[0], RATES["cpu"])


def estimated_profile(
    layers: Sequence[CountedLayer], rates: Rates, device: str = "meta", loss_passes: float = 5.0
) -> LayerProfile:
    """A :class:`~stagewise.LayerProfile` of estimated seconds, so the partitioner and the simulator read it as
    a measured one. A layer with parameters splits its backward evenly into input (I) and weight (W) gradients;
    one without has no W. The loss, which the count cannot see (no targets), is charged to the last layer as
    ``loss_passes`` passes over its output (cross-entropy reads the logits, writes the softmax and its
    gradient); saved activations are estimated as the layer's output."""
    if not layers:
        raise ValueError("estimated_profile: no layers")
    out = []
    for k, c in enumerate(layers):
        f = rates.seconds(c.forward_flops, c.forward_bytes, c.forward_ops)
        b = rates.seconds(c.backward_flops, c.backward_bytes, c.backward_ops)
        if k == len(layers) - 1:
            f += loss_passes * 0.4 * c.output_bytes / rates.bytes
            b += loss_passes * 0.6 * c.output_bytes / rates.bytes
        w = b / 2 if c.parameters > 0 else 0.0
        out.append(
            LayerCost(
                name=c.name,
                forward=f,
                backward_input=b - w,
                backward_weight=w,
                backward=b,
                activation_bytes=c.output_bytes,
                weight_activation_bytes=c.output_bytes if w else 0.0,
                parameter_bytes=c.parameter_bytes,
                output_bytes=c.output_bytes,
            )
        )
    return LayerProfile(layers=tuple(out), device=device, repeats=0, warmup=0)


def parameters_as_work(parameters: Sequence[float], positional: Sequence[bool]) -> list[float]:
    """Per-layer work without sample inputs: the parameter counts, or all zeros (the even cut) where any layer
    reuses its parameters over the positions of its input (``positional``: a convolution).

    A dense layer's parameter does one multiply-add per sample and token, the same in every layer that sees
    the same tokens, so parameters rank such layers by work. A convolution's parameter does one per output
    *position*, and the positions change from layer to layer (a stride halves each side): a ResNet's stages
    do about equal work per block while their parameters grow fourfold, so a cut by parameters piles the
    early, high-resolution blocks onto the first rank. The positions come only from an input; without one the
    count says nothing about the ratio of those layers' work, and the even cut is the unbiased guess."""
    if len(parameters) != len(positional):
        raise ValueError(
            f"parameters_as_work: {len(parameters)} parameter counts and {len(positional)} flags, expected one each"
        )
    if any(positional):
        return [0.0] * len(parameters)
    return [float(p) for p in parameters]


def rank_loads(counts: Sequence[int], costs: Sequence[float], placement: Sequence[int]) -> list[float]:
    """Each rank's summed cost under layer ``counts`` per stage, stage ``s`` on rank ``placement[s]``."""
    loads = [0.0] * (max(placement) + 1)
    start = 0
    for s, c in enumerate(counts):
        loads[placement[s]] += sum(costs[start : start + c])
        start += c
    return loads


def balanced_counts(
    costs: Sequence[float],
    num_stages: int,
    *,
    placement: Sequence[int] | None = None,
    speeds: Sequence[float] | None = None,
) -> list[int]:
    """Layer counts per stage for ``costs`` (one per layer): the min-max cut, or the even cut where that is as
    good within :data:`KEEP_UNIFORM` (module docstring). ``placement``: stage -> rank (default one stage per
    rank); ``speeds``: one per stage, dividing its cost."""
    n = len(costs)
    where = list(range(num_stages)) if placement is None else list(placement)
    if len(where) != num_stages:
        raise ValueError(f"balanced_counts: placement has {len(where)} entries, expected one per stage ({num_stages})")
    cut = partition_costs([float(c) for c in costs], num_stages, speeds=speeds).counts
    if speeds is not None:
        return cut  # heterogeneous ranks: the even cut is never the reference
    even = uniform_counts(n, num_stages)
    if _worst(even, costs, where) <= _worst(cut, costs, where) * (1 + KEEP_UNIFORM):
        return even
    return cut


def _worst(counts: Sequence[int], costs: Sequence[float], placement: Sequence[int]) -> float:
    """The larger of the slowest stage over the mean stage and the busiest rank over the mean rank."""
    total = sum(costs) or 1.0
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    stage = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) / (total / len(counts))
    rank = max(rank_loads(counts, costs, placement)) / (total / (max(placement) + 1))
    return max(stage, rank)
