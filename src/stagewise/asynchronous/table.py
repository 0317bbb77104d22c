"""A weight-version table as data: for every (stage, micro-batch), the version its F and its backward use.

Plain values only (the rules that make a table live in :mod:`.versions`), so that the table's computations on
arrays (:mod:`.arrays`) and action by action (:mod:`.reference`) share the type without importing the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

POLICIES = ("stash", "none", "vertical", "2bw", "predict")


class Version(NamedTuple):
    """W^(base) when ``ahead`` is 0; the prediction from W^(base) ``ahead`` updates ahead otherwise."""

    base: int
    ahead: int = 0

    def __str__(self) -> str:
        return f"v{self.base}" if self.ahead == 0 else f"v{self.base}+{self.ahead}"


@dataclass(frozen=True)
class VersionTable:
    """For every (stage, micro-batch): the version its F uses and the version its backward differentiates.

    ``forward[s][i]`` / ``backward[s][i]``; ``recompute_backward`` is True when a
    backward must recompute its forward at its own version (policy ``none``).
    ``release[s]`` maps an action of stage s (its text form, e.g. ``"1B3"``) to
    the versions nobody uses after it; ``keep_at_step[s][c]`` is True when W^(c)
    is used after the STEP that replaces it (so it must be copied before the step).
    """

    policy: str
    minibatches: int
    microbatches: int
    forward: tuple[tuple[Version, ...], ...]
    backward: tuple[tuple[Version, ...], ...]
    release: tuple[dict[str, tuple[Version, ...]], ...]
    keep_at_step: tuple[tuple[bool, ...], ...]

    @property
    def recompute_backward(self) -> bool:
        return self.policy == "none"

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def minibatch_of(self, microbatch: int) -> int:
        return microbatch // self.microbatches

    def labels(self) -> dict[str, str]:
        """``{"1F3": "3v1", ...}``: each compute action's micro-batch and the version it uses (for pictures)."""
        out = {}
        for s in range(self.num_stages):
            for i, (f, b) in enumerate(zip(self.forward[s], self.backward[s])):
                out[f"{s}F{i}"] = f"{i}{f}"
                out[f"{s}B{i}"] = f"{i}{b}"
        return out
