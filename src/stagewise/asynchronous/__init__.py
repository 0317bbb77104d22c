"""Asynchronous pipelines, the pure part: weight versions as data (PipeDream, 2BW, XPipe) and HetPipe's wave rule.

* :mod:`.table`: a weight-version table as plain data (:class:`VersionTable`, :class:`Version`);
* :mod:`.versions`: which weights every forward and backward uses, the rules that make a table;
* :mod:`.arrays` / :mod:`.reference`: the same computations on integer columns (what runs at scale) and
  action by action (what the arrays are property-tested against, and the fallback for unlowered lists);
* :mod:`.wsp`: HetPipe's wave-synchronous parallel: virtual workers, clocks, the staleness bound.
"""

from .arrays import live_version_counts, running_counts, without_comm
from .table import POLICIES, Version, VersionTable
from .versions import live_versions, step_counts, version_bound, version_rows, version_table
from .wsp import StalenessError, VWLayout, WaveRule, check_clocks, check_more

__all__ = [
    "POLICIES",
    "StalenessError",
    "VWLayout",
    "Version",
    "VersionTable",
    "WaveRule",
    "check_clocks",
    "check_more",
    "live_version_counts",
    "live_versions",
    "running_counts",
    "step_counts",
    "version_bound",
    "version_rows",
    "version_table",
    "without_comm",
]
