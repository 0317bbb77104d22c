"""How near a live member came to being counted silent: the stand-stills the membership read of stamps that moved.

A member whose stamps stand still ``silent_s`` is counted lost (:meth:`.membership.Membership.silent`). A live
member's stamping thread can be held too - a machine whose cores run far more processes than it has - and the
only sign of how near that came is the stamp moving again after a long stand-still. Kept here, read as the
membership reads a silence (from the first look that saw the stamp to the last look before it moved, unbroken
watching only), so the margin is ``silent_s`` minus :attr:`SilenceMargin.live_s`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SilenceMargin:
    """The longest stand-still read of a stamp that then moved, below the bound (``live_s``, seconds), and how many
    moved after a stand-still at or past it (``came_back``: read as gone while alive, a false silence, or a stopped
    process woken before the agreement left it out)."""

    live_s: float = 0.0
    came_back: int = 0

    def moved(self, seen: tuple[bytes | None, float] | None, last_look: float, bound_s: float) -> None:
        """A member's stamp differs from ``seen`` (its last stamp here and since when, on this worker's clock; None:
        first read): it stood still until ``last_look``, the last look before this one."""
        if seen is None or seen[0] is None:
            return
        still = max(0.0, last_look - seen[1])
        if still >= bound_s:
            self.came_back += 1
        else:
            self.live_s = max(self.live_s, still)
