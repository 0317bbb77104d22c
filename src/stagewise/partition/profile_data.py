"""Per-layer costs as plain data: what a profile measured, summed into stages for the simulator.

Pure (no torch): the planner and the partitioner consume these without a
process or a device; :mod:`stagewise.runtime.measure.profiling` measures them.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..simulation import CostModel
from .cut import Partition, partition_costs

OPTIONAL = frozenset(
    {"saved_tensors", "checkpoint_forward", "checkpoint_backward"}
)  # LayerCost fields a profile written before them may lack


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured costs: times in seconds, sizes in bytes (per sample batch).

    ``backward_input`` (I), ``backward_weight`` (W) and ``backward`` (B) are each measured: a split backward
    need not cost what B costs. ``activation_bytes`` is what the forward saves for backward;
    ``weight_activation_bytes`` what W holds from the end of I until it runs (its stash), which may be more.
    """

    name: str
    forward: float
    backward_input: float
    backward_weight: float
    backward: float
    activation_bytes: float
    weight_activation_bytes: float
    parameter_bytes: float
    output_bytes: float
    saved_tensors: float = 0.0  # tensors autograd saves in a forward (parameters too): a recompute hooks each
    checkpoint_forward: float = 0.0  # what checkpointing this layer alone adds to its forward
    checkpoint_backward: float = 0.0  # ... and to its backward, beyond running the forward again
    #: of ``activation_bytes``, the bytes of its input and of its output the layer saves itself: the value between
    #: two layers of one stage, saved by both (a ReLU's output, the next convolution's input), is held once
    input_saved_bytes: float = 0.0
    output_saved_bytes: float = 0.0


@dataclass(frozen=True)
class CheckpointCost:
    """What ``torch.utils.checkpoint`` (non-reentrant, as the runtime's recompute uses it) adds beyond the layers'
    own work, in seconds per micro-batch: a fixed cost per checkpointed segment, and one per tensor autograd saves
    in it (a Python hook packs each in the forward and each again when the backward re-runs the forward).

    Neither grows much with the batch: for a stage of half the benchmark GPT's layers (3 blocks, ~75 saved
    tensors) the checkpointed forward costs 0.5-0.7 ms more than the plain one and the backward 0.8-0.9 ms more
    than the plain backward plus the forward again, at 2 and 8 samples; a planner that charged recompute the
    forward again only predicted such plans 12-19 % low (benchmarks/RESULTS.md, round 7).
    """

    segment_forward: float
    segment_backward: float
    per_saved_forward: float
    per_saved_backward: float

    def stage(self, saved: float) -> tuple[float, float]:
        """The (forward, backward) extra of one segment whose layers save ``saved`` tensors."""
        return (
            self.segment_forward + saved * self.per_saved_forward,
            self.segment_backward + saved * self.per_saved_backward,
        )


@dataclass(frozen=True)
class LayerProfile:
    """What :func:`profile` measured, one :class:`LayerCost` per layer in execution order.

    ``batch``: the samples in the micro-batch the times and sizes are for (:func:`stagewise.profile` records
    the sample inputs' first dimension). The planner scales every cost by the candidate's micro-batch over it,
    so a wrong batch makes every predicted time wrong by the same factor; None: not recorded (a profile written
    before it was, or made by hand), and the planner then needs ``profile_batch=``.

    ``loss_bytes``: what the loss keeps for its backward per micro-batch (cross-entropy's log-softmax of the
    logits: for a language model's head often more than a decoder layer), held by the last stage from its
    forward to its backward; 0 when :func:`stagewise.profile` was not given the loss.

    ``tied``: layers that use one parameter (a token embedding and the language model's head reusing its matrix:
    :class:`stagewise.Tied`, ``head.weight = embed.weight``, or a transformers model's ``tie_word_embeddings``),
    each set as ``(layer indices, bytes)``: its layers (0-based, ascending) and the bytes of the parameters they
    share, each once. The runtime sums those gradients over the ranks holding the layers at the end of each step,
    so :func:`stagewise.plan` prices that sum for every plan (:mod:`stagewise.planning.tied_sum`).
    :func:`stagewise.profile` records them; empty: none tied (or a profile made before they were recorded: give
    them with ``dataclasses.replace(profile, tied=(((0, 11), nbytes),))``).
    """

    layers: tuple[LayerCost, ...]
    device: str
    repeats: int
    warmup: int
    checkpoint: CheckpointCost | None = None  # None: not measured (recompute then costs the forward again only)
    batch: int | None = None
    loss_bytes: float = 0.0
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tied", _checked_ties(self.tied, len(self.layers)))
        if isinstance(self.loss_bytes, bool) or not (
            isinstance(self.loss_bytes, (int, float)) and 0 <= self.loss_bytes < math.inf
        ):
            raise ValueError(f"LayerProfile.loss_bytes must be a finite number >= 0, got {self.loss_bytes!r}")
        if self.batch is not None and (
            isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1
        ):
            raise ValueError(
                f"LayerProfile.batch must be a positive int (samples profiled) or None, got {self.batch!r}"
            )

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, key: int | str) -> LayerCost:
        if isinstance(key, str):
            for layer in self.layers:
                if layer.name == key:
                    return layer
            raise KeyError(f"profile has no layer {key!r}; layers are {self.names}")
        return self.layers[key]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def to_json(self) -> str:
        """A JSON object: ``device``, ``repeats``, ``warmup``, ``layers`` (one object per layer, LayerCost's fields)
        and, where known, ``batch`` (samples profiled), ``loss_bytes``, ``checkpoint`` (CheckpointCost's fields)
        and ``tied`` (one ``{"layers": [...], "bytes": ...}`` per set).

        ``LayerProfile.from_json(p.to_json()) == p``.
        """
        data: dict[str, Any] = {
            "device": self.device,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "layers": [asdict(x) for x in self.layers],
        }
        if self.batch is not None:
            data["batch"] = self.batch
        if self.loss_bytes:
            data["loss_bytes"] = self.loss_bytes
        if self.checkpoint is not None:
            data["checkpoint"] = asdict(self.checkpoint)
        if self.tied:
            data["tied"] = [{"layers": list(layers), "bytes": nbytes} for layers, nbytes in self.tied]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> LayerProfile:
        """Read :meth:`to_json`'s form; a missing or unknown layer field is an error naming the layer and field."""
        data = json.loads(text)
        if not isinstance(data, Mapping) or not isinstance(data.get("layers"), list):
            raise ValueError("profile JSON: expected an object with a 'layers' list (LayerProfile.to_json)")
        names = [f.name for f in fields(LayerCost)]
        layers = []
        for k, raw in enumerate(data["layers"]):
            if not isinstance(raw, Mapping):
                raise ValueError(f"profile JSON: layer {k} is not an object")
            missing = [n for n in names if n not in raw and n not in OPTIONAL]
            unknown = sorted(set(raw) - set(names))
            if missing or unknown:
                raise ValueError(f"profile JSON: layer {k} lacks fields {missing} / has unknown fields {unknown}")
            values = {n: raw[n] if n == "name" else float(raw[n]) for n in names if n in raw}
            layers.append(LayerCost(**values))  # type: ignore[arg-type]
        checkpoint = None
        if data.get("checkpoint") is not None:
            raw = data["checkpoint"]
            names = [f.name for f in fields(CheckpointCost)]
            if not isinstance(raw, Mapping) or sorted(raw) != sorted(names):
                raise ValueError(f"profile JSON: 'checkpoint' must be an object with exactly the fields {names}")
            checkpoint = CheckpointCost(**{n: float(raw[n]) for n in names})
        batch = data.get("batch")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(f"profile JSON: 'batch' must be a positive int (samples profiled), got {batch!r}")
        return cls(
            layers=tuple(layers),
            device=str(data.get("device", "unknown")),
            repeats=int(data.get("repeats", 1)),
            warmup=int(data.get("warmup", 0)),
            checkpoint=checkpoint,
            batch=batch,
            loss_bytes=float(data.get("loss_bytes", 0.0)),
            tied=_ties_from_json(data.get("tied", [])),
        )

    def times(self) -> list[float]:
        """Forward + full backward per layer: the cost vector a time-balanced partition evens out."""
        return [layer.forward + layer.backward for layer in self.layers]

    def partition(self, num_stages: int, **kwargs: Any) -> Partition:
        """The time-balanced partition (:func:`stagewise.partition.cut.partition_costs` on :meth:`times`)."""
        return partition_costs(self.times(), num_stages, **kwargs)

    def cost_model(
        self,
        partition: Partition | Sequence[int],
        *,
        latency: float = 0.0,
        bandwidth: float = math.inf,
        output_bytes: Sequence[float] | None = None,
        match_backward: bool = False,
    ) -> CostModel:
        """Sum the layers into stages: stage k holds layers ``bounds[k]`` to ``bounds[k+1] - 1``.

        ``partition`` is a :class:`~stagewise.partition.cut.Partition` or its bounds
        (``[0, 3, 8]``: layers 0-2 and 3-7). A stage sends its last layer's output
        unless ``output_bytes`` (one per stage) says otherwise, e.g. a split
        model's boundary sizes.

        Every cost is charged as measured: a stage's F, I, W and B (``backward_full``) are its layers' sums,
        and W's stash (``weight_activation_bytes``) the bytes the profile found W holding after I. So the
        simulator and the synthesizer see what splitting the backward costs beyond B, and choose B where
        splitting does not pay. ``match_backward=True`` (deprecated; it was the default until the split's own
        cost was measured) scales I and W to sum to B, which hides that cost.
        """
        if match_backward:
            warnings.warn(
                "cost_model(match_backward=True) is deprecated: it scales I + W to the measured B and hides "
                "what splitting the backward costs; the cost model now charges I, W and B as measured",
                DeprecationWarning,
                stacklevel=2,
            )
        bounds = _check_bounds(partition, len(self.layers))
        p = len(bounds) - 1
        if output_bytes is not None and len(output_bytes) != p:
            raise ValueError(f"cost_model: output_bytes has {len(output_bytes)} entries, expected one per stage ({p})")
        stages = [_sum_layers(self.layers[a:b], match_backward) for a, b in zip(bounds, bounds[1:])]
        sent = [s.output_bytes for s in stages] if output_bytes is None else [float(x) for x in output_bytes]
        held = [s.activation_bytes for s in stages]
        held[-1] += self.loss_bytes  # the last stage holds the loss's saved tensors too, until its backward
        return CostModel(
            num_stages=p,
            forward=tuple(s.forward for s in stages),
            backward_input=tuple(s.backward_input for s in stages),
            backward_weight=tuple(s.backward_weight for s in stages),
            activation_bytes=tuple(held),
            weight_activation_bytes=tuple(s.weight_activation_bytes for s in stages),
            parameter_bytes=tuple(s.parameter_bytes for s in stages),
            output_bytes=tuple(sent),
            latency=latency,
            bandwidth=bandwidth,
            backward_full=tuple(s.backward for s in stages),
        )


def _checked_ties(tied: Any, n: int) -> tuple[tuple[tuple[int, ...], float], ...]:
    """``LayerProfile.tied`` as tuples (each set's layers ascending); a ``ValueError`` naming a set that does not
    hold at least two distinct layers of the ``n`` and a finite number of bytes >= 0."""
    out = []
    for entry in tied:
        layers, nbytes = entry if isinstance(entry, (tuple, list)) and len(entry) == 2 else ((), None)
        ks = sorted(layers) if _all_ints(layers) else []
        fine = len(set(ks)) == len(ks) >= 2 and 0 <= ks[0] and ks[-1] < n
        if not (fine and isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) and 0 <= nbytes < math.inf):
            raise ValueError(
                f"LayerProfile.tied: each set is (at least two distinct layer indices of the {n} layers, 0-based; "
                f"the bytes they share, >= 0), got {entry!r}"
            )
        out.append((tuple(ks), float(nbytes)))
    return tuple(out)


def _all_ints(values: Any) -> bool:
    return isinstance(values, (tuple, list)) and all(isinstance(k, int) and not isinstance(k, bool) for k in values)


def _ties_from_json(raw: Any) -> tuple[tuple[tuple[int, ...], float], ...]:
    """:meth:`LayerProfile.to_json`'s ``tied`` (checked by the profile as it is built)."""
    if not isinstance(raw, list) or not all(isinstance(x, Mapping) and sorted(x) == ["bytes", "layers"] for x in raw):
        raise ValueError(f'profile JSON: \'tied\' must be a list of {{"layers": [...], "bytes": ...}}, got {raw!r}')
    return tuple((x["layers"], x["bytes"]) for x in raw)


def shared_bytes(first: LayerCost, then: LayerCost) -> float:
    """The bytes two consecutive layers of one stage both save of the value between them (held once)."""
    return min(first.output_saved_bytes, then.input_saved_bytes)


def _sum_layers(layers: Sequence[LayerCost], match_backward: bool) -> LayerCost:
    """Consecutive layers as one: times and bytes add up (the value between two of them, saved by both, once);
    the output is the last layer's."""
    i = sum(x.backward_input for x in layers)
    w = sum(x.backward_weight for x in layers)
    full = sum(x.backward for x in layers)
    if match_backward and i + w > 0:
        i, w = i * full / (i + w), w * full / (i + w)
    return LayerCost(
        name="+".join(x.name for x in layers),
        forward=sum(x.forward for x in layers),
        backward_input=i,
        backward_weight=w,
        backward=full,
        activation_bytes=sum(x.activation_bytes for x in layers) - sum(map(shared_bytes, layers, layers[1:])),
        weight_activation_bytes=sum(x.weight_activation_bytes for x in layers),
        parameter_bytes=sum(x.parameter_bytes for x in layers),
        output_bytes=layers[-1].output_bytes,
        saved_tensors=sum(x.saved_tensors for x in layers),
        checkpoint_forward=sum(x.checkpoint_forward for x in layers),
        checkpoint_backward=sum(x.checkpoint_backward for x in layers),
        input_saved_bytes=layers[0].input_saved_bytes,
        output_saved_bytes=layers[-1].output_saved_bytes,
    )


def _check_bounds(partition: Partition | Sequence[int], n: int) -> tuple[int, ...]:
    bounds = tuple(partition.bounds if isinstance(partition, Partition) else partition)
    ok = len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:]))
    if not ok:
        raise ValueError(
            f"cost_model: bounds must rise strictly from 0 to the number of layers ({n}), got {list(bounds)} "
            f"(to turn layer counts c into bounds: [0, c0, c0+c1, ...])"
        )
    return bounds
