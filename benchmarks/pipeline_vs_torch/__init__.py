"""stagewise against torch.distributed.pipelining (``python -m benchmarks.pipeline_vs_torch``)."""
