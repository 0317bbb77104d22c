"""benchmarks/RESULTS.md is a short index; every dated run lives on its benchmark's page under docs/benchmarks/.

Each page's second paragraph is its one source: "`COMMAND`. Latest (DATE): HEADLINE." The index in
benchmarks/RESULTS.md and the site's docs/benchmarks/index.md each hold one row per page, made of exactly
those three, so a new measurement recorded on its page and not in the index (or the other way) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "benchmarks"
LATEST = re.compile(r"^`(?P<command>[^`]+)`\. Latest \((?P<date>\d{4}-\d\d-\d\d)\): (?P<headline>.+)\.$", re.M)
ROW = re.compile(
    r"^\| \[(?P<title>[^\]]+)\]\((?P<link>[^)]+)\) \| (?P<headline>.+) \| `(?P<command>[^`]+)` \| (?P<date>[\d-]+) \|$"
)


def _pages() -> dict[str, dict[str, str]]:
    found = {}
    for page in sorted(PAGES.glob("*.md")):
        if page.name == "index.md":
            continue
        text = page.read_text()
        title = text.splitlines()[0].removeprefix("# ")
        latest = LATEST.search(text)
        assert latest, f"{page.name}: no line '`COMMAND`. Latest (YYYY-MM-DD): HEADLINE.' under the title"
        found[page.stem] = {"title": title, **latest.groupdict()}
    return found


def _rows(path: Path, prefix: str) -> dict[str, dict[str, str]]:
    rows = {}
    for line in path.read_text().splitlines():
        row = ROW.match(line)
        if row:
            link = row["link"]
            assert link.startswith(prefix) and link.endswith(".md"), f"{path.name}: a row links {link}"
            rows[link.removeprefix(prefix).removesuffix(".md")] = {
                k: row[k] for k in ("title", "headline", "command", "date")
            }
    return rows


def test_every_page_has_its_row_in_both_indexes() -> None:
    pages = _pages()
    assert len(pages) >= 10
    assert _rows(ROOT / "benchmarks" / "RESULTS.md", "../docs/benchmarks/") == pages
    assert _rows(PAGES / "index.md", "") == pages


def test_the_index_stays_short() -> None:
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 15 + len(_pages())


def test_every_command_names_something_that_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for name, page in _pages().items():
        words = page["command"].split()
        if words[:2] == ["python", "-m"]:
            module = words[2].split(".")
            assert module[0] == "benchmarks", f"{name}: {page['command']}"
            target = ROOT.joinpath(*module)
            assert target.with_suffix(".py").exists() or (target / "__main__.py").exists(), f"{name}: no {words[2]}"
        elif words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"{name}: no make target {words[1]}"
        else:
            assert words[0] == "stagewise", f"{name}: {page['command']}"


def test_every_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES.glob("*.md") if f"benchmarks/{p.name}" not in nav]
    assert missing == []
