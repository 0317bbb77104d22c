"""The cost model: what a stage costs in time and memory, for the simulator and the planner."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields


def _per_stage(value: float | Sequence[float], num_stages: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * num_stages
    values = tuple(float(x) for x in value)
    if len(values) != num_stages:
        raise ValueError(f"cost model: {what} has {len(values)} entries, expected one per stage ({num_stages})")
    return values


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs. Times in any unit (seconds when profiled); bytes per micro-batch.

    ``forward``, ``backward_input`` (I) and ``backward_weight`` (W) are compute
    times; ``backward_full`` the time of a full backward B, as measured (a
    split backward does not cost what B costs: I and W each walk the graph,
    and W runs its weight-gradient kernels apart); left out (``()``), B costs
    I + W. ``activation_bytes`` is what a stage keeps from F until its
    backward; ``weight_activation_bytes`` what it holds from the end of its I
    until its W ends (W's stash: each deferred layer's input and output
    gradient, or whatever the split keeps alive), which may exceed the
    forward's saved bytes: then I grows the rank's memory. ``output_bytes`` is
    what a stage sends to its neighbour (activations forward, gradients back);
    a transfer takes ``latency + bytes / bandwidth`` and overlaps compute.

    ``rank_nodes`` (one per pipeline rank; ``()``: every rank a node of its own)
    says which ranks share a machine: a transfer between two ranks of one node
    takes ``local_latency + bytes / local_bandwidth`` instead (loopback, not the
    network). Why both: a pipeline of 2 ranks per machine crosses the network at
    one stage boundary of three, and one link fitted through all of them reads
    neither (10 ms of delay read as 2.75 ms, issue 49, 2026-12-05).

    ``sync_cpu``: the share of a SYNC's time that is CPU work on its rank's node (the replicas' gradient
    all-reduce inside one node on CPUs: the flatten, gloo's copies through the kernel and sums, the copy back),
    timed with its processes on cores of their own; where a node's processes share its cores
    (:func:`~stagewise.simulation.shared.shared_makespan`) that share takes a core, as a forward does, and the rest
    waits. 0: a wait on a link, taking no core. Why: on 4 processes sharing 2 cores 1F1B at dp 2 ran 34-43 ms of
    CPU a step beyond dp 1 at the same micro-batches, the all-reduces' (issue 49, 2026-12-06), which a SYNC
    taking no core left to the other ranks' compute.

    ``link_cpu``: the share of a core a message between machines takes at each end while it is on the link (the
    sender's and the receiver's node), in the shared-core replay
    (:func:`~stagewise.simulation.shared.shared_makespan`) only. Why: over a link of 100 Mbit/s, gloo's I/O
    threads and the kernel's network work run beside the ranks' compute all the while a message trickles
    through, and the compute of 1F1B, GPipe, interleaved 1F1B and ZB-V at 8 micro-batches on 2 ranks ran 26, 36,
    41 and 57 % slower than over a fast link (issue 49, 2026-12-06): interleaved 1F1B, three times 1F1B's
    messages, was priced 19 % low. 0: a transfer takes no core (a GPU's copy engine, or a
    fast link, whose messages are short).
    """

    num_stages: int
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    weight_activation_bytes: tuple[float, ...]
    parameter_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    latency: float = 0.0
    bandwidth: float = math.inf
    sync_time: tuple[float, ...] = ()
    step_time: tuple[float, ...] = ()
    backward_full: tuple[float, ...] = ()  # B per stage; () = I + W
    rank_nodes: tuple[int, ...] = ()  # each pipeline rank's node; () = every rank its own
    local_latency: float = 0.0  # the link between two ranks of one node
    local_bandwidth: float = math.inf
    sync_cpu: float = 0.0
    link_cpu: float = 0.0  # the share of a core a message between machines takes at each end while on the link

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"cost model: need at least 1 stage, got {self.num_stages}")
        for name in (
            "forward",
            "backward_input",
            "backward_weight",
            "activation_bytes",
            "weight_activation_bytes",
            "parameter_bytes",
            "output_bytes",
            "sync_time",
            "step_time",
            "backward_full",
        ):
            value = getattr(self, name)
            if name == "backward_full" and value == ():
                continue  # B = I + W (see backward_times)
            if name in ("sync_time", "step_time") and value == ():
                object.__setattr__(self, name, (0.0,) * self.num_stages)
                continue
            values = _per_stage(value, self.num_stages, name)
            bad = [(s, x) for s, x in enumerate(values) if not 0 <= x < math.inf]
            if bad:
                raise ValueError(f"cost model: {name} must be finite and >= 0, got {bad[0][1]} for stage {bad[0][0]}")
            object.__setattr__(self, name, values)
        if not 0 <= self.latency < math.inf or not self.bandwidth > 0:
            raise ValueError(f"cost model: need latency >= 0 and bandwidth > 0, got {self.latency}, {self.bandwidth}")
        if not 0 <= self.local_latency < math.inf or not self.local_bandwidth > 0:
            raise ValueError(
                f"cost model: need local_latency >= 0 and local_bandwidth > 0, got {self.local_latency}, "
                f"{self.local_bandwidth}"
            )
        if not 0 <= self.sync_cpu <= 1:
            raise ValueError(f"cost model: sync_cpu is a share of a SYNC's time, in [0, 1], got {self.sync_cpu!r}")
        if not 0 <= self.link_cpu <= 1:
            raise ValueError(f"cost model: link_cpu is a share of a core, in [0, 1], got {self.link_cpu!r}")
        nodes = tuple(self.rank_nodes)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in nodes):
            raise ValueError(f"cost model: rank_nodes must be node numbers >= 0, one per pipeline rank, got {nodes}")
        object.__setattr__(self, "rank_nodes", nodes)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        *,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        activation_bytes: float = 1.0,
        weight_activation_bytes: float | None = None,
        parameter_bytes: float = 1.0,
        output_bytes: float = 1.0,
        comm_time: float = 0.0,
        sync_time: float = 0.0,
        step_time: float = 0.0,
        backward_full: float | None = None,
    ) -> CostModel:
        """Every stage alike; ``comm_time`` is a fixed transfer time (latency, infinite bandwidth).

        ``weight_activation_bytes`` defaults to half of ``activation_bytes``; ``backward_full`` (B) to I + W.
        """
        if num_stages < 1:
            raise ValueError(f"cost model: need at least 1 stage, got {num_stages}")
        return cls(
            num_stages=num_stages,
            forward=(forward,) * num_stages,
            backward_input=(backward_input,) * num_stages,
            backward_weight=(backward_weight,) * num_stages,
            activation_bytes=(activation_bytes,) * num_stages,
            weight_activation_bytes=(
                (activation_bytes / 2 if weight_activation_bytes is None else weight_activation_bytes),
            )
            * num_stages,
            parameter_bytes=(parameter_bytes,) * num_stages,
            output_bytes=(output_bytes,) * num_stages,
            latency=comm_time,
            sync_time=(sync_time,) * num_stages,
            step_time=(step_time,) * num_stages,
            backward_full=() if backward_full is None else (backward_full,) * num_stages,
        )

    def backward(self, stage: int) -> float:
        """The time of stage ``stage``'s full backward B (I + W unless ``backward_full`` says)."""
        if self.backward_full:
            return self.backward_full[stage]
        return self.backward_input[stage] + self.backward_weight[stage]

    def backward_times(self) -> tuple[float, ...]:
        """B per stage: ``backward_full``, or I + W where it is left out."""
        if self.backward_full:
            return self.backward_full
        return tuple(i + w for i, w in zip(self.backward_input, self.backward_weight))

    def transfer_time(self, stage: int, local: bool = False) -> float:
        """Time to move stage ``stage``'s output (or input gradient) to a neighbouring rank; ``local``: one on
        the same node (the ``local_`` link)."""
        if local:
            return self.local_latency + self.output_bytes[stage] / self.local_bandwidth
        return self.latency + self.output_bytes[stage] / self.bandwidth

    def shares_node(self, a: int, b: int, num_ranks: int) -> bool:
        """Whether pipeline ranks ``a`` and ``b`` (of ``num_ranks``) share a node (never without ``rank_nodes``)."""
        if not self.rank_nodes:
            return False
        if len(self.rank_nodes) != num_ranks:
            raise ValueError(
                f"cost model: rank_nodes names {len(self.rank_nodes)} ranks' nodes, the schedule has {num_ranks} ranks"
            )
        return self.rank_nodes[a] == self.rank_nodes[b]

    def boundary_transfers(self, placement: Sequence[int], num_ranks: int) -> tuple[float, ...]:
        """Per stage ``s`` (placed on ``placement[s]`` of ``num_ranks`` ranks), the time its output takes to reach
        stage ``s + 1`` (and that stage's input gradient to come back): 0 on one rank, the local link on one
        node, else the link (the last stage's entry is 0)."""
        p = num_ranks
        out = []
        for s in range(len(placement) - 1):
            a, b = placement[s], placement[s + 1]
            out.append(0.0 if a == b else self.transfer_time(s, self.shares_node(a, b, p)))
        return (*out, 0.0)

    def boundary_wires(self, placement: Sequence[int], num_ranks: int) -> tuple[float, ...]:
        """Per stage ``s``, how long its message to stage ``s + 1`` (and that stage's gradient back) holds the
        sender's link between machines: its bytes over :attr:`bandwidth` where the boundary crosses machines (two
        ranks not sharing a node), else 0 (the loopback inside a machine is the sender's memory copy, not a shared
        wire). A rank's messages over that link leave one after another; their latency overlaps."""
        p = num_ranks
        out = []
        for s in range(len(placement) - 1):
            a, b = placement[s], placement[s + 1]
            crosses = a != b and not self.shares_node(a, b, p)
            out.append(self.output_bytes[s] / self.bandwidth if crosses else 0.0)
        return (*out, 0.0)

    # ---- JSON ------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (lists for per-stage values; infinite bandwidth is written as ``None``).

        ``CostModel.from_dict(json.loads(json.dumps(c.to_dict()))) == c``.
        """
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("backward_full", "rank_nodes") and not value:
                continue
            if f.name in ("local_latency", "local_bandwidth") and not self.rank_nodes:
                continue
            if isinstance(value, tuple):
                value = list(value)
            elif f.name in ("bandwidth", "local_bandwidth") and math.isinf(value):
                value = None
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CostModel:
        """Read :meth:`to_dict`'s form; a per-stage field may also be one number for every stage.

        ``num_stages`` and the three compute times are required; the other
        fields default to 0 (bandwidth to infinite; ``backward_full`` to I + W).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cost model: unknown fields {unknown}; expected some of {sorted(known)}")
        for required in ("num_stages", "forward", "backward_input", "backward_weight"):
            if required not in data:
                raise ValueError(f"cost model: field {required!r} is missing")
        raw_n = data["num_stages"]
        if not isinstance(raw_n, int) or isinstance(raw_n, bool):
            raise ValueError(f"cost model: num_stages must be an integer, got {raw_n!r}")
        n = raw_n

        def stage_values(name: str, default: object) -> tuple[float, ...]:
            value = data.get(name, default)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return (float(value),) * n
            if isinstance(value, Sequence) and not isinstance(value, str):
                try:
                    return _per_stage([float(x) for x in value], n, name)
                except (TypeError, ValueError) as err:
                    raise ValueError(f"cost model: {name} must hold numbers, got {value!r} ({err})") from None
            raise ValueError(f"cost model: {name} must be a number or a list of {n} numbers, got {value!r}")

        def scalar(name: str, default: float, none: float) -> float:
            value = data.get(name, default)
            if value is None:
                return none
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise ValueError(f"cost model: {name} must be a number, got {value!r}")

        return cls(
            num_stages=n,
            forward=stage_values("forward", None),
            backward_input=stage_values("backward_input", None),
            backward_weight=stage_values("backward_weight", None),
            activation_bytes=stage_values("activation_bytes", 0.0),
            weight_activation_bytes=stage_values("weight_activation_bytes", 0.0),
            parameter_bytes=stage_values("parameter_bytes", 0.0),
            output_bytes=stage_values("output_bytes", 0.0),
            latency=scalar("latency", 0.0, 0.0),
            bandwidth=scalar("bandwidth", math.inf, math.inf),
            sync_time=stage_values("sync_time", 0.0),
            step_time=stage_values("step_time", 0.0),
            backward_full=() if data.get("backward_full") is None else stage_values("backward_full", None),
            rank_nodes=_nodes(data.get("rank_nodes")),
            local_latency=scalar("local_latency", 0.0, 0.0),
            local_bandwidth=scalar("local_bandwidth", math.inf, math.inf),
            sync_cpu=scalar("sync_cpu", 0.0, 0.0),
            link_cpu=scalar("link_cpu", 0.0, 0.0),
        )


def _nodes(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, Sequence) and not isinstance(value, str):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return tuple(value)
    raise ValueError(f"cost model: rank_nodes must be a list of node numbers, one per pipeline rank, got {value!r}")
