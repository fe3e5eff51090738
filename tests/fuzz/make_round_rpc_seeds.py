#!/usr/bin/env python3
"""Writes the seed corpus of the round_rpc fuzz target (tests/fuzz/fuzz_round_rpc.cpp) into
tests/fuzz/corpus/round_rpc/: call sequences in its record format, with the request messages
encoded by hand in the protobuf wire format (proto/spes_sync.proto). The honest nodes of the
target join as node i with incarnation 1000 + i. Rerun after changing the record format:
    python3 tests/fuzz/make_round_rpc_seeds.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "round_rpc")
JOIN, UPLOAD, HONEST_UPLOAD, WAIT, DOWNLOAD, LEAVE, HEARTBEAT, STATUS, TICK = range(9)


def varint(v):
    v &= (1 << 64) - 1
    out = b""
    while v >= 0x80:
        out += bytes([(v & 0x7F) | 0x80])
        v >>= 7
    return out + bytes([v])


def int_field(field, v):
    return varint(field << 3) + varint(v)


def bytes_field(field, b):
    if isinstance(b, str):
        b = b.encode()
    return varint((field << 3) | 2) + varint(len(b)) + b


def double_field(field, d):
    return varint((field << 3) | 1) + struct.pack("<d", d)


def node(i, incarnation=None):
    inc = 1000 + i if incarnation is None else incarnation
    return bytes_field(1, int_field(1, i) + int_field(2, inc))


def setting(key, value):
    """One entry of JoinRequest.settings (field 12, a map<string, string>)."""
    return bytes_field(12, bytes_field(1, key) + bytes_field(2, value))


def record(op, caller, payload=b""):
    return bytes([op, caller]) + struct.pack("<H", len(payload)) + payload


def chunk(i, rnd, offset, total, data, sha=None, resume=False):
    m = node(i) + int_field(2, rnd) + int_field(3, rnd * 10) + int_field(4, offset)
    m += int_field(5, total) + bytes_field(6, data)
    if sha is not None:
        m += bytes_field(7, sha)
    if resume:
        m += int_field(8, 1)
    return struct.pack("<H", len(m)) + m


def honest_round(first=0):
    return b"".join(record(HONEST_UPLOAD, i) for i in range(first, 4))


SEEDS = {
    "empty": b"",
    "honest_round_then_reads": honest_round()
    + record(WAIT, 0, node(0) + int_field(2, 1) + int_field(3, 100))
    + record(DOWNLOAD, 0, node(0) + int_field(2, 1) + int_field(3, 0))
    + record(DOWNLOAD, 1, node(1) + int_field(2, 1) + int_field(3, 1) + int_field(4, 100))
    + record(HEARTBEAT, 2, node(2) + int_field(2, 10) + double_field(3, 3.5) + double_field(4, 1e3))
    + record(STATUS, 0)
    + record(TICK, 0),
    "poisoned_upload_of_node_2": record(HONEST_UPLOAD, 0)
    + record(HONEST_UPLOAD, 2, struct.pack("<IB", 300, 0x40) + struct.pack("<IB", 900, 0x7F))
    + honest_round(1),
    "garbage_join_leave_heartbeat": record(
        JOIN, 1, node(1, 5) + int_field(2, 6)
        + setting("model", b"\xff\xfe fingerprint") + setting("spes_config.mode", "spes")
        + setting("spes_config.num_peers", "4") + setting("spes_config.sync_steps", "10")
        + setting("\xc3\x28 unknown", "x" * 300))
    + record(LEAVE, 3, node(3) + int_field(2, -5) + bytes_field(3, b"bye \xc3\x28 \xff" * 20))
    + record(HEARTBEAT, 0, node(0) + int_field(2, 1 << 62) + double_field(3, float("nan")))
    + record(JOIN, 1)
    + honest_round(),
    "raw_upload_chunks": record(
        UPLOAD, 2, chunk(2, 1, 0, 64, b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")
        + chunk(2, 1, 40, 64, b"x" * 24)
        + chunk(2, 1, 16, 64, b"y" * 24, sha="0" * 32))
    + record(UPLOAD, 1, chunk(1, 1, 0, 1 << 40, b"", resume=True))
    + record(UPLOAD, 0, chunk(1, 1, 0, 10, b"0123456789"))
    + honest_round(),
    "stranger_calls": record(HONEST_UPLOAD, 0)
    + record(JOIN, 4, node(4) + int_field(2, 2))
    + record(WAIT, 4, node(4) + int_field(2, 1))
    + record(DOWNLOAD, 4, node(4) + int_field(2, 0) + int_field(3, 1))
    + record(LEAVE, 4, node(4) + bytes_field(3, "x"))
    + record(UPLOAD, 4, chunk(4, 1, 0, 8, b"12345678"))
    + honest_round(1),
    # Downloads that accept zstd chunks (DownloadRequest.accept_zstd): the whole model of round
    # 1, and node 2's part of it from offset 1000.
    "coded_downloads": honest_round()
    + record(DOWNLOAD, 0, node(0) + int_field(2, 1) + int_field(3, 1) + int_field(6, 1))
    + record(DOWNLOAD, 2, node(2) + int_field(2, 1) + int_field(4, 1000) + int_field(6, 1)),
    "two_rounds": honest_round() + record(TICK, 0) + honest_round()
    + record(DOWNLOAD, 3, node(3) + int_field(2, 2)),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {OUT}")


if __name__ == "__main__":
    main()
