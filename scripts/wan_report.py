#!/usr/bin/env python3
"""The report of a run of scripts/wan_cluster.sh: reads OUT/wan.json (the links), the server's
OUT/server/rounds.jsonl, each node's OUT/node<i>/metrics.jsonl, OUT/timeline.tsv (when each
metrics line appeared: metrics.jsonl carries no clock) and the relays' OUT/links/node<i>.jsonl,
and writes OUT/wan_summary.txt (tables) and OUT/wan_summary.json (the same figures):
  - per round: its wall time on the server (first upload received -> last download served), the
    time since the previous round, and per node the bytes it sent and received, the seconds its
    training stood still for the sync (with spes_config.overlap: only the wait to apply the
    round; the round itself ran while the node trained), the seconds the round waited to
    publish, and whether its model digest equals the published one;
  - per node: wall time, time in syncs (share of the wall time), bytes, link cuts and resumed
    uploads;
  - the validation loss against wall-clock time (seconds since the cluster started; the
    timeline's resolution is 0.5 s).
`wan_report.py --round-line` prints one line for the rounds.jsonl record on stdin (live view).
Python 3 standard library only.
"""
import json
import os
import sys


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def stood_still(s):
    """Seconds a node's training stood still for the sync record `s`."""
    return s.get("blocked_s", s.get("seconds", 0)) or 0


def mb(b):
    return b / 1e6


def round_line(r):
    up = "/".join(f"{mb(b):.1f}" for b in r.get("bytes_in_wire_per_node", []))
    down = "/".join(f"{mb(b):.1f}" for b in
                    r.get("bytes_out_wire_per_node", r.get("bytes_out_per_node", [])))
    return (f"round {r['round']} (step {r['step']}): open {r['seconds']:.1f} s + downloads "
            f"{r.get('download_s', 0):.1f} s, MB up per node {up}, MB down per node {down}")


def line_times(timeline, nodes):
    """times[i][k]: the first time node i's metrics.jsonl had k+1 lines."""
    times = [[] for _ in range(nodes)]
    for row in timeline:
        t, counts = row[0], row[1:]
        for i in range(min(nodes, len(counts))):
            while len(times[i]) < counts[i]:
                times[i].append(t)
    return times


def table(headers, rows):
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(cells[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells[1:]])


def build(out):
    setup = json.load(open(os.path.join(out, "wan.json")))
    n = setup["nodes"]
    t_start = setup["started"]
    rounds = read_jsonl(os.path.join(out, "server", "rounds.jsonl"))
    metrics = [read_jsonl(os.path.join(out, f"node{i}", "metrics.jsonl")) for i in range(n)]
    timeline = []
    tl_path = os.path.join(out, "timeline.tsv")
    if os.path.exists(tl_path):
        for line in open(tl_path):
            parts = line.split()
            if len(parts) == n + 1:
                timeline.append([float(parts[0])] + [int(p) for p in parts[1:]])
    times = line_times(timeline, n)
    links = [read_jsonl(os.path.join(out, "links", f"node{i}.jsonl")) for i in range(n)]

    def when(i, k):  # seconds since the start at which node i's metrics line k appeared
        return round(times[i][k] - t_start, 1) if k < len(times[i]) else None

    syncs = [{} for _ in range(n)]  # node -> round -> sync record (+ its time)
    validation = []
    for i in range(n):
        for k, rec in enumerate(metrics[i]):
            if "sync" in rec:
                s = dict(rec["sync"])
                s["t"] = when(i, k)
                syncs[i][s["round"]] = s
            if "val_loss" in rec:
                validation.append({"node": i, "step": rec["step"], "t_s": when(i, k),
                                   "tokens": rec.get("tokens"), "val_loss": rec["val_loss"]})

    round_rows = []
    prev_time = None
    for r in rounds:
        wall = (r.get("seconds", 0) + r.get("aggregate_s", 0) + r.get("persist_s", 0) +
                r.get("download_s", 0))
        per_node = []
        for i in range(n):
            s = syncs[i].get(r["round"])
            per_node.append(None if s is None else {
                "bytes_up": s.get("bytes_up_sent", s.get("bytes_up", 0)),
                "bytes_down": s.get("bytes_down_wire", s.get("bytes_down", 0)),
                "sync_s": stood_still(s), "wait_s": s.get("wait_s"),
                "overlap": bool(s.get("overlap", False)),
                # Steps the node trained while the round was in flight (0: it blocked).
                "steps_in_flight": (s["applied_step"] - s["step"]) if s.get("overlap") and
                "applied_step" in s else 0,
                "upload_s": s.get("upload_s"), "download_s": s.get("download_s"),
                "upload_resumed_from": s.get("upload_resumed_from", 0),
                "caught_up": bool(s.get("caught_up", False)),
                "model_sha256_matches": s.get("model_sha256") == r["model_sha256"],
                "t_s": s.get("t")})
        round_rows.append({
            "round": r["round"], "step": r["step"], "nodes_used": r.get("nodes"),
            "wall_s": round(wall, 2), "open_s": r.get("seconds"),
            "download_s": r.get("download_s"),
            "since_previous_s": None if prev_time is None else round(r["time"] - prev_time, 2),
            "server_bytes_in_wire_per_node": r.get("bytes_in_wire_per_node"),
            "server_bytes_in_resumed_per_node": r.get("bytes_in_resumed_per_node"),
            "server_bytes_out_per_node": r.get("bytes_out_per_node"),
            "model_sha256": r["model_sha256"], "merged": r.get("merged", False),
            "missing": r.get("missing"), "per_node": per_node,
            "digests_agree": all(p is not None and p["model_sha256_matches"] for p in per_node)})
        prev_time = r.get("time", prev_time)

    node_rows = []
    for i in range(n):
        s = list(syncs[i].values())
        wall = (times[i][-1] - t_start) if times[i] else None
        in_sync = sum(stood_still(x) for x in s)
        cuts = [e for e in links[i] if e["event"] == "cut"]
        node_rows.append({
            "node": i, "link": setup["links"][i], "steps": len(metrics[i]),
            "wall_s": None if wall is None else round(wall, 1),
            "sync_s": round(in_sync, 1), "wait_s": round(sum(x.get("wait_s", 0) for x in s), 1),
            "sync_share": None if not wall else round(in_sync / wall, 3),
            "bytes_up": sum(x.get("bytes_up_sent", x.get("bytes_up", 0)) for x in s),
            "bytes_down": sum(x.get("bytes_down_wire", x.get("bytes_down", 0)) for x in s),
            "rounds": len(s), "caught_up": sum(1 for x in s if x.get("caught_up")),
            "uploads_resumed": sum(1 for x in s if x.get("upload_resumed_from", 0) > 0),
            "cuts": [{"t_s": round(c["t"] - t_start, 1), "seconds": c["seconds"],
                      "trigger": c["trigger"], "bytes_up_at_cut": c["bytes_up"],
                      "connections_reset": c["connections_reset"]} for c in cuts],
            "relay_bytes_up": links[i][-1]["bytes_up"] if links[i] else None,
            "relay_bytes_down": links[i][-1]["bytes_down"] if links[i] else None})
    return {"setup": setup, "rounds": round_rows, "nodes": node_rows, "validation": validation,
            "rounds_published": len(rounds),
            "digests_agree": bool(round_rows) and all(r["digests_agree"] for r in round_rows)}


def text(rep):
    n = rep["setup"]["nodes"]
    lines = [f"WAN cluster run of {rep['setup']['date']}: {n} nodes, config "
             f"{rep['setup']['config']}", f"netem: {rep['setup']['netem']}", ""]
    lines.append(table(["node", "rate", "rtt ms", "jitter ms", "cut"],
                       [[l["node"], l["rate"], l["rtt_ms"], l["jitter_ms"], l["cut"] or "-"]
                        for l in rep["setup"]["links"]]))
    lines += ["", "Per round (MB up/down and seconds per node, node 0 first; sync: training "
              "stood still, wait: of it waiting for the round to publish):"]
    rows = []
    for r in rep["rounds"]:
        def col(key, scale=1.0, f="{:.1f}"):
            return "/".join("-" if p is None or p.get(key) is None else f.format(p[key] * scale)
                            for p in r["per_node"])
        rows.append([r["round"], r["step"], f"{r['wall_s']:.1f}",
                     "-" if r["since_previous_s"] is None else f"{r['since_previous_s']:.1f}",
                     col("bytes_up", 1e-6), col("bytes_down", 1e-6), col("sync_s"),
                     col("wait_s"), "yes" if r["digests_agree"] else "NO"])
    lines.append(table(["round", "step", "wall s", "since prev s", "MB up", "MB down", "sync s",
                        "wait s", "same digest"], rows))
    lines += ["", "Per node:"]
    lines.append(table(
        ["node", "rate", "steps", "wall s", "in syncs s", "share", "waiting s", "MB up",
         "MB down", "cuts", "resumed uploads", "caught up"],
        [[x["node"], x["link"]["rate"], x["steps"], "-" if x["wall_s"] is None else x["wall_s"],
          x["sync_s"],
          "-" if x["sync_share"] is None else f"{100 * x['sync_share']:.0f}%", x["wait_s"],
          f"{mb(x['bytes_up']):.1f}", f"{mb(x['bytes_down']):.1f}",
          "; ".join(f"{c['seconds']:g} s at {c['t_s']} s" for c in x["cuts"]) or "-",
          x["uploads_resumed"], x["caught_up"]] for x in rep["nodes"]]))
    if rep["validation"]:
        lines += ["", "Validation loss against wall-clock time (seconds since the start, per "
                  "node; one loss where every node measured the same):"]
        rows = []
        for step in sorted({v["step"] for v in rep["validation"]}):
            at = {v["node"]: v for v in rep["validation"] if v["step"] == step}
            losses = sorted({f"{v['val_loss']:.4f}" for v in at.values()})
            rows.append([step, next(iter(at.values()))["tokens"],
                         "/".join("-" if i not in at or at[i]["t_s"] is None else
                                  f"{at[i]['t_s']:.1f}" for i in range(n)),
                         losses[0] if len(losses) == 1 else
                         "/".join(f"{at[i]['val_loss']:.4f}" if i in at else "-"
                                  for i in range(n))])
        lines.append(table(["step", "tokens per node", "t s", "val loss"], rows))
    lines += ["", f"rounds published: {rep['rounds_published']}; every node's model digest equal "
              f"to the published one after every round: {'yes' if rep['digests_agree'] else 'NO'}"]
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--round-line":
        print(round_line(json.loads(sys.stdin.read())), flush=True)
        return
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: wan_report.py OUT (a scripts/wan_cluster.sh run directory) | --round-line")
    out = sys.argv[1]
    if not os.path.exists(os.path.join(out, "wan.json")):
        sys.exit(f"wan_report.py: '{out}' is not a wan_cluster.sh run (no wan.json)")
    rep = build(out)
    with open(os.path.join(out, "wan_summary.json"), "w") as f:
        json.dump(rep, f, indent=1)
    txt = text(rep)
    with open(os.path.join(out, "wan_summary.txt"), "w") as f:
        f.write(txt)
    sys.stdout.write(txt)
    print(f"written: {out}/wan_summary.txt, {out}/wan_summary.json")


if __name__ == "__main__":
    main()
