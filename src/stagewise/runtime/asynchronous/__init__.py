"""Asynchronous pipelines at run time: weight versions, the version-aware interpreter, streaming, the reference."""
