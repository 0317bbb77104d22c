"""The workers' stderr under ``stagewise run --nnodes MIN:MAX`` (stagewise.runtime.elastic.console): torch's store
warning of a lost peer (tests/golden/torch_store_warning.txt, as a survivor printed it) goes to the file, whole, fed
at once or a byte at a time; the user's lines, torch's other warnings and a half line pass unchanged. And through a
real pipe: a child process's stderr, split between the console and the file, a half line shown while the child
runs. The launcher's own store calls, from two threads at once, their warnings filed, the workers' start inside one
of them filed apart, the console back once the last call ends; the rendezvous handler's calls wrapped so while the
job runs. And torch's Python lines that the rendezvous could not be reached, dropped only when its store is gone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stagewise.runtime.elastic.console import Console, Divert

WARNING = (Path(__file__).parents[1] / "golden" / "torch_store_warning.txt").read_bytes()
USER = b"user print: step 5, loss 0.25\n"
OTHER = (  # torch's C++ warnings of other shapes stay visible
    b"[rank0]:[W1203 06:48:19.438899904 ProcessGroupGloo.cpp:516] Warning: Unable to resolve hostname\n"
    b"[W1203 06:48:19.438899904 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host\n"
)


def split(feeds: list[bytes]) -> tuple[bytes, bytes]:
    divert, shown, filed = Divert(), b"", b""
    for data in feeds:
        s, f = divert.feed(data)
        shown, filed = shown + s, filed + f
    s, f = divert.flush()
    return shown + s, filed + f


def test_the_golden_warning_is_a_store_warning_of_a_lost_peer() -> None:
    lines = WARNING.split(b"\n")
    assert b"TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(" in lines[0]
    assert lines[1].startswith(b"Exception raised from recvBytes") and lines[-2:] == [b"", b""]
    assert sum(line.startswith(b"frame #") for line in lines) == 10


@pytest.mark.parametrize("chunk", [None, 1, 7, 4096])
def test_a_store_warning_goes_to_the_file_and_everything_else_is_shown(chunk: int | None) -> None:
    stream = USER + WARNING + OTHER + WARNING.replace(b"recvValue", b"sendBytes") + b"\n" + USER + b"50%|#####"
    feeds = [stream] if chunk is None else [stream[i : i + chunk] for i in range(0, len(stream), chunk)]
    shown, filed = split(feeds)
    assert shown == USER + OTHER + b"\n" + USER + b"50%|#####"  # the user's own blank line too
    assert filed == WARNING + WARNING.replace(b"recvValue", b"sendBytes")


def test_every_warning_torch_raises_again_is_filed_and_nothing_like_it_else() -> None:
    for call in (b"sendBytes", b"recvValue", b"recvVector", b"recvValueWithTimeout"):
        warning = WARNING.replace(b"recvValue", call, 1)
        assert split([USER + warning]) == (USER, warning), call
        no_rank = warning.removeprefix(b"[rank1]:")
        assert split([no_rank]) == (b"", no_rank), call  # before the process group is up: no rank prefix
    quoted = b"the log said: " + WARNING  # the shape must start the line
    assert split([quoted]) == (quoted, b"")
    frames = b"frame #0: my own frame\n<omitting python frames>\n"
    assert split([frames]) == (frames, b"")  # frames without a warning before them are the user's


def test_a_line_without_its_end_is_shown_once_the_pipe_is_quiet() -> None:
    divert = Divert()
    assert divert.feed(b"epoch 1 [=====") == (b"", b"")
    assert divert.holding
    assert divert.flush() == (b"epoch 1 [=====", b"")
    assert not divert.holding
    head, rest = WARNING[:40], WARNING[40:]  # a warning cut inside its first line: known once it ends
    assert divert.feed(head) == (b"", b"")
    assert divert.feed(rest + USER) == (USER, WARNING)


def test_a_childs_stderr_reaches_the_console_without_the_store_warning(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    into = tmp_path / "attempt-0" / "warnings.txt"
    script = (
        "import sys, os\n"
        f"os.write(2, {USER!r})\n"
        f"os.write(2, {WARNING!r})\n"
        "print('to stdout', flush=True)\n"
        f"sys.stderr.write({OTHER.decode()!r})\n"
    )
    console = Console()
    with console.routed(into):
        child = subprocess.Popen([sys.executable, "-c", script])
    print("the launcher's own line", file=sys.stderr, flush=True)  # after the start: straight to the console
    assert child.wait() == 0
    console.close(wait=60)
    out, err = capfd.readouterr()
    assert out == "to stdout\n"
    assert sorted(err.splitlines(keepends=True)) == sorted(
        (USER + OTHER + b"the launcher's own line\n").decode().splitlines(keepends=True)
    )
    assert into.read_bytes() == WARNING


@pytest.mark.timeout(120)  # a hang guard: a half line held for good never shows
def test_a_half_line_shows_while_the_child_still_runs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = "import os, sys\nos.write(2, b'50%|#####')\nsys.stdin.read()\n"  # a progress bar, then waits
    console = Console()
    with console.routed(tmp_path / "warnings.txt"):
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    seen = ""
    while "50%|#####" not in seen:  # shown before the child writes anything more or ends
        seen += capfd.readouterr().err
        time.sleep(0.05)
    assert child.stdin is not None
    child.stdin.close()
    assert child.wait() == 0
    console.close(wait=60)
    assert seen + capfd.readouterr().err == "50%|#####"


def test_torchs_lines_of_a_rendezvous_store_gone_are_dropped_and_no_other() -> None:
    from stagewise.runtime.elastic.launch import _Quiet

    def record(what: str, error: str) -> logging.LogRecord:
        msg = f"The node 'h_1_0' has failed to {what} the rendezvous 't1' due to an error of type {error}."
        return logging.LogRecord("torch.distributed.elastic.rendezvous.dynamic_rendezvous", 30, "", 0, msg, (), None)

    assert "torch.distributed.elastic.rendezvous.dynamic_rendezvous" in _Quiet.LOGGERS
    for what in ("shutdown", "send a keep-alive heartbeat to"):  # the store went with its machine
        assert not _Quiet().filter(record(what, "RendezvousConnectionError"))
        assert _Quiet().filter(record(what, "RendezvousStateError"))


def test_the_launchers_own_store_calls_file_their_warnings_from_any_thread(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    own, started = tmp_path / "warnings.txt", tmp_path / "attempt-0" / "warnings.txt"
    calls = (b"sendBytes", b"recvVector", b"recvValueWithTimeout")
    warned = {call: WARNING.replace(b"recvValue", call, 1) for call in calls}
    console = Console()
    inside, leave = threading.Barrier(2), threading.Event()

    def keep_alive() -> None:  # torch's keep-alive thread: its call outlasts the main thread's
        with console.own(own):
            os.write(2, WARNING)
            inside.wait()
            leave.wait()

    thread = threading.Thread(target=keep_alive)
    thread.start()
    with console.own(own):
        inside.wait()
        print("the launcher's own line", file=sys.stderr, flush=True)
        with console.routed(started):  # the workers' start inside a call: their pipe while it lasts
            child = subprocess.Popen([sys.executable, "-c", f"import os\nos.write(2, {warned[b'sendBytes']!r})"])
        os.write(2, warned[b"recvVector"])  # the call's pipe again
    os.write(2, warned[b"recvValueWithTimeout"])  # the other thread's call still runs
    leave.set()
    thread.join()
    os.write(2, USER + WARNING)  # no call runs: the console itself
    assert child.wait() == 0
    console.close(wait=60)
    assert not [t for t in threading.enumerate() if t.name == "stagewise-stderr"]  # every pipe reached its end
    assert own.read_bytes() == WARNING + warned[b"recvVector"] + warned[b"recvValueWithTimeout"]
    assert started.read_bytes() == warned[b"sendBytes"]
    err = capfd.readouterr().err.encode()
    assert err.endswith(USER + WARNING) and err.replace(USER + WARNING, b"") == b"the launcher's own line\n"


def test_the_rendezvous_calls_are_wrapped_while_the_job_runs_and_no_longer(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from stagewise.runtime.elastic.launch import _STORE_CALLS, store_warnings_filed

    def warns(*args: object) -> None:
        os.write(2, WARNING)

    assert {"_keep_alive", "num_nodes_waiting", "next_rendezvous", "shutdown"} <= set(_STORE_CALLS)
    for name in _STORE_CALLS:
        monkeypatch.setattr(DynamicRendezvousHandler, name, warns)
    before = {name: DynamicRendezvousHandler.__dict__[name] for name in _STORE_CALLS}
    with store_warnings_filed(str(tmp_path)):
        for name in _STORE_CALLS:
            getattr(DynamicRendezvousHandler, name)(None)
    assert (tmp_path / "torch-store-warnings.txt").read_bytes() == WARNING * len(_STORE_CALLS)
    assert capfd.readouterr().err == ""
    assert {name: DynamicRendezvousHandler.__dict__[name] for name in _STORE_CALLS} == before
    assert "_exit_barrier" not in LocalElasticAgent.__dict__  # (inherited: wrapped, then removed again)
    assert "_start_workers" in LocalElasticAgent.__dict__


def test_a_failing_sort_copies_the_rest_as_it_is(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Divert, data: bytes) -> tuple[bytes, bytes]:
        raise RuntimeError("a bug in the sorting")

    monkeypatch.setattr(Divert, "feed", broken)
    console = Console()
    with console.routed(tmp_path / "warnings.txt"):  # (a pipe nobody read would block the child for good)
        child = subprocess.Popen([sys.executable, "-c", f"import os\nos.write(2, {USER!r})\nos.write(2, {USER!r})"])
    assert child.wait() == 0
    console.close(wait=60)
    assert capfd.readouterr().err == (USER * 2).decode()  # the bytes of the read that failed too


def test_no_stderr_at_all_is_left_alone(tmp_path: Path) -> None:
    closed = os.open(os.devnull, os.O_WRONLY)
    os.close(closed)
    console = Console(closed)  # (stagewise run started with 2>&-)
    with console.routed(tmp_path / "warnings.txt"):
        with pytest.raises(OSError):
            os.fstat(closed)  # nothing was put in its place
    console.close()
