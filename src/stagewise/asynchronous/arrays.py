"""The live-version sweep (:func:`.versions.live_versions`) on a schedule's integer columns.

Why: the validator's bound check and ``stagewise simulate`` on an asynchronous
schedule count the weight versions alive at every action; at 128 ranks x 1024
micro-batches (PipeDream: 1024 versions per stage) the list sweep takes ~0.3 s
a call and, on a lowered schedule, first makes every rank's action objects.
Here each rank's intervals come from whole-array operations: the first and last
use of each (stage, version) by ``np.unique``, each current version's span from
the positions of its stage's STEPs, the count from a difference array.
``tests/core/test_versions_fast.py`` keeps it equal to the list sweep.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..ir import RECV_B, SEND_F, Columns, in_range
from ..ir import STEP as _STEP
from ..ir import B as _B
from ..ir import F as _F
from .table import Version, VersionTable


def without_comm(cols: Columns) -> Columns:
    """The columns with the SEND/RECV actions dropped (what the version sweep counts over)."""
    keep = (cols.kind < SEND_F) | (cols.kind > RECV_B)
    if keep.all():
        return cols
    base = np.zeros_like(cols.base)
    np.cumsum(np.bincount(cols.rank[keep], minlength=cols.base.size - 1), out=base[1:])
    return Columns(kind=cols.kind[keep], stage=cols.stage[keep], microbatch=cols.microbatch[keep], base=base)


def live_version_counts(cols: Columns, table: VersionTable) -> list[np.ndarray] | None:
    """Per rank, the versions alive at each of its actions (as :func:`.versions.live_versions`), or None
    when the columns do not fit the table (a stage or micro-batch out of its range): the list sweep handles those.

    Every action counts as a position, as in the list sweep: pass :func:`without_comm` columns to count
    over the compute and STEP actions only.
    """
    n, total = table.num_stages, table.minibatches * table.microbatches
    if not in_range(cols, n, total) or any(len(row) != total for row in (*table.forward, *table.backward)):
        return None
    # every version as two ints (base, ahead), by stage and micro-batch, for F and for B
    fwd = _pairs(table.forward, n, total)
    bwd = fwd if table.backward == table.forward else _pairs(table.backward, n, total)
    if fwd.size and (int(fwd.min()) < 0 or int(bwd.min()) < 0):  # not a count of STEPs: the list sweep decides
        return None
    return [_rank_counts(cols, r, fwd, bwd) for r in range(cols.base.size - 1)]


def _pairs(rows: tuple[tuple[Version, ...], ...], n: int, total: int) -> np.ndarray:
    """``rows`` as an (n, total, 2) array of (base, ahead): flattened in C (``np.asarray`` of tuples: ~10x slower)."""
    flat = chain.from_iterable(chain.from_iterable(rows))
    return np.fromiter(flat, np.int64, 2 * n * total).reshape(n, total, 2)


def _objects(rows: tuple[tuple[Version, ...], ...], n: int, total: int) -> np.ndarray:
    """The rows' Version objects, flat (stage-major), as an object array."""
    return np.fromiter(chain.from_iterable(rows), dtype=object, count=n * total)


def _rank_counts(cols: Columns, rank: int, fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    a, b = int(cols.base[rank]), int(cols.base[rank + 1])
    end = b - a
    kind, stage, mb = cols.kind[a:b], cols.stage[a:b], cols.microbatch[a:b]
    if not end:
        return np.zeros(0, np.int64)
    used = np.flatnonzero((kind == _F) | (kind == _B))
    s_u, i_u = stage[used], mb[used]
    version = np.where((kind[used] == _F)[:, None], fwd[s_u, i_u], bwd[s_u, i_u])
    # one int per (stage, base, ahead): stage-major, so keys of a stage are contiguous and ordered by version
    span_b = int(max(version[:, 0].max(initial=0), 0)) + 2 + int(np.count_nonzero(kind == _STEP))
    span_a = int(version[:, 1].max(initial=0)) + 1
    key = (s_u * span_b + version[:, 0]) * span_a + version[:, 1]
    keys, first = np.unique(key, return_index=True)
    last_rev = np.unique(key[::-1], return_index=True)[1]
    lo_use, hi_use = used[first], used[used.size - 1 - last_rev]
    # the current weights: W^(c) of stage s from the STEP that makes it to the one that replaces it
    lo_parts, hi_parts, key_parts = [], [], []
    for s in np.unique(stage).tolist():
        at = np.flatnonzero((kind == _STEP) & (stage == s))
        c = np.arange(at.size + 1, dtype=np.int64)
        lo_parts.append(np.concatenate([[0], at + 1]))
        hi_parts.append(np.concatenate([at, [end - 1]]))
        key_parts.append((s * span_b + c) * span_a)
    cur_key = np.concatenate(key_parts)
    cur_lo, cur_hi = np.concatenate(lo_parts), np.concatenate(hi_parts)
    # an older version is kept until its last use: a used key that is also a current one widens that interval
    where = np.searchsorted(keys, cur_key)
    hit = where < keys.size
    hit[hit] = keys[where[hit]] == cur_key[hit]
    cur_lo[hit] = np.minimum(cur_lo[hit], lo_use[where[hit]])
    cur_hi[hit] = np.maximum(cur_hi[hit], hi_use[where[hit]])
    only_used = np.ones(keys.size, bool)
    only_used[where[hit]] = False
    lo = np.concatenate([cur_lo, lo_use[only_used]])
    hi = np.concatenate([cur_hi, hi_use[only_used]])
    alive = lo <= hi
    diff = np.bincount(lo[alive], minlength=end + 1) - np.bincount(hi[alive] + 1, minlength=end + 1)
    return np.cumsum(diff[:end])


def running_counts(cols: Columns, n: int, mask: np.ndarray) -> np.ndarray:
    """For each action: how many actions of ``mask`` of the same rank and stage come before it (exclusive)."""
    key = cols.rank * n + cols.stage
    order = np.argsort(key, kind="stable")
    hits = mask[order].astype(np.int64)
    run = np.cumsum(hits) - hits
    k = key[order]
    new = np.ones(k.size, bool)
    new[1:] = k[1:] != k[:-1]
    group = np.cumsum(new) - 1
    out = np.empty(k.size, np.int64)
    out[order] = run - run[np.flatnonzero(new)][group]
    return out


def step_counts_columns(cols: Columns, n: int, total: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(c_F, c_B) of :func:`.versions.step_counts` as (n, total) arrays; None when an (F or B, stage,
    micro-batch) repeats (the list code's order of overwriting decides then). Columns in range only."""
    before = running_counts(cols, n, cols.kind == _STEP)
    out = []
    for code in (_F, _B):
        sel = cols.kind == code
        at = cols.stage[sel] * total + cols.microbatch[sel]
        if at.size and int(np.bincount(at, minlength=n * total).max()) > 1:
            return None
        row = np.full(n * total, -1, np.int64)
        row[at] = before[sel]
        out.append(row.reshape(n, total))
    return out[0], out[1]


def first_forward_columns(cols: Columns, n: int, minibatches: int, m: int) -> np.ndarray:
    """first[s][t] of :func:`.versions._first_forward`: stage s's first forward of mini-batch t, or -1."""
    sel = np.flatnonzero(cols.kind == _F)
    t = cols.microbatch[sel] // m
    ok = (t >= 0) & (t < minibatches)
    sel, t = sel[ok], t[ok]
    key = cols.stage[sel] * minibatches + t
    keys, first = np.unique(key, return_index=True)
    out = np.full(n * minibatches, -1, np.int64)
    out[keys] = cols.microbatch[sel[first]]
    return out.reshape(n, minibatches)


_KIND_TEXT = ("F", "B", "I", "W")


def lifetimes_columns(
    cols: Columns, n: int, fwd: tuple[tuple[Version, ...], ...], bwd: tuple[tuple[Version, ...], ...]
) -> tuple[list[dict[str, tuple[Version, ...]]], list[list[bool]]]:
    """``release`` and ``keep_at_step`` of :func:`.versions._lifetimes` (same values) from the columns."""
    total = len(fwd[0]) if fwd else 0
    f_pairs = _pairs(fwd, n, total)
    b_pairs = f_pairs if bwd == fwd else _pairs(bwd, n, total)
    kind, stage, mb = cols.kind, cols.stage, cols.microbatch
    is_step = kind == _STEP
    steps_of = np.bincount(stage[is_step], minlength=n)
    used = np.flatnonzero((kind == _F) | (kind == _B))
    s_u, i_u = stage[used], mb[used]
    version = np.where((kind[used] == _F)[:, None], f_pairs[s_u, i_u], b_pairs[s_u, i_u])
    # W^(c) used after the STEP that replaced it on this rank: keep a copy at that STEP
    count = running_counts(cols, n, is_step)[used]
    late = (version[:, 1] == 0) & (version[:, 0] < count)
    offset = np.concatenate([[0], np.cumsum(steps_of + 1)])  # stage s's flags: offset[s] .. offset[s + 1] - 1
    flags = np.zeros(int(offset[-1]), bool)
    flags[offset[s_u[late]] + version[late, 0]] = True
    keep = np.split(flags, offset[1:-1])
    # each (stage, version)'s last use: the first occurrence scanning backwards
    span_b = int(version[:, 0].max(initial=0)) + 1
    span_a = int(version[:, 1].max(initial=0)) + 1
    key = (s_u * span_b + version[:, 0]) * span_a + version[:, 1]
    _, last_rev = np.unique(key[::-1], return_index=True)
    last = used.size - 1 - last_rev  # index into used, ascending by (stage, base, ahead)
    last = last[np.argsort(used[last], kind="stable")]  # grouped by the action, versions ascending within it
    # the table's own Version objects, picked per use, then one tuple per releasing action
    flat = s_u[last] * total + i_u[last]
    objects = _objects(fwd, n, total)[flat]
    if bwd != fwd:
        of_b = kind[used[last]] != _F
        objects[of_b] = _objects(bwd, n, total)[flat[of_b]]
    pos = used[last]
    starts = np.flatnonzero(np.concatenate([[True], pos[1:] != pos[:-1]]))
    picked = objects.tolist()
    if starts.size == pos.size:  # one version per releasing action (the common case)
        groups: list[tuple[Version, ...]] = [(v,) for v in picked]
    else:
        bounds = [*starts.tolist(), pos.size]
        groups = [tuple(picked[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    at = pos[starts]
    by_stage = np.argsort(stage[at], kind="stable")
    stages = stage[at][by_stage].tolist()
    texts = [
        f"{s}{_KIND_TEXT[k]}{i}"
        for s, k, i in zip(stages, kind[at][by_stage].tolist(), mb[at][by_stage].tolist(), strict=True)
    ]
    groups = [groups[j] for j in by_stage.tolist()]
    cut = np.searchsorted(np.asarray(stages, np.int64), np.arange(n + 1)).tolist()
    # one entry per releasing action: an action's text fixes its stage, kind and micro-batch, hence the one
    # version it uses, so a repeat of it elsewhere uses that version too and only the last copy releases it
    release = [dict(zip(texts[cut[s] : cut[s + 1]], groups[cut[s] : cut[s + 1]], strict=True)) for s in range(n)]
    return release, [k.tolist() for k in keep]
