"""The delay line's netlink messages (benchmarks/calibration/delay_line.py): what it sends, as the kernel's
nfnetlink_queue ABI lays it out, and the packet ids it reads from a datagram of queue messages."""

from __future__ import annotations

import struct

import pytest
from benchmarks.calibration import delay_line
from benchmarks.calibration.netem import delay_of


def _packet(packet_id: int, seq: int) -> bytes:
    """A queue message as the kernel sends one: a mark attribute first, then the packet header."""
    attrs = struct.pack("=HHI", 8, 3, 7) + struct.pack("=HH", 11, 1) + struct.pack(">IHB", packet_id, 0x0800, 1) + b"\0"
    body = struct.pack("=BBH", 2, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), (3 << 8) | 0, 0, seq, 0) + body


def test_the_packet_ids_of_a_datagram_are_read_in_order_past_other_attributes() -> None:
    data = _packet(41, 1) + _packet(42, 2) + _packet(43, 3)
    assert delay_line.packet_ids(data) == [41, 42, 43]


def test_an_error_message_names_the_kernel_s_refusal_and_an_ack_passes() -> None:
    ack = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", 0) + b"\0" * 16
    assert delay_line.packet_ids(ack) == []
    refused = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -22) + b"\0" * 16
    with pytest.raises(OSError, match="refused a message: Invalid argument"):
        delay_line.packet_ids(refused)


def test_a_batch_verdict_accepts_every_packet_through_an_id_of_its_queue() -> None:
    msg = delay_line.accept_through(5, 0x01020304)
    length, kind, flags = struct.unpack_from("=IHH", msg)
    assert (length, kind, flags) == (len(msg), (3 << 8) | 3, 1)
    assert struct.unpack_from(">H", msg, 18) == (5,)  # the queue, big-endian, in nfgenmsg
    assert struct.unpack_from("=HH", msg, 20) == (12, 2)  # NFQA_VERDICT_HDR
    assert struct.unpack_from(">II", msg, 24) == (1, 0x01020304)  # NF_ACCEPT, the id


def test_binding_asks_ids_only_a_deep_queue_and_whole_offloaded_packets() -> None:
    cmd, params = delay_line.bind(0)
    assert struct.unpack_from("=HHBxH", cmd, 20) == (8, 1, 1, 0)  # NFQA_CFG_CMD: bind
    attrs, at = {}, 20
    while at < len(params):
        size, kind = struct.unpack_from("=HH", params, at)
        attrs[kind] = params[at + 4 : at + size]
        at += (size + 3) & ~3
    assert attrs[2] == struct.pack(">IB", 0, 1)  # copy nothing but the metadata
    assert attrs[3] == struct.pack(">I", delay_line.MAXLEN)
    assert attrs[4] == attrs[5] == struct.pack(">I", 4)  # mask and flags: NFQA_CFG_F_GSO


def test_a_netem_link_s_delay_is_read_in_seconds() -> None:
    assert delay_of("netem delay 2ms") == pytest.approx(0.002)
    assert delay_of("netem delay 10ms") == pytest.approx(0.010)
    assert delay_of("netem delay 250us") == pytest.approx(0.00025)
    assert delay_of("tbf rate 20mbit burst 32kbit latency 400ms") is None
    assert delay_of("") is None
