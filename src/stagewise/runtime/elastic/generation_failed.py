"""What a survivor of an in-place job says when its generation fails, in stagewise's words - which machines and
workers were lost, at which step, what happens next - with the error itself (gloo's text, its C++ location) in a
file beside the job's tracebacks, which the line names::

    generation 0 failed at step 4: lost machine 2 (worker 2); rank 1 (stage 0): the data-parallel gradient
    all-reduce of stage 0 failed. The survivors agree on the next generation without it and go on from the last
    committed step (the error in full: /tmp/stagewise-t1-.../attempt-0/rank-1.4242.generation-0.txt)
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from pathlib import Path

from ..interrupt import traceback_file
from .membership import named_dead

# the heartbeat's naming of the dead (heartbeat.blame_*), and what separates it from the rest
_NAMED = re.compile(r"global ranks? [\d, ]+ stopped or died(?: \((?:[^()]|\([^()]*\))*\))?(?:: |; )?")
# an exception's text that torch's C++ wrote, as stagewise quotes it: its type, then a source location in brackets
_TORCH_TEXT = re.compile(r"(?:(\w+(?:Error|Exception)): )?\[[^\]\s]+\.(?:cpp|cc|c|h|hpp):\d+\]")


def in_words(
    message: str,
    kind: str,
    at: tuple[int, int],
    members: Sequence[int],
    nproc: int,
    where: str,
    lost: Sequence[int] | None = None,
) -> str:
    """The line for a failure of generation ``at[0]`` at step ``at[1]`` (``message``, an exception of type
    ``kind``; ``members``: the generation's worker ids by rank; ``nproc``: workers per machine, 0 if unknown;
    ``where``: the file that holds the error, or "" when there is none: its first line is said then; ``lost``: the
    worker ids found gone, by default those the message names)."""
    first = message.splitlines()[0] if message else ""
    lost = named_dead(message, members) if lost is None else sorted(lost)
    what = _NAMED.sub("", first, count=1)
    if " failed: " in what:  # stagewise's "<who>: <what> failed: <the error torch raised>"
        what = what.split(" failed: ", 1)[0] + " failed"
    inside = _TORCH_TEXT.search(what)  # torch's own text after stagewise's ("...: RuntimeError: [pair.cc:537] ...")
    if inside is not None and inside.start() > 0:
        what = f"{what[: inside.start()].rstrip(': ')}: a {inside.group(1) or kind} inside torch"
    if not what or what.startswith("["):  # torch's own text from the start (a C++ location first)
        what = f"a {kind} inside torch"
    head = f"generation {at[0]} failed at step {at[1]}: "
    if lost:
        machines = sorted({m // nproc for m in lost}) if nproc else []
        s = "s" if len(lost) > 1 else ""
        who = f"worker{s} {', '.join(map(str, sorted(lost)))}"
        if machines:
            who = f"machine{'s' if len(machines) > 1 else ''} {', '.join(map(str, machines))} ({who})"
        head += f"lost {who}; "
    without = f" without {'them' if len(lost) > 1 else 'it'}" if lost else ""
    tail = f"the error in full: {where}" if where else f"the error: {first[:300]}"
    return (
        f"{head}{what}. The survivors agree on the next generation{without} and go on from the last committed step "
        f"({tail})"
    )


def file_error(err: BaseException, generation: int) -> str:
    """``err``'s traceback, in a file beside this worker's traceback file (``stagewise run``'s folder); the
    file's path, or "" outside ``stagewise run`` or when it cannot be written."""
    path = traceback_file()
    if path is None:
        return ""
    path = path.with_name(f"{path.stem}.generation-{generation}.txt")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    except OSError:
        return ""
    return str(path)
