"""Asynchronous schedules: 1F1B without a flush over a window of mini-batches (PipeDream, 2BW, XPipe).

Vocabulary: p ranks, stage s on rank s; N mini-batches of m micro-batches, the
global micro-batch index i = t*m + k. Every rank runs the 1F1B order over all
N*m micro-batches at once (no flush between mini-batches): p - s - 1 warm-up
forwards, then F/B pairs, then the last backwards, so p - s micro-batches are
in flight at stage s. Right after the backward of the last micro-batch of each
mini-batch comes ``SYNC`` and ``STEP``: the stage's gradient of that
mini-batch (coalesced over its micro-batches) is final and its optimizer
steps. The weights each F and B use are in the schedule's version table
(:mod:`stagewise.asynchronous.versions`, where the equations are).

p=3, N=4, m=1 (PipeDream; B takes two units, SYNC and STEP none, after each B)::

    rank 0  F0 F1 F2 .  .  .  .  B0--- F3 B1--- .  B2--- .  B3---
    rank 1  .  F0 F1 .  .  B0--- F2 B1--- F3 B2--- .  B3--- .  .
    rank 2  .  .  F0 B0--- F1 B1--- F2 B2--- F3 B3--- .  .  .  .

and the version each mini-batch's F and B use under weight stashing (``3v1``:
mini-batch 3 on W^(1), the weights after one update)::

    stage 0  0v0 1v0 2v0 3v1
    stage 1  0v0 1v0 2v1 3v2
    stage 2  0v0 1v1 2v2 3v3

Stage s's backward of i runs p - s - 1 updates after its forward: with
stashing it still differentiates the forward's version, so s keeps p - s.
Timed with uniform costs the window takes (N*m + p - 1)(F + B): a bubble of
(p - 1)/(N*m + p - 1) that vanishes as the window grows, and one mini-batch
per m(F + B) in the steady state.
"""

from __future__ import annotations

import numpy as np

from ..asynchronous import POLICIES, VersionTable, version_table
from ..ir import STEP as _STEP
from ..ir import SYNC as _SYNC
from ..ir import ActionRows, Kind, Schedule, from_rows, loop_placement
from ..ir import B as _B
from ..ir import F as _F
from .registry import register

F, B, SYNC, STEP = Kind.F, Kind.B, Kind.SYNC, Kind.STEP

#: registered name -> what it is
ASYNC_NAMES = ("pipedream", "pipedream-2bw", "xpipe")


def no_flush_1f1b(p: int, minibatches: int, microbatches: int) -> ActionRows:
    """Each rank's 1F1B order over N*m micro-batches, with SYNC and STEP after each mini-batch's last backward.

    Computed as columns (no action objects; :class:`~stagewise.ir.columns.ActionRows` makes a rank's row when
    asked): at 128 ranks x 1024 micro-batches the window holds ~1 M actions, and the version table, its
    check and the lowering all read the columns.
    """
    total, m = minibatches * microbatches, microbatches
    i = np.arange(total, dtype=np.int64)
    ends = i % m == m - 1  # the last backward of a mini-batch: SYNC and STEP follow it
    rows = []
    for r in range(p):
        w = min(p - r - 1, total)
        has_f = (w + i < total).astype(np.int64)
        size = has_f + 1 + 2 * ends
        at = w + np.cumsum(size) - size  # where micro-batch i's block (F of w+i, B of i, SYNC, STEP) starts
        kind = np.empty(w + int(size.sum()), np.int64)
        mb = np.full(kind.size, -1, np.int64)
        kind[:w], mb[:w] = _F, np.arange(w)
        f_at = at[has_f == 1]
        kind[f_at], mb[f_at] = _F, np.arange(w, total)
        b_at = at + has_f
        kind[b_at], mb[b_at] = _B, i
        kind[b_at[ends] + 1], kind[b_at[ends] + 2] = _SYNC, _STEP
        rows.append((kind, np.full(kind.size, r, np.int64), mb))
    return ActionRows(from_rows(rows))


def policy_of(name: str, *, stashing: bool = True, vertical_sync: bool = False) -> str:
    """The weight-version policy of a registered asynchronous schedule and its options."""
    if name == "pipedream":
        if vertical_sync and not stashing:
            raise ValueError(
                "pipedream: vertical_sync=True needs stashing=True (a micro-batch's backward uses the version "
                "its forward was tagged with, which is a stashed version)"
            )
        return "vertical" if vertical_sync else ("stash" if stashing else "none")
    if name in ("pipedream-2bw", "xpipe"):
        if not stashing or vertical_sync:
            raise ValueError(
                f"{name}: the options stashing / vertical_sync belong to 'pipedream'; {name} fixes its versions "
                f"(got stashing={stashing}, vertical_sync={vertical_sync})"
            )
        return "2bw" if name == "pipedream-2bw" else "predict"
    raise ValueError(f"unknown asynchronous schedule {name!r}; expected one of {', '.join(ASYNC_NAMES)}")


def async_schedule(
    name: str,
    num_ranks: int,
    minibatches: int,
    microbatches: int = 1,
    *,
    stashing: bool = True,
    vertical_sync: bool = False,
) -> Schedule:
    """The compute-only window of ``minibatches`` mini-batches of ``microbatches`` each, with its version table.

    ``name``: ``"pipedream"`` (options ``stashing``, ``vertical_sync``),
    ``"pipedream-2bw"`` or ``"xpipe"``. The result's ``meta["versions"]`` is
    the :class:`~stagewise.asynchronous.versions.VersionTable`, whose rules are checked here
    (:func:`stagewise.validate.versions.validate_versions`); the order is checked
    by :func:`stagewise.lower` as every schedule's.
    """
    from ..validate import validate_versions

    policy = policy_of(name, stashing=stashing, vertical_sync=vertical_sync)
    p, n_mb, m = num_ranks, minibatches, microbatches
    if p < 1:
        raise ValueError(f"schedule {name!r}: need at least 1 rank, got {p}")
    if m < 1:
        raise ValueError(f"schedule {name!r}: need at least 1 micro-batch per mini-batch, got microbatches={m}")
    if n_mb < 1:
        raise ValueError(f"schedule {name!r}: need at least 1 mini-batch in the window, got minibatches={n_mb}")
    if policy == "2bw" and m < p - 1:
        raise ValueError(
            f"schedule 'pipedream-2bw' with {p} ranks needs at least p - 1 = {p - 1} micro-batches per mini-batch, "
            f"got {m}: mini-batch t uses W(t-1), which stage 0 only has once mini-batch t-2 has left it"
        )
    ranks = no_flush_1f1b(p, n_mb, m)
    table = version_table(ranks, p, policy, n_mb, m)
    label = {"stash": "pipedream", "none": "pipedream-nostash", "vertical": "pipedream-vsync"}.get(policy, name)
    schedule = Schedule(
        name=label,
        num_microbatches=n_mb * m,
        placement=loop_placement(p),
        ranks=ranks,
        meta={"placement": "loop", "versions": table},
    )
    validate_versions(schedule)
    return schedule


_NAME_OF_POLICY: dict[str, tuple[str, dict[str, bool]]] = {
    "stash": ("pipedream", {}),
    "none": ("pipedream", {"stashing": False}),
    "vertical": ("pipedream", {"vertical_sync": True}),
    "2bw": ("pipedream-2bw", {}),
    "predict": ("xpipe", {}),
}


def window_of(schedule: Schedule, minibatches: int) -> Schedule:
    """The same asynchronous schedule (policy, ranks, micro-batches per mini-batch) over ``minibatches``."""
    table = schedule.meta.get("versions")
    if not isinstance(table, VersionTable):
        raise ValueError(f"schedule {schedule.name!r} is not asynchronous (it has no version table)")
    name, options = _NAME_OF_POLICY[table.policy]
    return async_schedule(name, schedule.num_ranks, minibatches, table.microbatches, **options)


def registry_minibatch(name: str, p: int, m: int) -> int:
    """Micro-batches per mini-batch when an asynchronous schedule is built by name with m micro-batches in all.

    PipeDream: 1 (m mini-batches). 2BW and XPipe: p (m/p mini-batches); use
    :func:`async_schedule` for other sizes.
    """
    return 1 if name == "pipedream" else max(1, p)


def _builder(name: str) -> object:
    def build(p: int, m: int, v: int) -> Schedule:
        size = registry_minibatch(name, p, m)
        if m % size:
            raise ValueError(
                f"by name, {name} runs mini-batches of p = {size} micro-batches, so m must be a multiple of {size}"
            )
        return async_schedule(name, p, m // size, size)

    return build


#: each registered schedule's rule, for its docstring (W_s^(c): stage s after c updates; i = t*m + k;
#: c_F, c_B: the updates stage s made before its F / B of i; update c applies mini-batch c's gradient)
_RULES = {
    "pipedream": """PipeDream: 1F1B without a flush, one update per mini-batch at each stage.

    Weight stashing (default):  F(s, i) and B(s, i) use W_s^(c_F(s, i)); with m = 1,
        c_F(s, i) = max(0, i - (p - s - 1)), c_B(s, i) = i, so B differentiates a version p - s - 1 updates old.
    stashing=False:             F uses W_s^(c_F), B uses W_s^(c_B) (stage recomputed from its saved input).
    vertical_sync=True:         F and B of (s, i) use W_s^(c_F(0, i)), the version tagged at stage 0.
    Update t (STEP t, after B(s, tm + m - 1)): W_s^(t+1) = opt(W_s^(t), sum_k grad of w_k loss_k at the version used).
    """,
    "pipedream-2bw": """PipeDream-2BW: every micro-batch of mini-batch t uses W_s^(max(0, t - 1)) for F and B.

    Update t: W_s^(t+1) = opt(W_s^(t), sum_k grad f_k(W^(t-1))), i.e. W(t+1) = W(t) - lr grad f(W(t-1)) under SGD;
    two versions per stage; needs m >= p - 1 (W^(t-1) must exist at t's first forward on stage 0).
    """,
    "xpipe": """XPipe: mini-batch t's first forward at stage s sees W_s^(c), c = c_F(s, tm), and predicts
    Ŵ = W_s^(c) - lr * d * u(c) with d = t - c, the updates that land before t's own; all of t's F and B use Ŵ.

    u: SGD's momentum buffer, Adam's m̂ / (sqrt(v̂) + eps) (+ wd W for AdamW). Update t: W_s^(t+1) = opt(W_s^(t),
    sum_k grad f_k(Ŵ_t)).
    """,
}


def _generator(name: str) -> object:
    def gen(p: int, m: int, v: int) -> ActionRows:
        size = registry_minibatch(name, p, m)
        return no_flush_1f1b(p, m // size, size)

    gen.__doc__ = _RULES[name] + "\n    The order:" + (no_flush_1f1b.__doc__ or "")
    gen.__name__ = name.replace("-", "_")
    return gen


_PAPERS = {
    "pipedream": "Narayanan et al., PipeDream: Generalized Pipeline Parallelism for DNN Training, SOSP 2019 "
    "(weight stashing, vertical sync)",
    "pipedream-2bw": "Narayanan et al., Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW), ICML 2021",
    "xpipe": "Guan et al., XPipe: Efficient Pipeline Model Parallelism for Multi-GPU DNN Training, 2019 "
    "(weight prediction)",
}
_SUMMARIES = {
    "pipedream": "asynchronous 1F1B, no flush, one update per mini-batch; weights stashed (or not, or vertical sync)",
    "pipedream-2bw": "asynchronous 1F1B over mini-batches of m micro-batches, updates one mini-batch late: "
    "W(t+1) = W(t) - lr grad f(W(t-1))",
    "xpipe": "asynchronous 1F1B; each mini-batch runs on weights predicted for its own update from the optimizer",
}
_MEMORY = {
    "pipedream": "min(p, m) (+ p - s weight versions at stage s)",
    "pipedream-2bw": "min(p, m) (+ 2 weight versions)",
    "xpipe": "min(p, m) (+ 1 + mini-batches in flight weight versions)",
}

# (the synchronous schedules are registered first, whoever imports this module first: the package's door loads
# them before it; tables list them first)
for _name in ASYNC_NAMES:
    register(
        _name,
        summary=_SUMMARIES[_name],
        paper=_PAPERS[_name],
        bubble="(p-1)/(m+p-1) per window of m micro-batches, 0 in the steady state",
        memory=_MEMORY[_name],
        synchronous=False,
        build=_builder(_name),  # type: ignore[arg-type]
    )(_generator(_name))  # type: ignore[arg-type]

__all__ = ["ASYNC_NAMES", "POLICIES", "async_schedule", "no_flush_1f1b", "policy_of", "window_of"]
