"""What ``Pipeline.relayout`` returns: where the pipeline stands after it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """Where the pipeline stands after a re-layout (the same on every process but ``pp_rank``/``local_stages``).

    ``members``: the global ranks holding it; ``inputs_at`` / ``targets_at``: those holding the first / last
    stage (who reads inputs / targets); ``seconds``: the time of each part; ``bytes_moved``: across processes.
    """

    generation: int
    members: tuple[int, ...]
    schedule: str
    num_ranks: int
    microbatches: int
    placement: tuple[int, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    parallel: dict[str, int] | None
    inputs_at: tuple[int, ...]
    targets_at: tuple[int, ...]
    pp_rank: int | None
    local_stages: tuple[int, ...]
    bytes_moved: int
    seconds: dict[str, float] = field(default_factory=dict)
