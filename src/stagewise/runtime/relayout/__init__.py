"""Re-layout: a running pipeline takes a new layout in its own processes (:func:`.call.relayout`)."""

from .call import Retired, owned_groups, relayout
from .carried import on_relayout
from .layout import Layout

__all__ = ["Layout", "Retired", "on_relayout", "owned_groups", "relayout"]
