"""The command line: ``stagewise schedules | simulate | run | plan | compare`` (one module per command)."""

from .main import main

__all__ = ["main"]
