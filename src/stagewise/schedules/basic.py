"""Single-stage-per-rank schedules: naive, GPipe and 1F1B.

Vocabulary: p ranks, each holding one stage (stage r on rank r); m micro-batches.
"""

from __future__ import annotations

from ..ir import Action, Kind
from .registry import register

F, B = Kind.F, Kind.B


@register(
    "naive",
    summary="one micro-batch at a time through the whole pipeline (no overlap at all)",
    paper="the model-parallel baseline of GPipe (Huang et al., 2019), Fig. 2b",
    bubble="(p-1)/p",
    memory="1",
    transfer="2(p-1)mc",
)
def naive(p: int, m: int, v: int) -> list[list[Action]]:
    """Micro-batch i+1 enters only after micro-batch i has left; at most one rank is busy.

    p=3, m=2 (F forward, B backward, . idle)::

        rank 0  F0 .  .  .  .  B0 F1 .  .  .  .  B1
        rank 1  .  F0 .  .  B0 .  .  F1 .  .  B1 .
        rank 2  .  .  F0 B0 .  .  .  .  F1 B1 .  .
    """
    return [[Action(r, k, i) for i in range(m) for k in (F, B)] for r in range(p)]


@register(
    "gpipe",
    summary="all forwards, then all backwards (fill, drain)",
    paper="Huang et al., GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism, NeurIPS 2019",
    bubble="(p-1)/(m+p-1)",
    memory="m",
    transfer="2(p-1)c",
)
def gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """Every rank runs its m forwards, then its m backwards; all m activations are alive at the turn.

    p=3, m=3::

        rank 0  F0 F1 F2 .  .  .  .  B0 B1 B2
        rank 1  .  F0 F1 F2 .  .  B0 B1 B2 .
        rank 2  .  .  F0 F1 F2 B0 B1 B2 .  .
    """
    return [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)] for r in range(p)]


@register(
    "1f1b",
    summary="warm up, then alternate one forward and one backward (PipeDream-Flush / DAPPLE)",
    paper="Narayanan et al., Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW/Flush), ICML 2021; "
    "Fan et al., DAPPLE, PPoPP 2021",
    bubble="(p-1)/(m+p-1)",
    memory="min(p, m)",
    transfer="2c(p-1 + floor((m-1)(p-1)/p))",
)
def one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """Rank r runs p-r-1 warm-up forwards, then F/B pairs, then the remaining backwards.

    Same bubble as GPipe, but rank r holds at most p-r activations instead of m.
    p=3, m=4::

        rank 0  F0 F1 F2 .  .  B0 F3 .  B1 .  B2 .  B3
        rank 1  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        rank 2  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
    """
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(r, F, warmup + i), Action(r, B, i)]
        acts += [Action(r, B, i) for i in range(m - warmup, m)]
        ranks.append(acts)
    return ranks
