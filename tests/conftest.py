"""Multi-process checks live in tests/workers/ (run there by worker.py); make them importable by the tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "workers"))
