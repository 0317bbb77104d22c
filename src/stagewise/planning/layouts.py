"""The layouts a search tries: every pp x dp x sharding x tp of the processes, and the schedules per layout.

Ranks are packed onto nodes in order, so an axis whose groups span nodes runs
at the inter-node link (:func:`stagewise.planning.comm.crosses_nodes`); a pipeline
that spans nodes crosses at some stage boundaries only, and the others take the
intra-node link (:attr:`Layout.nodes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..parallel import ParallelConfig
from ..schedules import schedule_info
from .comm import Link, crosses_nodes, pipeline_nodes
from .inputs import Problem


@dataclass(frozen=True)
class Layout:
    config: ParallelConfig
    speeds: tuple[float, ...]  # per pp rank: the slowest rank of its group
    caps: tuple[float, ...]  # per pp rank: the smallest memory of its group
    links: dict[str, Link]
    per_replica: int
    #: per pp rank, its node, where the pipeline spans nodes (then ``links["pp"]`` is the inter-node link and a
    #: transfer between two pp ranks of one node takes ``local``); ``()``: the pipeline on one node
    nodes: tuple[int, ...] = ()
    local: Link | None = None


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def enumerate_layouts(prob: Problem, why_not: list[str]) -> list[Layout]:
    """Every pp x dp x sharding x tp of the processes that can run at all; the others' reasons go to ``why_not``."""
    n_layers, p = len(prob.profile), prob.processes
    out = []
    for pp in divisors(p):
        if pp > n_layers:
            why_not.append(f"pp={pp}: more pipeline ranks than the {n_layers} layers")
            continue
        for tp in divisors(p // pp):
            if tp > 1 and not prob.tp_layers:
                why_not.append(f"tp={tp}: no layer supports tensor parallelism (tp_layers is empty)")
                continue
            if tp > prob.max_tp:
                why_not.append(f"tp={tp}: above max_tp={prob.max_tp}")
                continue
            for sharding in divisors(p // pp // tp):
                dp = p // pp // tp // sharding
                config = ParallelConfig(pp=pp, dp=dp, tp=tp, sharding=sharding)
                if prob.global_batch % config.replicas:
                    why_not.append(
                        f"{config.describe()}: {config.replicas} replicas do not divide the global batch "
                        f"{prob.global_batch}"
                    )
                    continue
                out.append(layout_of(prob, config))
    return out


def layout_of(prob: Problem, config: ParallelConfig) -> Layout:
    group = prob.processes // config.pp
    speeds = tuple(min(prob.speeds[k * group : (k + 1) * group]) for k in range(config.pp))
    caps = tuple(min(prob.memory[k * group : (k + 1) * group]) for k in range(config.pp))
    links = {
        axis: prob.inter if crosses_nodes(config, axis, prob.per_node) else prob.intra
        for axis in ("pp", "dp", "sharding", "tp")
    }
    nodes: tuple[int, ...] = ()
    if crosses_nodes(config, "pp", prob.per_node):  # each boundary on its own link, not all on the inter one
        nodes = tuple(pipeline_nodes(config.pp, prob.processes, prob.per_node))
    return Layout(config, speeds, caps, links, prob.global_batch // config.replicas, nodes, prob.intra)


def schedule_options(prob: Problem, pp: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try; one stage per rank needs no pipeline schedule, so pp = 1 tries 1f1b alone."""
    if pp == 1:
        return [("1f1b", 1)] if "1f1b" in prob.schedules else [(prob.schedules[0], 1)]
    n_layers = len(prob.profile)
    out = []
    for name in prob.schedules:
        info = schedule_info(name)
        if info.virtual_stages is None:  # v = 1 is another registered schedule (1f1b, gpipe): start at 2
            vs = list(range(2, prob.max_virtual_stages + 1))
        else:
            vs = list(info.virtual_stages)
        out += [(name, v) for v in vs if pp * v <= n_layers]
    return out
