"""The command line: ``stagewise schedules | simulate | synthesize | run | plan | compare`` (one module per command).

:mod:`.main` holds the parser and the dispatch; ``python -m stagewise.cli`` runs it as the console script does.
"""

from .main import main

__all__ = ["main"]
