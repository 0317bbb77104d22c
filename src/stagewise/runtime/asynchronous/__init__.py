"""Asynchronous pipelines at run time: weight versions, the version-aware interpreter, windows of a stream."""
