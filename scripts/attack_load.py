#!/usr/bin/env python3
"""Load phases against a running `spes serve` with honest nodes (driven by
scripts/attack_load.sh): undisturbed, an idle-connection flood, a header flood without a client
certificate, slow TLS handshakes, and undisturbed again. Samples the server's CPU time, open
descriptors and RSS every second from /proc, counts the rounds published (OUT/rounds.jsonl) and
their spacing, and prints one Markdown table row per phase.
Usage: attack_load.py SERVER_PID PORT SERVER_OUT_DIR CA_PEM PHASE_SECONDS"""
import json, os, socket, ssl, statistics, sys, threading, time

pid, port, out, ca, phase_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
tick = os.sysconf("SC_CLK_TCK")


def sample():
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) // 1024
    return cpu, fds, rss


def round_times():
    try:
        with open(os.path.join(out, "rounds.jsonl")) as f:
            return [json.loads(l)["time"] for l in f if l.strip()]
    except FileNotFoundError:
        return []


class Attack:
    """Runs `body(stop)` on `threads` threads until stopped."""
    def __init__(self, body, threads):
        self.stop = threading.Event()
        self.count = [0]
        self.threads = [threading.Thread(target=body, args=(self.stop, self.count), daemon=True)
                        for _ in range(threads)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        for t in self.threads:
            t.join(10)


def idle_flood(stop, count):
    """Holds as many idle connections as it can (from 127.0.0.2..41), opening new ones as the
    server closes them."""
    held = []
    i = 0
    while not stop.is_set():
        try:
            s = socket.socket()
            s.bind((f"127.0.0.{2 + i % 40}", 0))
            s.settimeout(2)
            s.connect(("127.0.0.1", port))
            held.append(s)
            count[0] += 1
        except OSError:
            time.sleep(0.05)
        i += 1
        if len(held) >= 3000:
            time.sleep(0.1)
    for s in held:
        s.close()


def header_flood(stop, count):
    """TLS connections without a client certificate that try to send 1 MiB of HTTP/2 headers."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    block = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0" + os.urandom(1 << 20)
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(block)
                    s.recv(1)
        except (OSError, ssl.SSLError):
            pass
        count[0] += 1


def slow_handshakes(stop, count):
    """Connections that send the first 7 bytes of a ClientHello and stall (reopened when cut)."""
    held = []
    while not stop.is_set():
        try:
            s = socket.socket()
            s.bind((f"127.0.0.{100 + len(held) % 40}", 0))
            s.settimeout(2)
            s.connect(("127.0.0.1", port))
            s.sendall(b"\x16\x03\x01\x00\x40\x01\x00")
            held.append(s)
            count[0] += 1
        except OSError:
            time.sleep(0.05)
        if len(held) >= 200:
            held.pop(0).close()
            time.sleep(0.05)
    for s in held:
        s.close()


def phase(name, attack=None, threads=1):
    before = sample()
    r0 = len(round_times())
    t0 = time.time()
    peak_fds, peak_rss = before[1], before[2]
    ctx = Attack(attack, threads) if attack else None
    if ctx:
        ctx.__enter__()
    while time.time() - t0 < phase_s:
        time.sleep(1)
        _, fds, rss = sample()
        peak_fds, peak_rss = max(peak_fds, fds), max(peak_rss, rss)
    if ctx:
        ctx.__exit__()
    after = sample()
    times = [t for t in round_times()[r0:] if t >= t0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    cpu = (after[0] - before[0]) / (time.time() - t0)
    rounds = len(round_times()) - r0
    gap = f"{statistics.median(gaps):.2f}" if gaps else "-"
    tries = ctx.count[0] if ctx else 0
    print(f"| {name} | {tries} | {cpu:.2f} | {rounds} | {gap} | {before[1]} / {peak_fds} / {after[1]} "
          f"| {before[2]} / {peak_rss} / {after[2]} |", flush=True)


print(f"{phase_s:.0f} s per phase\n")
print("| phase | attacker connections | server CPU (cores) | rounds published | median s between rounds "
      "| server descriptors before / peak / after | server RSS MiB before / peak / after |")
print("|---|---|---|---|---|---|---|")
phase("undisturbed")
phase("idle-connection flood (40 addresses)", idle_flood, 1)
phase("header flood without a client certificate", header_flood, 4)
phase("slow handshakes (7 bytes, then nothing)", slow_handshakes, 1)
phase("undisturbed, after")
