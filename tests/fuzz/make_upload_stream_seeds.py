#!/usr/bin/env python3
"""Writes the upload_stream fuzz target's seeds for coded chunks (sync protocol 4: a chunk's
data as one zstd frame, UploadChunk.encoding 1) from its raw seeds in
tests/fuzz/corpus/upload_stream/: the same streams with every chunk coded, a frame cut short, a
frame that claims more than the 4 MiB a chunk may hold, and an unknown encoding. A record is
[u32 little-endian length][UploadChunk message]. Needs the zstd command (Debian's zstd).
    python3 tests/fuzz/make_upload_stream_seeds.py
"""
import os
import struct
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus", "upload_stream")
DATA, CHECKSUM, UPLOAD_CHECKSUM, ENCODING = 6, 7, 9, 10  # UploadChunk's (proto/spes_sync.proto)


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(b, i):
    n = shift = 0
    while True:
        n |= (b[i] & 0x7F) << shift
        shift += 7
        i += 1
        if not b[i - 1] & 0x80:
            return n, i


def fields(msg):
    """The message's fields as (number, wire type, value: int or bytes), in order."""
    out, i = [], 0
    while i < len(msg):
        key, i = read_varint(msg, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(msg, i)
        elif wt == 2:
            n, i = read_varint(msg, i)
            v, i = msg[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wt} not expected in an UploadChunk")
        out.append((num, wt, v))
    return out


def message(fs):
    out = bytearray()
    for num, wt, v in fs:
        out += varint(num << 3 | wt)
        out += varint(v) if wt == 0 else varint(len(v)) + v
    return bytes(out)


def records(path):
    b, i, out = open(path, "rb").read(), 0, []
    while i + 4 <= len(b):
        (n,) = struct.unpack_from("<I", b, i)
        out.append(fields(b[i + 4:i + 4 + n]))
        i += 4 + n
    return out


def write(name, recs):
    with open(os.path.join(CORPUS, name), "wb") as f:
        for r in recs:
            m = message(r)
            f.write(struct.pack("<I", len(m)) + m)


def zstd(raw):
    # Level 1, as the sender; from a file, so that the frame records its content size.
    with tempfile.NamedTemporaryFile() as f:
        f.write(raw)
        f.flush()
        return subprocess.run(["zstd", "-1", "-q", "-c", f.name], stdout=subprocess.PIPE,
                              check=True).stdout


def coded(rec, frame=None, encoding=1):
    # Without checksums (the entry fills in each chunk's; the raw seeds' whole-stream checksums
    # are SHA-256 digests of sync protocol 2), so that the stream can be accepted whole.
    out = [f for f in rec if f[0] not in (CHECKSUM, UPLOAD_CHECKSUM, ENCODING)]
    out = [(n, wt, (frame if frame is not None else zstd(v)) if n == DATA else v)
           for n, wt, v in out]
    return out + [(ENCODING, 0, encoding)]


def main():
    for base, name in (("valid_three_chunks", "coded_three_chunks"),
                       ("valid_one_chunk_with_sha", "coded_one_chunk")):
        write(name, [coded(r) for r in records(os.path.join(CORPUS, base))])
    first, *rest = records(os.path.join(CORPUS, "valid_three_chunks"))
    data = next(v for n, _, v in first if n == DATA)
    write("coded_frame_cut_short", [coded(first, zstd(data)[:-5])] + [coded(r) for r in rest])
    write("coded_frame_claims_5_mib", [coded(first, zstd(bytes(5 << 20)))])
    write("coded_unknown_encoding", [coded(first, encoding=7)])


if __name__ == "__main__":
    main()
