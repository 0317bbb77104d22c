"""A mkdocs hook: the docstrings' Sphinx roles (:func:`~a.b.name`) shown as code (``name``), not as raw text.

The docstrings are written for help() and for Sphinx-style readers; mkdocstrings renders the backquoted part
as code but keeps the role's prefix, which this removes (``~`` keeps the last dotted part, as Sphinx does).
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>(~?)([^<]+)</code>")


def _shown(match: re.Match[str]) -> str:
    tilde, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_shown, html)
