"""The runtime's seams, held by tests that read the code as text (issue 47): nothing here imports torch.

* one run value: no part reads another object's "current" through a closure, and the interpreter sets no
  attribute outside its constructor (what is per run lives on :class:`stagewise.runtime.engine.run.Run`);
* one handler table: the interpreter has no handler of its own for F, B, I, W, SYNC or STEP, and nothing
  subclasses it (an asynchronous schedule registers its handlers);
* typed facts: nothing under runtime/engine/ looks inside a stage with ``getattr`` / ``hasattr``;
* the gradient merge's flag is set in one place (the merge's step part) and read from the run;
* the names the review retired stay retired.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "src" / "stagewise" / "runtime"
ENGINE = RUNTIME / "engine"
INTERPRETER = ENGINE / "interpreter.py"


def _python(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def test_no_closure_reads_another_objects_current() -> None:
    found = []
    for path in _python("src"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Lambda) and any(
                isinstance(n, ast.Attribute) and n.attr == "current" for n in ast.walk(node.body)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "read the action running from the run value (run.current), not through a closure"


def _class(path: Path, name: str) -> ast.ClassDef:
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_interpreter_keeps_nothing_per_run() -> None:
    """Every ``self.x = ...`` of the interpreter is in its constructor: what is per run is on the run value."""
    interpreter = _class(INTERPRETER, "Interpreter")
    outside = [
        f"{method.name}: self.{target.attr}"
        for method in interpreter.body
        if isinstance(method, ast.FunctionDef) and method.name != "__init__"
        for node in ast.walk(method)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    ]
    assert outside == []


def test_one_table_holds_the_handlers_and_nothing_subclasses_the_interpreter() -> None:
    text = INTERPRETER.read_text()
    interpreter = _class(INTERPRETER, "Interpreter")
    methods = {n.name for n in interpreter.body if isinstance(n, ast.FunctionDef)}
    assert "register" in methods and "run" in methods
    own = [m for m in methods if re.fullmatch(r"_?(forward|backward\w*|sync|step|loss\w*)", m)]
    assert own == [], "compute, SYNC and STEP are handlers in the table, registered by the assembly"
    assert re.findall(r"Kind\.(F|B|I|W|SYNC|STEP)\s*:", text) == [], "no second table inside the interpreter"
    subclasses = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _python("src", "tests", "benchmarks", "examples")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[-1] == "Interpreter" for b in node.bases)
    ]
    assert subclasses == [], "register handlers in the table instead of subclassing the interpreter"
    registers = [
        p.relative_to(RUNTIME) for p in _python("src") if re.search(r"\binterpreter\.register\(", p.read_text())
    ]
    assert [str(p) for p in registers] == ["assembly/assemble.py"], "the assembly fills the table"


def test_nothing_in_the_engine_looks_inside_a_stage() -> None:
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                what = ast.unparse(node.args[0]) if node.args else ""
                if "stage" in what.lower():
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "a stage's facts are decided at assembly (engine/compute.py's StageFacts)"


def test_the_merges_flag_is_set_in_one_place_and_read_from_the_run() -> None:
    setters = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        for path in _python("src")
        for text in [path.read_text()]
        for m in re.finditer(r"\.accumulate\s*=(?!=)", text)
    ]
    assert len(setters) == 1 and setters[0].startswith("src/stagewise/runtime/features/merge.py:"), setters
    pushed = [
        str(p.relative_to(ROOT))
        for p in _python("src")
        if re.search(r"\.deferring\s*=|merging\s*=\s*merge", p.read_text())
    ]
    assert pushed == [], "no part is handed the merge's flag: each reads run.accumulate"


#: names the review retired (issue 47), each with what it is now
RETIRED = {
    r"\bStepRun\b": "the run value is engine/run.py's Run",
    r"\bclass Step\b|\bimport Step\b|\bStep\(mode": "the run's record is engine/run.py's RunRecord",
    r"\bOneStep\b": "a synchronous schedule's train lists are runner.OneList",
    r"\b(Tied|Hybrid|Meter)Step\b": "the assembly's step parts are TiedPart, HybridPart, MeterPart",
    r"\bAsyncInterpreter\b": "an asynchronous schedule's handlers are asynchronous/handlers.py's AsyncHandlers",
    r"engine[./]step\b": "a run's micro-batches are cut in engine/batches.py",
    r"asynchronous[./]interpreter\b": "asynchronous/handlers.py",
    r"transport[./]choose\b|transport import choose\b": "comm/choose_transport.py, above both transports",
    r"\b_Saved\b": "engine/run.py's Saved",
}


def test_the_retired_names_stay_retired() -> None:
    texts = _python("src", "tests", "benchmarks", "examples")
    texts += [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    history = {p for p in (ROOT / "docs" / "benchmarks").glob("*.md")}  # dated pages cite names as they were
    here = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0)} ({why})"
        for path in texts
        if path not in history and path.resolve() != here
        for text in [path.read_text()]
        for pattern, why in RETIRED.items()
        for m in re.finditer(pattern, text)
    ]
    assert found == []
