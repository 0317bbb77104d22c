"""What the library reports while it trains: per-step metrics (JSON lines, TensorBoard), a progress line, events,
memory, and the files a run leaves (the gathered state dict, the loss plot).

``config.py`` reads ``metrics=`` / ``progress=``; ``record.py`` turns a step into its numbers; ``sinks.py`` writes
them (a failing disk is one log line, never a stopped run); ``reporter.py`` is the step part the assembly
registers; ``memory.py`` is :meth:`~stagewise.Pipeline.memory_report`; ``files.py`` the helpers a script calls.
"""
