"""House rules read from the files as text: nothing is imported, so each runs in a blink and names what breaks it.

* one question, one way: "is this schedule asynchronous?" is :func:`stagewise.schedules.is_asynchronous` (a
  name or a Schedule) over :attr:`stagewise.ir.Schedule.is_asynchronous` (what a Schedule carries);
* one name, one type: ``optimizer_steps`` is a bool wherever a function takes it;
* no file name Windows reserves (``aux``, ``con``, ``nul``, ``com1`` ...: a clone there fails);
* no two test modules share a base name (pytest's default import mode imports each as a top-level module, so
  ``make test`` refuses to collect the second: the folders run one at a time do not see it);
* every path and module a document or a docstring cites exists (a move leaves no stale pointer behind);
* no dead code: every function, class and method of src/stagewise is used somewhere (src, tests, benchmarks,
  examples), unless it is registered by a decorator or called by a library whose protocol it implements.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "stagewise"
CODE = ("src", "tests", "benchmarks", "examples")


def _python(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def _where(path: Path, text: str, at: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}"


# ---- one question, one way -------------------------------------------------------------------------------
#: other ways of asking whether a schedule is asynchronous, and the one file each may stand in (its definition)
OTHER_WAYS = {
    r"async_table\([^()]*\)\s+is\s+(not\s+)?None": None,
    r"windows\s+is\s+(not\s+)?None": None,
    r"meta(\.get\(|\[)\"asynchronous\"": None,
    r"meta\.get\(\"versions\"\)\s+is\s+(not\s+)?None": "stagewise/ir/schedule.py",
    r"\.synchronous\b": "stagewise/schedules/registry.py",
}


def test_one_predicate_says_whether_a_schedule_is_asynchronous() -> None:
    found = []
    for path in _python("src"):
        text = path.read_text()
        for pattern, home in OTHER_WAYS.items():
            if home is not None and path == SRC / home:
                continue
            found += [f"{_where(path, text, m.start())}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert found == [], "ask stagewise.schedules.is_asynchronous (or Schedule.is_asynchronous below schedules/)"


# ---- one name, one type ----------------------------------------------------------------------------------
def test_optimizer_steps_is_a_bool_wherever_it_is_taken() -> None:
    kinds = {}
    for path in _python("src"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    if arg.arg == "optimizer_steps":
                        kinds[f"{path.relative_to(SRC)}:{node.name}"] = ast.unparse(arg.annotation or ast.Name("?"))
    assert len(kinds) >= 3 and set(kinds.values()) == {"bool"}, kinds


# ---- file names ---------------------------------------------------------------------------------------------
RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}


def test_no_file_name_is_one_windows_reserves() -> None:
    tops = ("src", "tests", "benchmarks", "examples", "docs")
    bad = [
        str(p.relative_to(ROOT))
        for top in tops
        for p in (ROOT / top).rglob("*")
        if p.name.split(".")[0].lower() in RESERVED
    ]
    assert bad == []


def test_no_two_test_modules_share_a_base_name() -> None:
    tests = [p for p in (ROOT / "tests").rglob("test_*.py")]
    shared = {name for name, n in Counter(p.name for p in tests).items() if n > 1}
    assert sorted(str(p.relative_to(ROOT)) for p in tests if p.name in shared) == []


# ---- cited paths and modules ------------------------------------------------------------------------------
#: the first folder of a path this repository's texts cite (others, like torchgpipe's balance/, are not ours)
OURS = {"src", "tests", "docs", "benchmarks", "examples", "stagewise", "runtime"} | {
    p.name for p in [*PACKAGE.iterdir(), *(PACKAGE / "runtime").iterdir(), *(ROOT / "tests").iterdir()] if p.is_dir()
}
#: texts that record history (each benchmark's page of dated runs, docs/benchmarks/): they cite paths as they were
HISTORY = {p for p in (ROOT / "docs" / "benchmarks").glob("*.md") if p.name != "index.md"}
_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.(?:py|md|toml|yml|json))\b")
_DOTTED = re.compile(r"\bstagewise(?:\.(?!(?:csv|json|md|py|toml)\b|__)\w+)+")
_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc):`~?([\w.]+)`")
_BASES = [ROOT, SRC, PACKAGE, PACKAGE / "runtime", ROOT / "tests", ROOT / "tests" / "distributed", ROOT / "benchmarks"]


def _texts() -> list[Path]:
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    pages += [*(ROOT / "benchmarks").rglob("*.md"), *(ROOT / "examples").rglob("*.md")]
    return [p for p in pages if p not in HISTORY] + _python(*CODE)


@cache
def _defines(module: Path, name: str) -> bool:
    """Whether ``module`` (a .py file or a package folder) has ``name``: defined, assigned or imported there."""
    if module.is_dir():
        if (module / name).is_dir() or (module / f"{name}.py").exists():
            return True
        module = module / "__init__.py"
        if not module.exists():
            return False
    text = module.read_text()
    pattern = (  # defined, assigned, imported, or named in a lazy door's map (a quoted name)
        rf"^\s*(async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b[^\n]*\b{name}\b|^\s+{name},?$"
        rf"|[\"']{name}[\"']"
    )
    return re.search(pattern, text, re.M) is not None


def _resolves(dotted: str) -> bool:
    """A dotted name from ``stagewise``: the longest prefix that is a module, then its next name defined there."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:k])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base if base.is_dir() else None
        if module is not None:
            return k == len(parts) or _defines(module, parts[k])
    return False


def _relative(path: Path, ref: str) -> str:
    """A docstring's ``.name`` / ``..pkg.name`` role target, as an absolute dotted name."""
    package = list(path.relative_to(SRC).with_suffix("").parts)[:-1]
    dots = len(ref) - len(ref.lstrip("."))
    base = package[: len(package) - (dots - 1)]
    return ".".join(base + [ref.lstrip(".")] if ref.lstrip(".") else base)


def test_every_cited_path_and_module_exists() -> None:
    stale = []
    for path in _texts():
        text = path.read_text()
        for m in _PATH.finditer(text):
            cited = m.group(1)
            placeholder = any(part.isupper() for part in re.split(r"[/.]", cited))  # benchmarks/NAME.py
            if (
                cited.split("/")[0] in OURS
                and not placeholder
                and not any((b / cited).exists() for b in [*_BASES, path.parent])
            ):
                stale.append(f"{_where(path, text, m.start())}: {cited}")
        for m in _DOTTED.finditer(text):
            if not _resolves(m.group(0).rstrip(".")):
                stale.append(f"{_where(path, text, m.start())}: {m.group(0)}")
        if path.is_relative_to(PACKAGE):
            for m in _ROLE.finditer(text):
                ref = m.group(1)
                if ref.startswith(".") and not _resolves(_relative(path, ref)):
                    stale.append(f"{_where(path, text, m.start())}: {ref}")
    assert stale == [], "cited, but not there (moved?):\n" + "\n".join(stale)


# ---- dead code ------------------------------------------------------------------------------------------------
#: methods called by a library whose protocol they implement, not by name in this repository
PROTOCOLS = {
    "legend_artist", "get_label",  # matplotlib's legend handler and handle (render/png.py)
    # torch.distributed.pipelining's stage, as its schedules' step() calls it (runtime/interop/torch_orders.py)
    "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "clear_runtime_states",
}  # fmt: skip


def test_every_function_and_class_is_used_somewhere() -> None:
    words = Counter(w for path in _python(*CODE) for w in re.findall(r"\w+", path.read_text()))
    assert words["Pipeline"] > 100  # the code was read
    dead = []
    for path in _python("src"):
        for node in ast.parse(path.read_text()).body:
            defs = [node]
            if isinstance(node, ast.ClassDef):
                defs += [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for d in defs:
                if not isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                registered = any("register" in ast.unparse(x) for x in d.decorator_list)
                if d.name.startswith("__") or registered or d.name in PROTOCOLS:
                    continue
                if words[d.name] <= 1:  # its own definition only
                    dead.append(f"{path.relative_to(SRC)}:{d.lineno} {d.name}")
    assert dead == [], "defined, used nowhere (delete it, or test it if it is public):\n" + "\n".join(dead)
