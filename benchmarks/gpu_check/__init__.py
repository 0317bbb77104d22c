"""The GPU check (issue 34), run as ``python -m benchmarks.gpu_check`` (``make gpu-check``): see ``__main__``."""
