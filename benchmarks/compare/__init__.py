"""The seeds' comparison: every pipeline method on the same workloads (``python -m benchmarks.compare``)."""
