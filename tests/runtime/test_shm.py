"""The shared-memory slot / doorbell protocol (runtime/comm/shm/slots.py, doorbell.py) in one process
(two threads) and across two processes, against the values sent; the transport choice's errors. No process
group is needed here: the runtime checks run on this transport in tests/distributed/test_runtime_2ranks.py /
test_runtime_4ranks.py and tests/system/test_runtime_faults.py.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stagewise.runtime.comm import choose_transport as choose
from stagewise.runtime.comm.shm.transport import SHM_DIR, Channels, Peer, check_shm_group, same_host
from stagewise.runtime.errors import PipelineError
from stagewise.runtime.options import Options

pytestmark = pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason="needs a writable /dev/shm")


def never(started: float, what: str, peer: int) -> None:
    """A check that never stops a wait."""


def values(seed: int, n: int) -> list[torch.Tensor]:
    """Tensors of several dtypes and shapes (0-d, empty, bool, int64, float64), one list per seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(torch.randn(3, 4, dtype=torch.float64, generator=g))
        elif kind == 1:
            out.append(torch.randint(-5, 5, (7,), generator=g))
        elif kind == 2:
            out.append(torch.randn((), generator=g))
        elif kind == 3:
            out.append(torch.randn(2, 3, generator=g) > 0)
        else:
            out.append(torch.empty(0, 5))
    return out


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"{SHM_DIR}/sw-test-{os.getpid()}-{os.urandom(4).hex()}"
    yield name
    for path in glob.glob(name + "-*"):
        os.unlink(path)


def receive_all(ch: Channels, peer: int, sent: list[torch.Tensor], rounds: int) -> list[torch.Tensor]:
    """Receive ``rounds`` times the values shaped like ``sent``: one slot per (tag, k), reused each round."""
    got = []
    for _ in range(rounds):
        for tag, like in enumerate(sent):
            work = ch.expect(peer, tag, 0, torch.empty_like(like))
            ch.complete(work, f"value {tag}")
            got.append(work.tensor)
    return got


def send_all(ch: Channels, peer: int, rounds: int, seed: int, n: int) -> None:
    for r in range(rounds):
        for tag, t in enumerate(values(seed + r, n)):
            ch.send(peer, tag, 0, t, f"value {tag}")
            ch.ring(peer)


def test_two_threads_receive_every_value_in_order(prefix: str) -> None:
    """The sender runs rounds ahead (each slot holds one value: it waits for the receiver's ack), and every
    value arrives bit for bit, in order."""
    n, rounds = 10, 6
    a, b = Channels(prefix, 0, 2, never), Channels(prefix, 1, 2, never)
    sender = threading.Thread(target=send_all, args=(a, 1, rounds, 100, n))
    sender.start()
    got = receive_all(b, 0, values(0, n), rounds)
    sender.join()
    want = [t for r in range(rounds) for t in values(100 + r, n)]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"value {k}: {g} != {w}"
    names = sorted(glob.glob(prefix + "-*"))
    assert names == [f"{prefix}-bell0", f"{prefix}-bell1"], "a slot's name goes once its first value was taken"
    a.forget_names()  # as the transport does after a barrier: both doorbells are open on both sides
    b.forget_names()
    assert glob.glob(prefix + "-*") == []
    send_all(a, 1, 1, 300, n)  # the doorbells still ring
    got = receive_all(b, 0, values(0, n), 1)
    assert all(torch.equal(g, w) for g, w in zip(got, values(300, n)))
    a.close(everything=False)
    b.close(everything=False)


def _child_sends(prefix: str, rounds: int, n: int) -> None:
    torch.set_num_threads(1)
    ch = Channels(prefix, 1, 2, never)
    send_all(ch, 0, rounds, 200, n)
    ch.close(everything=False)


def test_two_processes_receive_every_value_in_order(prefix: str) -> None:
    n, rounds = 5, 4
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_child_sends, args=(prefix, rounds, n))
    ch = Channels(prefix, 0, 2, never)
    child.start()
    got = receive_all(ch, 1, values(0, n), rounds)
    child.join(60)
    assert child.exitcode == 0
    want = [t for r in range(rounds) for t in values(200 + r, n)]
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"value {k}: {g} != {w}"
    ch.close(everything=False)
    assert glob.glob(prefix + "-*") == []


def _child_exits(prefix: str) -> None:
    Channels(prefix, 1, 2, never)  # opens its doorbell, then ends without sending
    os._exit(3)


def test_a_dead_peer_stops_the_wait_naming_it(prefix: str) -> None:
    """The child exits without sending; it stays a zombie (not reaped yet), which must count as dead."""
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_child_exits, args=(prefix,))
    child.start()
    assert child.pid is not None
    peer = Peer("h", "b", child.pid, "", True, "n")

    def check(started: float, what: str, who: int) -> None:
        if not peer.alive():
            raise PipelineError(f"{what}: rank {who} (pid {peer.pid}) died")

    ch = Channels(prefix, 0, 2, check)
    work = ch.expect(1, 0, 0, torch.empty(4))
    with pytest.raises(PipelineError, match=rf"the value: rank 1 \(pid {child.pid}\) died"):
        ch.complete(work, "the value")
    child.join(10)
    assert not work.done
    ch.close(everything=True)
    assert glob.glob(prefix + "-*") == []


def test_a_quiet_wait_looks_at_its_check_until_it_raises(prefix: str) -> None:
    """No value ever comes: the wait sleeps on the doorbell and calls ``check`` each quiet interval; the third
    call raises (the deadline or the error board, in the transport)."""
    calls: list[str] = []

    def check(started: float, what: str, peer: int) -> None:
        calls.append(what)
        if len(calls) == 3:
            raise PipelineError(f"gave up on {what} from rank {peer}")

    ch = Channels(prefix, 0, 2, check)
    with pytest.raises(PipelineError, match="gave up on the value from rank 1"):
        ch.complete(ch.expect(1, 0, 0, torch.empty(2)), "the value")
    assert calls == ["the value"] * 3
    ch.close(everything=True)


NAMES = Path(__file__).parent / "shm_names_checks.py"


@pytest.mark.parametrize("kill", ["sigkill", "sigterm-group"])
def test_a_process_killed_holding_names_leaves_none(prefix: str, kill: str) -> None:
    """A rank killed outright (SIGKILL), or with its whole process group (SIGTERM, as torchrun ends every worker
    once one died), runs no cleanup: the resource tracker it registered its names with removes them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(NAMES), "hold", prefix]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "ready\n", (line, proc.stderr.read() if proc.poll() is not None else "")
        held = sorted(glob.glob(prefix + "-*"))
        assert held == [f"{prefix}-0-1-0-0-48", f"{prefix}-bell0", f"{prefix}-bell1"], held
        if kill == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)  # stderr closes when the tracker, which shares it, has ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    deadline = time.monotonic() + 60  # the tracker has exited by now: this only rides out a slow file system
    while glob.glob(prefix + "-*") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert glob.glob(prefix + "-*") == [], err
    assert "leaked shared_memory objects" in err, err  # the tracker's own report of what it removed


@pytest.mark.parametrize("mode", ["clean", "spawned"])
def test_a_clean_run_leaves_the_tracker_nothing(prefix: str, mode: str) -> None:
    """Every name registered is unregistered once gone (the receiver's unlink; the sender's first ack), by the
    side that created it: a double or a missing unregister would print the tracker's traceback or leak
    warning - also when the sender is a multiprocessing child sharing the receiver's tracker."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(NAMES), mode, prefix], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tracked: []", done.stdout
    assert "resource_tracker" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert glob.glob(prefix + "-*") == []


def test_peers_on_one_host_and_elsewhere() -> None:
    me = Peer.here()
    assert me.alive() and me.pid == os.getpid()
    assert same_host([me, me])
    assert not same_host([me, Peer("elsewhere", me.boot_id, 1, "", True, "")])
    assert not same_host([me, Peer(me.host, "another-boot", 1, "", True, "")])
    assert not same_host([me, Peer(me.host, me.boot_id, 1, "", False, "", me.namespaces)])
    assert same_host([me, Peer(me.host, me.boot_id, 1, "", True, "", me.namespaces)])
    assert not same_host([me, Peer(me.host, me.boot_id, 1, "", True, "", "another container")])
    assert not Peer(me.host, me.boot_id, me.pid, "not-my-start", True, "").alive(), "a reused pid is another process"


def test_transport_names_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose.resolve("shm") is not choose.resolve("torch")
    assert choose.resolve(choose.torch_transport) is choose.torch_transport
    with pytest.raises(ValueError, match="transport must be one of 'auto', 'shm', 'torch'.*got 'gloo'"):
        choose.resolve("gloo")
    monkeypatch.setenv(choose.ENV, "tcp")
    with pytest.raises(ValueError, match="STAGEWISE_TRANSPORT must be one of auto, shm, torch, got 'tcp'"):
        choose.resolve(None)
    monkeypatch.setenv(choose.ENV, "torch")
    assert choose.resolve(None) is choose.torch_transport
    monkeypatch.delenv(choose.ENV)
    assert choose.resolve(None) is choose.auto_transport


def test_groups_the_shm_transport_cannot_serve_are_refused_naming_the_ranks() -> None:
    me = Peer.here()
    check_shm_group("gloo", [me, me])  # one host, gloo: fine
    with pytest.raises(ValueError, match="needs a gloo process group .* uses 'nccl'"):
        check_shm_group("nccl", [me, me])
    away = Peer("elsewhere", "another-boot", 1, "", True, "")
    with pytest.raises(ValueError, match=r"group ranks \[1, 3\] run elsewhere than rank 0"):
        check_shm_group("gloo", [me, away, me, away])
    with pytest.raises(ValueError, match=r"group ranks \[2\] lack it"):
        check_shm_group("gloo", [me, me, Peer(me.host, me.boot_id, 1, "", False, "", me.namespaces)])


def test_an_unknown_transport_option_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ValueError, match="transport must be one of 'auto', 'shm', 'torch'"):
        Options(transport="nccl")
    with pytest.raises(ValueError, match="got 3"):
        Options(transport=3)  # type: ignore[arg-type]


def test_a_sender_forgets_a_name_as_soon_as_it_sees_the_first_value_taken(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver unlinks a slot's name when it takes the first value; the sender unregistered it only at the
    slot's next value, a step later, so a sender dying in between left its resource tracker a name already gone
    (a "leaked shared_memory objects" warning, then "No such file or directory"). Now it looks at its next send
    to that receiver and at the step's end (forget_taken)."""
    from stagewise.runtime.comm.shm import slots

    forgotten: list[str] = []
    monkeypatch.setattr(slots, "untrack", forgotten.append)  # the sender's unregistrations only
    a, b = Channels(prefix, 0, 2, never), Channels(prefix, 1, 2, never)
    try:
        b.send(0, 3, 0, torch.ones(3), "a value")
        b.send(0, 4, 0, torch.ones(2), "another")
        b.forget_taken()
        assert forgotten == []  # not taken: the names are there, the tracker's to remove if this rank dies
        for tag, n in ((3, 3), (4, 2)):
            a.complete(a.expect(1, tag, 0, torch.empty(n)), f"tag {tag}")
        b.forget_taken()  # the step's end
        assert sorted(forgotten) == sorted(s.path for s in b._slots.values()), forgotten
        forgotten.clear()
        b.send(0, 5, 0, torch.ones(1), "a third")
        a.complete(a.expect(1, 5, 0, torch.empty(1)), "tag 5")
        b.send(0, 6, 0, torch.ones(1), "a fourth")  # a send to the same receiver looks too
        assert forgotten == [s.path for key, s in b._slots.items() if key[2] == 5], forgotten
    finally:
        a.close(everything=True)
        b.close(everything=True)
