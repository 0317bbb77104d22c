"""Hybrid parallelism, the pure part: the degrees of each mesh axis and where each rank sits (no torch)."""

from .config import AXES, Coords, ParallelConfig

__all__ = ["AXES", "Coords", "ParallelConfig"]
