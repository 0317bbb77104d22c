"""The combination matrix: every way in x every option, each cell exact against its reference or refused.

Pure data, shared by the torchrun checks (``matrix_checks``), the pytest side (``test_matrix``) and the docs
(``docs/matrix.md`` is :func:`markdown` of it, checked by a test). A cell is ``EXACT`` (trained against the
one-process model in float64, or for asynchronous schedules and HetPipe the one-process replay of their
rule) or a refusal: the words the error must contain, raised on every rank before the mesh's process groups
exist (for a column used after building, :data:`AT_USE`, when it is used); or, in :data:`SAME_AS`, exact by the
same code as its column's trained cell of another row, not run again (CI time). This is the specification: the
checks compute what happens and compare it with what is written here.
"""

from __future__ import annotations

ROWS: dict[str, str] = {
    "layers": "`Pipeline(layers)`",
    "from_model": "`Pipeline.from_model`",
    "from_hf": "`Pipeline.from_hf`",
    "from_stages": "`Pipeline.from_stages`",
    "from_plan": "`Pipeline.from_plan`",
    "hetpipe": "`HetPipe`",
}

COLUMNS: dict[str, str] = {
    "dp": "`parallel=` dp",
    "sharding": "`parallel=` sharding",
    "tp": "`parallel=` tp",
    "recompute": "`recompute=`",
    "bn_micro": '`batchnorm="micro"`',
    "bn_deferred": '`batchnorm="deferred"`',
    "nan_raise": '`nan_policy="raise"`',
    "nan_skip": '`nan_policy="skip"`',
    "autocast": "`autocast=`",
    "tied": "tied weights",
    "async": "asynchronous schedule",
    "measure_memory": "`measure_memory=`",
    "offload": '`offload="optimizer"`',
    "checkpoint": "checkpoint save / load",
    "merge": "gradient merge (`no_sync()`)",
    "snapshot": "`snapshot=`",
    "relayout": "`pipe.relayout()`",
    "metrics": "`metrics=`",
    "progress": "`progress=`",
    "lr_scheduler": "`lr_scheduler=`",
    "clip": "`clip=`",
}

EXACT = "exact"

#: columns that are not options but calls on a built pipeline: refused when called (``pipe.no_sync()``)
AT_USE = ("merge", "relayout")

#: refusals: the words every rank's error must contain (and the reason, for the docs)
HETPIPE_AXES = "HetPipe does not take parallel="
FROM_STAGES_TIED = "holds a sw.Tied: a tie across ranks is invisible"
PLAN_ASYNC = "plans run synchronous schedules"
HETPIPE_BN = "HetPipe does not take batchnorm="
HETPIPE_SKIP = "HetPipe does not take nan_policy='skip'"
HETPIPE_TIED = "HetPipe does not take tied modules"
HETPIPE_NO_SYNC = "HetPipe does not take no_sync()"
HETPIPE_SNAPSHOT = "HetPipe does not take snapshot="
HETPIPE_RELAYOUT = "HetPipe.relayout: refused"
PLAN_RELAYOUT = "set by the plan of this pipeline"

_REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    ("hetpipe", "dp"): (HETPIPE_AXES, "the virtual workers are HetPipe's data parallelism"),
    ("hetpipe", "sharding"): (HETPIPE_AXES, "each virtual worker's pipeline runs on its own ranks"),
    ("hetpipe", "tp"): (HETPIPE_AXES, "each virtual worker's pipeline runs on its own ranks"),
    ("hetpipe", "bn_micro"): (HETPIPE_BN, "the wave rule shares parameters only, not running statistics"),
    ("hetpipe", "bn_deferred"): (HETPIPE_BN, "the wave rule shares parameters only, not running statistics"),
    ("hetpipe", "nan_skip"): (HETPIPE_SKIP, "a virtual worker cannot skip a wave's update the others count"),
    ("hetpipe", "tied"): (HETPIPE_TIED, "each parameter needs one owner per virtual worker"),
    ("hetpipe", "merge"): (HETPIPE_NO_SYNC, "each wave's update is pushed to the other virtual workers as it ends"),
    ("hetpipe", "snapshot"): (HETPIPE_SNAPSHOT, "a virtual worker's state includes the wave rule's: use checkpoints"),
    ("hetpipe", "relayout"): (HETPIPE_RELAYOUT, "the virtual workers and the wave rule are laid out together"),
    ("from_plan", "relayout"): (PLAN_RELAYOUT, "the plan sets the layout: re-layout with plan="),
    ("from_stages", "tied"): (FROM_STAGES_TIED, "a tie across ranks is invisible to stages built apart"),
    ("from_plan", "async"): (PLAN_ASYNC, "the planner searches synchronous schedules only"),
}


_OBSERVER = "metrics= reads what the step holds, the same Reporter whatever the way in"
_PROGRESS = "the progress line is the same Reporter's, whatever the way in"
_SCHEDULER = "a scheduler wraps each stage's own optimizer=, whatever the way in"
_FINITE = "the finite check reads the loss and gradients the step holds, and holds back its optimizer step"
_CLIP = "the norm depends on the axes and the ties, trained in the other rows, not on how the stages were built"

_NAN = ("nan_raise", "nan_skip")

#: cells exact by the same code as another cell of their column, which is trained; not run again (CI time):
#: cell -> (the trained row, why it is the same path). Each ``Pipeline`` way in ends in one assembly
#: (runtime/assembly/assemble.py), where these four options plug in as step parts.
SAME_AS: dict[tuple[str, str], tuple[str, str]] = {
    **{(row, "metrics"): ("layers", _OBSERVER) for row in ("from_model", "from_stages", "from_plan", "hetpipe")},
    **{(row, "progress"): ("layers", _PROGRESS) for row in ROWS if row != "layers"},
    **{(row, "lr_scheduler"): ("layers", _SCHEDULER) for row in ("from_model", "from_hf", "from_stages", "from_plan")},
    **{(row, "clip"): ("layers", _CLIP) for row in ("from_stages", "from_plan")},
    **{(row, c): ("layers", _FINITE) for row in ("from_model", "from_hf", "from_stages", "from_plan") for c in _NAN},
}


def expected(row: str, column: str) -> str:
    """``EXACT``, or the words the refusal of this cell must contain."""
    return _REFUSED.get((row, column), (EXACT, ""))[0]


def cells() -> list[tuple[str, str]]:
    """The cells the matrix job runs (every one but :data:`SAME_AS`'s)."""
    return [(r, c) for r in ROWS for c in COLUMNS if (r, c) not in SAME_AS]


def markdown() -> str:
    """The matrix as a markdown table: ✓ for exact, ✗ with a footnote number for refused."""
    notes: list[str] = []
    lines = ["| | " + " | ".join(COLUMNS.values()) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row, label in ROWS.items():
        out = []
        for column in COLUMNS:
            refusal = _REFUSED.get((row, column))
            same = SAME_AS.get((row, column))
            if refusal is None and same is None:
                out.append("✓")
                continue
            if same is not None:
                text = f"exact, not run again: the same path as the trained {ROWS[same[0]]} cell ({same[1]})"
            else:
                text = f"refused: {refusal[1]}"  # type: ignore[index]
            mark = "✓" if same is not None else "✗"
            if text not in notes:
                notes.append(text)
            out.append(f"{mark} ({notes.index(text) + 1})")
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    lines.append("")
    lines += [f"{k}. {text}" for k, text in enumerate(notes, start=1)]
    return "\n".join(lines) + "\n"
