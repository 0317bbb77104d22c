"""Helpers the test folders share (importable as ``helpers``: pyproject's pytest ``pythonpath`` names tests/)."""
