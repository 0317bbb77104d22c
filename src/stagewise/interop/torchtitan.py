"""What torchtitan does with a schedule CSV, as data: the settings that load a stagewise file
(:func:`torchtitan_settings`) and a check of a file against a job's settings before it starts
(:func:`torchtitan_problems`).

Read from torchtitan's pipeline setup (``torchtitan/distributed/pipeline_parallel.py``), checked against its
main branch at commit b5bcd76c (2026-08-21) and its release v0.2.2 (commit 73a0e697, 2026-02-20, the last
one configured by TOML files). Both do the same with a CSV file:

* the schedule *class* named by ``pipeline_parallel_schedule`` decides how many stages each rank builds
  (one for a single-stage class such as ``1F1B`` or ``GPipe``; two for a multi-stage class, or as many as
  ``pipeline_parallel_layers_per_stage`` / ``module_fqns_per_model_part`` make, at least two) and where
  (``ZBVZeroBubble`` and ``DualPipeV`` in a V, rank r holding stages r and 2p-1-r; every other class looped,
  rank r holding r, r+p, ...). The file does not: a file whose stages sit elsewhere fails to load, or loads
  and then runs other stages' actions;
* it then builds torch's ``_PipelineScheduleRuntime`` with the micro-batch count (main:
  ``num_pp_microbatches``; v0.2.2: ``local_batch_size // pipeline_parallel_microbatch_size``) and calls
  ``_load_csv(path)``, the ``compute_only`` format: a file holding communication (``compute_comms``) is
  refused, and so is one whose stages do not run exactly that many micro-batches.

Pure: class names are compared as text (torch's ``get_schedule_class`` spelling, any case); the runtime test
(tests/runtime/test_torchtitan_recipe.py) checks this table against torch's classes and runs the settings
through torch's own loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Schedule, loop_placement, v_placement
from .torch_orders import torch_placement, torch_problems

#: the torchtitan commits this module was read from and checked against
CHECKED_AGAINST = {
    "main": "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (2026-08-21)",
    "v0.2.2": "73a0e6979dd10b6b1904098eb3c8f62c18ab87ce (2026-02-20)",
}
#: torch's class names (as ``get_schedule_class`` takes them) by how torchtitan places their stages
ONE_STAGE = ("1F1B", "GPipe", "PipelineScheduleSingle")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "PipelineScheduleMulti")
CLASSES = (*ONE_STAGE, *LOOPED, *V_SHAPED)


@dataclass(frozen=True)
class TorchtitanSettings:
    """torchtitan's settings for a schedule file: ``parallelism.<field>`` of its configuration."""

    pipeline_parallel_schedule: str
    pipeline_parallel_degree: int
    stages_per_rank: int
    num_pp_microbatches: int

    @property
    def placement(self) -> str:
        """How the class places the stages, in words."""
        v = self.stages_per_rank
        if v == 1:
            return "one stage per rank"
        return f"{v} stages per rank, " + ("in a V" if self.pipeline_parallel_schedule in V_SHAPED else "looped")

    @property
    def stages_note(self) -> str | None:
        """What else torchtitan needs for more than two stages per rank (None: its class's default fits)."""
        if self.stages_per_rank <= 2:
            return None
        n = self.stages_per_rank * self.pipeline_parallel_degree
        return (
            f"{n} stages: set pipeline_parallel_layers_per_stage so that ceil((layers + 2) / it) = {n} (with "
            f"the default first / last_stage_less_layers = 1), or module_fqns_per_model_part to {n} lists"
        )

    def flags(self, csv_path: str) -> str:
        """The command-line overrides of torchtitan's main branch (``./run_train.sh ...``)."""
        return (
            f"--parallelism.pipeline_parallel_degree {self.pipeline_parallel_degree} "
            f"--parallelism.pipeline_parallel_schedule {self.pipeline_parallel_schedule} "
            f"--parallelism.pipeline_parallel_schedule_csv {csv_path} "
            f"--parallelism.num_pp_microbatches {self.num_pp_microbatches}"
        )

    def lines(self, csv_path: str) -> list[str]:
        """What ``stagewise synthesize`` prints: the class, the placement, the flags, the extra setting."""
        out = [
            f"torchtitan: {self.placement}: pipeline_parallel_schedule {self.pipeline_parallel_schedule}, "
            f"num_pp_microbatches {self.num_pp_microbatches} (loads compute_only files)",
            f"  {self.flags(csv_path)}",
        ]
        return out + ([f"  {self.stages_note}"] if self.stages_note else [])


def torchtitan_settings(schedule: Schedule) -> TorchtitanSettings:
    """The torchtitan settings that load ``schedule``'s ``compute_only`` file (``to_torch_csv(schedule)``).

    One stage per rank: ``1F1B`` (``GPipe`` does as well: the order comes from the file); looped stages:
    ``Interleaved1F1B`` (more than two per rank: see :attr:`TorchtitanSettings.stages_note`); a V:
    ``ZBVZeroBubble``. Raises ``ValueError`` for a schedule torch cannot run (:func:`torch_problems`) or
    torchtitan cannot place (build the stages yourself: ``stagewise.runtime.torch_runtime``).
    """
    problems = torch_problems(schedule)
    if problems:
        raise ValueError(f"torch's runtime cannot run schedule {schedule.name!r}: " + "; ".join(problems))
    style = torch_placement(schedule)
    classes = {"one": "1F1B", "loop": "Interleaved1F1B", "v": "ZBVZeroBubble"}
    if style not in classes:
        raise ValueError(
            f"torchtitan places stages one per rank, looped or in a V; schedule {schedule.name!r} places them "
            f"{list(schedule.placement)}: run it with stagewise.runtime.torch_runtime, stages built per "
            "schedule.stages_of(rank)"
        )
    return TorchtitanSettings(classes[style], schedule.num_ranks, schedule.virtual_stages, schedule.num_microbatches)


def torchtitan_placement(schedule_class: str, p: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage -> rank as torchtitan builds the stages for ``schedule_class`` on ``p`` ranks."""
    return v_placement(p, 2) if _canonical(schedule_class) in V_SHAPED else loop_placement(p, stages_per_rank)


def torchtitan_problems(
    schedule: Schedule,
    schedule_class: str,
    num_pp_microbatches: int,
    *,
    stages_per_rank: int | None = None,
    pipeline_parallel_degree: int | None = None,
) -> list[str]:
    """Why torchtitan, configured so, would not run ``schedule``'s file as written (empty when it would).

    ``schedule``: the file read by ``from_torch(Path(...))``. ``stages_per_rank``: what the job's
    ``pipeline_parallel_layers_per_stage`` makes (None: the class's default, 1 or 2). Checks the format
    (torchtitan loads ``compute_only``), the class (the stages it builds, and where, against the file's), the
    ranks and the micro-batch count, each problem naming the setting that fits.
    """
    want = _settings_or_none(schedule)
    fits = f" (the file fits {want.pipeline_parallel_schedule}, {want.placement})" if want else ""
    problems = _format_problems(schedule)
    name = _canonical(schedule_class)
    if name is None:
        return [*problems, f"pipeline_parallel_schedule {schedule_class!r} is not a torch class torchtitan names: "
                           f"one of {', '.join(CLASSES)}"]  # fmt: skip
    p = schedule.num_ranks
    if pipeline_parallel_degree is not None and pipeline_parallel_degree != p:
        problems.append(f"pipeline_parallel_degree {pipeline_parallel_degree}: the file has {p} rows (ranks)")
    v, refusal = _stages_per_rank(name, stages_per_rank)
    if refusal:
        problems.append(refusal + fits)
    elif v * p != schedule.num_stages:
        more = want.stages_note if want and name in LOOPED and want.stages_per_rank > 2 else None
        problems.append(
            f"{name} builds {v} stage{'s' if v > 1 else ''} per rank, {v * p} on {p} ranks; the file has "
            f"{schedule.num_stages} stages{fits}: torch's loader would stop at the first stage without forwards"
            + (f" ({more}; and -v / stages_per_rank {want.stages_per_rank} here)" if more and want else "")
        )
    else:
        built = torchtitan_placement(name, p, v)
        for rank in range(p):
            mine = tuple(s for s, r in enumerate(built) if r == rank)
            if mine != schedule.stages_of(rank):
                problems.append(
                    f"rank {rank}: {name} builds stages {list(mine)}, the file runs stages "
                    f"{list(schedule.stages_of(rank))} there{fits}"
                )
                break
    if num_pp_microbatches != schedule.num_microbatches:
        problems.append(
            f"num_pp_microbatches {num_pp_microbatches}: the file runs {schedule.num_microbatches} micro-batches per "
            f"stage (set num_pp_microbatches = {schedule.num_microbatches}; torchtitan v0.2.2: local_batch_size = "
            f"{schedule.num_microbatches} x pipeline_parallel_microbatch_size)"
        )
    return problems


def _canonical(name: str) -> str | None:
    by_lower = {c.lower(): c for c in CLASSES}
    return by_lower.get(name.lower()) or by_lower.get(name.lower().removeprefix("schedule"))


def _stages_per_rank(name: str, given: int | None) -> tuple[int, str | None]:
    """(stages per rank torchtitan builds for the class, why it refuses ``given``)."""
    if name in ONE_STAGE:
        if given not in (None, 1):
            return 1, f"{name} is a single-stage class: torchtitan builds 1 stage per rank, not {given}"
        return 1, None
    v = 2 if given is None else given
    if v < 2:
        return v, f"{name} is a multi-stage class: torchtitan builds at least 2 stages per rank, not {v}"
    if name in V_SHAPED and v != 2:
        return v, f"{name} places stages in a V: exactly 2 per rank, not {v}"
    return v, None


def _format_problems(schedule: Schedule) -> list[str]:
    for rank, acts in enumerate(schedule.ranks):
        for a in acts:
            if not a.kind.is_compute:
                return [
                    f"the file is compute_comms (rank {rank} runs {a}): torchtitan loads compute_only files; "
                    "write it with to_torch_csv(schedule) or --torch-format compute_only"
                ]
    return []


def _settings_or_none(schedule: Schedule) -> TorchtitanSettings | None:
    try:
        return torchtitan_settings(schedule)
    except ValueError:
        return None
