#!/usr/bin/env python3
"""One emulated WAN link's latency and outages, as a TCP relay (used by scripts/wan_cluster.sh).

Listens on --listen and forwards every connection to --target, each direction delayed by
--delay-ms one way, plus a uniform jitter of +-(--jitter-ms) per chunk (never reordering the
byte stream: a chunk leaves no earlier than the one before it). With --cut it cuts the link
once for --cut-for seconds: every open connection is reset (both sides see the connection
die, as when a router on the path reboots) and new connections are refused until the outage
ends. The cut starts either --cut-at seconds after the relay started or as soon as the relay
has forwarded --cut-after-bytes bytes from the client side to the target in all (over every
connection; bytes still held in the relay do not count).

Leaves out: packet loss and TCP's own reaction to delay (the relay's TCP connections are local
to each side, so only the application sees the delay: request/reply round trips and HTTP/2
flow-control windows, not TCP's congestion window); rate limits (the caller puts `tc tbf` on
the link's interfaces); a silent blackhole (a cut resets, it does not stall).

Writes one JSON object per line to --log: start, each connection, the cut and its end, and the
byte totals every second while they change. Python 3 standard library only.
"""
import argparse
import asyncio
import json
import random
import signal
import socket
import struct
import sys
import time

CHUNK = 64 * 1024
QUEUED_CHUNKS = 32  # at most 2 MiB held per direction: the reader waits when the link is slow


def host_port(text):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT (e.g. 127.0.0.1:50600)")
    return host, int(port)


class Link:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.bytes_up = 0  # forwarded client -> target
        self.bytes_down = 0  # forwarded target -> client
        self.connections = set()  # (client writer, target writer)
        self.cut_state = "armed" if (args.cut_at is not None or args.cut_after_bytes is not None) \
            else "none"
        self.server = None
        self.log_file = open(args.log, "a", buffering=1) if args.log else None

    def log(self, event, **fields):
        rec = {"t": round(time.time(), 3), "since_start_s": round(time.monotonic() - self.t0, 3),
               "event": event, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down}
        rec.update(fields)
        if self.log_file:
            self.log_file.write(json.dumps(rec) + "\n")

    def one_way_delay(self):
        d = self.args.delay_ms
        if self.args.jitter_ms > 0:
            d += self.rng.uniform(-self.args.jitter_ms, self.args.jitter_ms)
        return max(d, 0.0) / 1000.0

    async def pump(self, reader, writer, reader_side_writer, up):
        """Copies one direction: reads chunks, holds each for the link's delay, writes them.
        When the writing side fails, the reading side's connection is reset too."""
        queue = asyncio.Queue(maxsize=QUEUED_CHUNKS)

        async def read_side():
            try:
                while True:
                    data = await reader.read(CHUNK)
                    if not data:
                        break
                    await queue.put((time.monotonic() + self.one_way_delay(), data))
            except (ConnectionError, OSError):
                pass
            await queue.put(None)

        async def write_side():
            last = 0.0
            try:
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    due, data = item
                    due = max(due, last)  # a byte stream: no chunk overtakes the one before
                    last = due
                    wait = due - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if writer.transport.is_closing():  # reset by a cut: nothing more leaves
                        raise ConnectionResetError("link cut")
                    writer.write(data)
                    await writer.drain()
                    if writer.transport.is_closing():  # reset while the chunk waited to leave
                        raise ConnectionResetError("link cut")
                    if up:
                        self.bytes_up += len(data)
                        self.maybe_cut_on_bytes()
                    else:
                        self.bytes_down += len(data)
                if writer.can_write_eof():
                    writer.write_eof()
            except (ConnectionError, OSError, RuntimeError):
                reset(reader_side_writer)
                while await queue.get() is not None:  # let the reading side finish
                    pass

        await asyncio.gather(read_side(), write_side())

    async def handle(self, client_reader, client_writer):
        if self.cut_state == "cutting":
            reset(client_writer)
            return
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.args.target)
            # A small send buffer toward the target: bytes the relay has forwarded are on the
            # link or just behind it, not megabytes queued in the kernel (the link's base round
            # trip is a fraction of a millisecond, so 256 KiB still fills any tc rate).
            target_writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                              socket.SO_SNDBUF, 256 * 1024)
        except OSError as e:
            self.log("target_unreachable", error=str(e))
            reset(client_writer)
            return
        if self.cut_state == "cutting":  # the link went down while this one was opening
            reset(client_writer)
            reset(target_writer)
            return
        pair = (client_writer, target_writer)
        self.connections.add(pair)
        self.log("connection", open_connections=len(self.connections))
        try:
            await asyncio.gather(
                self.pump(client_reader, target_writer, client_writer, up=True),
                self.pump(target_reader, client_writer, target_writer, up=False))
        finally:
            self.connections.discard(pair)
            for w in pair:
                w.close()

    def maybe_cut_on_bytes(self):
        limit = self.args.cut_after_bytes
        if self.cut_state == "armed" and limit is not None and self.bytes_up >= limit:
            self.cut("bytes")

    def cut(self, trigger):
        """Cuts the link now (no chunk leaves after this) and restores it after --cut-for s."""
        if self.cut_state != "armed":
            return
        self.cut_state = "cutting"
        reset_count = len(self.connections)
        for client_writer, target_writer in list(self.connections):
            reset(client_writer)
            reset(target_writer)
        self.connections.clear()
        self.server.close()  # new connections are refused while the link is down
        self.log("cut", trigger=trigger, seconds=self.args.cut_for, connections_reset=reset_count)
        print(f"wan_relay {self.args.name}: link cut for {self.args.cut_for:g} s "
              f"({trigger}; {self.bytes_up} bytes up so far, {reset_count} connection(s) reset)",
              flush=True)
        asyncio.get_running_loop().create_task(self.restore())

    async def restore(self):
        await asyncio.sleep(self.args.cut_for)
        self.server = await asyncio.start_server(self.handle, *self.args.listen,
                                                 reuse_address=True)
        self.cut_state = "done"
        self.log("restored")
        print(f"wan_relay {self.args.name}: link restored", flush=True)

    async def cut_on_time(self):
        await asyncio.sleep(self.args.cut_at)
        self.cut("time")

    async def report_totals(self):
        last = None
        while True:
            await asyncio.sleep(1.0)
            now = (self.bytes_up, self.bytes_down)
            if now != last:
                self.log("totals", open_connections=len(self.connections))
                last = now

    async def run(self):
        self.server = await asyncio.start_server(self.handle, *self.args.listen,
                                                 reuse_address=True)
        self.log("start", listen=list(self.args.listen), target=list(self.args.target),
                 delay_ms=self.args.delay_ms, jitter_ms=self.args.jitter_ms,
                 cut_at=self.args.cut_at, cut_after_bytes=self.args.cut_after_bytes,
                 cut_for=self.args.cut_for)
        tasks = [asyncio.create_task(self.report_totals())]
        if self.args.cut_at is not None:
            tasks.append(asyncio.create_task(self.cut_on_time()))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        self.log("stop")
        for t in tasks:
            t.cancel()


def reset(writer):
    """Closes with a TCP reset (SO_LINGER 0), so the peer sees the connection die at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", type=host_port, required=True, help="HOST:PORT to accept on")
    p.add_argument("--target", type=host_port, required=True, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="+- uniform jitter per chunk")
    p.add_argument("--cut-at", type=float, help="cut the link this many seconds after start")
    p.add_argument("--cut-after-bytes", type=int,
                   help="cut the link once it has carried this many bytes toward the target")
    p.add_argument("--cut-for", type=float, default=5.0, help="outage length in seconds")
    p.add_argument("--seed", type=int, default=0, help="jitter's random seed")
    p.add_argument("--name", default="link", help="name in messages")
    p.add_argument("--log", help="JSON-lines event log (appended)")
    args = p.parse_args()
    if args.delay_ms < 0 or args.jitter_ms < 0 or args.cut_for <= 0:
        p.error("--delay-ms and --jitter-ms must be >= 0 and --cut-for > 0")
    if args.cut_at is not None and args.cut_after_bytes is not None:
        p.error("give --cut-at or --cut-after-bytes, not both")
    try:
        asyncio.run(Link(args).run())
    except OSError as e:
        print(f"wan_relay {args.name}: {e} (is another process on {args.listen[0]}:"
              f"{args.listen[1]}?)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
