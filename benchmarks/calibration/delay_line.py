"""A link's latency without ``sch_netem``: every packet a machine receives from its veth held ``D`` seconds.

Where the kernel lacks ``CONFIG_NET_SCH_NETEM`` (this VM's: :mod:`.netem`), the same one-way delay comes from
netfilter: an ``iptables -j NFQUEUE`` rule on the machine's INPUT from its veth hands each packet's id (not its
bytes: ``NFQNL_COPY_META``) to this process, which lets every packet go ``D`` after it read it (tens of
microseconds after the kernel queued it), all that are due in one batch verdict (packets are numbered in order
and the delay is constant, so the due ones are a prefix). A message between machines waits ``D`` once, its
acknowledgement ``D`` back, as with ``netem delay D`` on both veths. On the receiving side, not the sending one:
a packet held before it leaves still belongs to its socket, and TCP's small-queue limit then lets two packets
through per delay (measured: 1.1 MB/s at 5 ms); one held on arrival has left its sender, as on a wire.

What it costs the machine it shapes: a few system calls per packet (the queue message in, one verdict per
batch) on the process's own thread at real-time priority (so a busy core does not add its slice to the
delay), 50-70 us of CPU per packet here; ``--stats`` prints the packets held and the CPU seconds spent, so a
run can say what it took. The netlink messages are written here with :mod:`struct` (the kernel's
``nfnetlink_queue`` ABI, ``linux/netfilter/nfnetlink_queue.h``): no library to install beyond iptables itself.

Run inside the machine's namespace (netlink is per namespace):
``ip netns exec M python -m benchmarks.calibration.delay_line --queue 0 --delay 0.002``.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQA_CFG_F_GSO = 1 << 2  # a segmentation-offloaded packet queued whole (one id per 64 KB, not per 1.5 KB)
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
MAXLEN = 1 << 16  # packets the kernel may hold for us (10 ms at a few Gb/s of full-size segments)


def _attr(kind: int, payload: bytes) -> bytes:
    body = struct.pack("=HH", 4 + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


def message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    """One nfnetlink message of the queue subsystem: header, ``nfgenmsg`` (family unspecified, version 0, the
    queue's number big-endian), attributes."""
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def bind(queue: int) -> list[bytes]:
    """The messages that bind ``queue`` to this socket: ids only, up to :data:`MAXLEN` packets held, an
    offloaded packet whole."""
    return [
        message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
                NLM_F_REQUEST | NLM_F_ACK, 1),
        message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
                + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", MAXLEN))
                + _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO))
                + _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO)), NLM_F_REQUEST | NLM_F_ACK, 2),
    ]  # fmt: skip


def accept_through(queue: int, packet_id: int) -> bytes:
    """A batch verdict: every packet of ``queue`` numbered up to ``packet_id`` goes on."""
    return message(NFQNL_MSG_VERDICT_BATCH, queue, _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id)))


def packet_ids(data: bytes) -> list[int]:
    """The packet ids in one datagram of queue messages (an error message raises, naming its errno)."""
    ids, at = [], 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if kind == NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", data, at + 16)
            if errno:
                raise OSError(-errno, f"nfnetlink_queue refused a message: {os.strerror(-errno)}")
        elif kind & 0xFF == NFQNL_MSG_PACKET:
            a = at + 20
            while a + 4 <= at + length:
                size, attr = struct.unpack_from("=HH", data, a)
                if attr & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, a + 4)[0])
                    break
                a += (size + 3) & ~3
        at += (length + 3) & ~3
    return ids


def run(queue: int, delay: float, stats: bool) -> None:
    """Hold every packet of ``queue`` for ``delay`` seconds until SIGTERM."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (PermissionError, OSError) as err:
        print(f"delay line: no real-time priority ({err}); the core's slices add to the delay", file=sys.stderr)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: a full buffer drops the packet
    sock.bind((0, 0))
    for msg in bind(queue):
        sock.send(msg)
        packet_ids(sock.recv(65536))  # (the acknowledgement: raises on a refusal)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    held: collections.deque[tuple[float, int]] = collections.deque()
    count = 0
    print("delay line: ready", flush=True)
    while not stop:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        if readable:
            while True:
                try:
                    data = sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                due = time.monotonic() + delay
                for packet in packet_ids(data):
                    held.append((due, packet))
                    count += 1
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            sock.send(accept_through(queue, last))
    if held:
        sock.send(accept_through(queue, held[-1][1]))
    if stats:
        used = resource.getrusage(resource.RUSAGE_SELF)
        print(f"delay line: {count} packets held {delay * 1e3:g} ms, CPU {used.ru_utime + used.ru_stime:.3f} s",
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0, help="the NFQUEUE number the iptables rule names")
    parser.add_argument("--delay", type=float, required=True, help="seconds each packet is held")
    parser.add_argument("--stats", action="store_true", help="at the end, the packets held and the CPU used")
    args = parser.parse_args(argv)
    run(args.queue, args.delay, args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
