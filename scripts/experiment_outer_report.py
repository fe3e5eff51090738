#!/usr/bin/env python3
"""The report of scripts/experiment_outer.sh (the outer-step grid of issue 37 item 4): reads each
run's summary.json (written by `spes launch`) and writes one markdown section (--out) that it also
puts into --doc (scripts/results_section.py). Per regime (sync interval H x batch per node B): the
final validation loss of every outer setting at every seed (the mean over nodes: every node holds
the published model of the last round), its paired difference from plain averaging in the same
regime (mean, sample standard deviation over seeds, and on how many seeds it is lower), the same
difference at every validation step of the run (and the smallest of them over every seed), and
a summary over regimes of the best outer setting, and (from the server's rounds.jsonl, where its
runs record it) how the outer momentum lines up with each round's change. The sentences come from
the same numbers.
Python 3 standard library only.
Usage: experiment_outer_report.py --sequences N --nodes N --model M --warmup-sequences N
       --charts PATTERN --section NAME --out FILE --doc FILE
       hH-bB/ARM:SEED=DIR ...   (ARM avg or outer-lrLR-mMU)
"""
import argparse
import json
import os
import re

from experiment_runs import (fmt_diff, launch_summary, mean_sd, node_records, paired,
                             parse_runs)
from results_section import add_output_args, markers, run_date, write_section

SCRIPT = "scripts/experiment_outer.sh"
REFERENCE = "avg"


def read_run(d):
    summary, s, final = launch_summary(d)
    curve = {}  # step -> validation losses of the nodes
    for record in node_records(d, len(s["nodes"])):
        if "val_loss" in record:
            curve.setdefault(record["step"], []).append(record["val_loss"])
    return {"summary": summary, "final": final,
            "curve": {step: sum(v) / len(v) for step, v in curve.items()},
            "rounds": s["nodes"][0]["syncs"],
            "agree": bool(s.get("all_nodes_same_model_after_every_sync")),
            "alignment": outer_alignment(d)}


def outer_alignment(d):
    """[(cos, ||m|| / ||delta||)] of the run's rounds that report the outer step's momentum
    against their change (the server's rounds.jsonl "outer"; none for plain averaging or for a
    server older than that record), in round order."""
    out = []
    path = os.path.join(d, "server", "rounds.jsonl")
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            o = json.loads(line).get("outer") or {}
            if o.get("momentum_cos") is not None and o.get("change_norm"):
                out.append((o["momentum_cos"], o["momentum_norm"] / o["change_norm"]))
    return out


def alignment_table(grid, seeds):
    """Per regime and outer arm: the mean over rounds of cos(delta_r, m_(r-1)) (all rounds, and
    the second half of the run), the share of rounds where it is negative, and the mean of
    ||m|| / ||delta||, each as the mean (sd) over seeds; no lines when no run reports them."""
    lines = []
    for regime, arms in grid.items():
        for arm, runs in arms.items():
            per_seed = [runs[s]["alignment"] for s in seeds]
            if not all(per_seed):
                continue
            cols = []
            for pick, fmt in ((lambda a: [c for c, _ in a], "{:+.3f}"),
                              (lambda a: [c for c, _ in a[len(a) // 2:]], "{:+.3f}"),
                              (lambda a: [100.0 * (c < 0) for c, _ in a], "{:.1f}%"),
                              (lambda a: [r for _, r in a], "{:.2f}")):
                m, sd = mean_sd([sum(v) / len(v) for v in map(pick, per_seed)])
                cols.append(fmt.format(m) + (f" ({fmt.format(sd).lstrip('+')})"
                                             if len(seeds) > 1 else ""))
            lines.append(f"| {regime} | {arm} | {len(per_seed[0])} | " + " | ".join(cols) + " |")
    if not lines:
        return []
    return ["The outer momentum against each round's change (the server's `rounds.jsonl`, "
            "`outer`): cos(delta_r, m_(r-1)) between round r's averaged change delta_r = "
            "published before - average and the momentum before that round's update, over every "
            "tensor the outer step moves (`RoundOutcome::outer_momentum_cos`), averaged over the "
            "rounds that have a momentum; mean (sd) over seeds. Near 1 the rounds agree and the "
            "momentum extrapolates; near 0 it adds directions the nodes no longer follow. At "
            "outer lr 1 and momentum 0 the step is plain averaging bit for bit "
            "(`Aggregate.DilocoWithOuterLrOneAndNoMomentumIsFedAvgBitForBit`) and m_(r-1) is "
            "the previous round's change: its cosine is that of consecutive rounds' changes "
            "under plain averaging.", "",
            "| regime | arm | rounds | mean cos | cos, 2nd half | rounds with cos < 0 | "
            "mean norm(m) / norm(delta) |",
            "|---|---|---|---|---|---|---|"] + lines + [""]


def outer_of(arm):
    """(lr, momentum) of an arm: plain averaging is lr 1, momentum 0."""
    m = re.fullmatch(r"outer-lr([0-9.]+)-m([0-9.]+)", arm)
    return (1.0, 0.0) if arm == REFERENCE else (float(m[1]), float(m[2]))


def regime_of(name):
    m = re.fullmatch(r"h(\d+)-b(\d+)", name)
    if not m:
        raise SystemExit(f"experiment_outer_report.py: a regime is hH-bB, not '{name}'")
    return int(m[1]), int(m[2])


def regime_table(regime, arms, seeds, args):
    """The lines of one regime's table and the paired differences of its outer arms."""
    h, b = regime_of(regime)
    steps = args.sequences // b
    rounds = "/".join(map(str, sorted({r["rounds"] for runs in arms.values()
                                       for r in runs.values()})))
    lines = [f"#### H = {h}, {b} sequences per node per step ({steps} steps, "
             f"{rounds} rounds of {h * b} sequences per node)", "",
             f"![validation loss, H {h}, batch {b}, seed {seeds[0]}]"
             f"({args.charts.format(regime=regime)})", "",
             "| arm | outer lr | momentum | long-run gain lr/(1-μ) | " +
             " | ".join(f"seed {s}" for s in seeds) +
             " | vs plain averaging, mean (sd) | lower on | digests agree |",
             "|---|---|---|---|" + "---|" * len(seeds) + "---|---|---|"]
    ref = arms.get(REFERENCE)
    diffs = {}
    for arm, runs in arms.items():
        lr, mu = outer_of(arm)
        if ref is None:
            vs, lower = "(no avg arm)", "-"
        elif arm == REFERENCE:
            vs, lower = "-", "-"
        else:
            diffs[arm] = paired(arms, seeds, arm, REFERENCE)
            vs = fmt_diff(diffs[arm][0], diffs[arm][1], len(seeds))
            lower = f"{diffs[arm][2]} of {len(seeds)}"
        agree = all(r["agree"] for r in runs.values())
        lines.append(f"| {arm} | {lr:g} | {mu:g} | {lr / (1 - mu):.1f} | " +
                     " | ".join(f"{runs[s]['final']:.4f}" for s in seeds) +
                     f" | {vs} | {lower} | {'yes' if agree else 'NO'} |")
    curve_lines, step_diffs = curve_table(arms, seeds)
    return lines + curve_lines, diffs, rounds, step_diffs


def curve_table(arms, seeds):
    """When in the run each outer setting gains or loses against plain averaging: the table of
    the paired difference of the validation loss at every validation step, mean over seeds, and
    every one of those differences as (difference, arm, seed, step)."""
    ref = arms.get(REFERENCE)
    others = [a for a in arms if a != REFERENCE]
    if ref is None or not others:
        return [], []
    steps = sorted(set.intersection(*(set(r["curve"]) for runs in arms.values()
                                       for r in runs.values())))
    lines = ["", "Difference from avg during the run (validation loss at each validation step, "
             "paired by seed, mean over seeds):", "",
             "| arm | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|" + "---|" * len(steps)]
    step_diffs = [(arms[arm][s]["curve"][st] - ref[s]["curve"][st], arm, s, st)
                  for arm in others for s in seeds for st in steps]
    for arm in others:
        cells = [sum(d for d, a, _, st2 in step_diffs if a == arm and st2 == st) / len(seeds)
                 for st in steps]
        lines.append(f"| {arm} | " + " | ".join(f"{c:+.3f}" for c in cells) + " |")
    return lines, step_diffs


def section(grid, seeds, args):
    paths = [r["summary"] for arms in grid.values() for runs in arms.values() for r in runs.values()]
    begin, end = markers(args.section, SCRIPT)
    title = "## The outer-step grid: DiLoCo's outer step against plain averaging"
    if args.section != "outer":
        title += f" ({args.section})"
    lines = [begin, "", title, "",
             f"Generated by `bash scripts/experiment_outer.sh` on {run_date(paths)} "
             f"({os.cpu_count()} CPU cores): the cluster runs of the baselines "
             f"(`configs/default.yaml` with `{args.model}`, {args.nodes} nodes, every node "
             f"training every tensor) at equal tokens, {args.sequences} sequences per node in "
             f"every run, over {len(seeds)} seed(s) ({', '.join(seeds)}), paired by seed. avg: "
             "plain averaging (`spes_config.mode: fedavg`); outer-lrLR-mMU: DiLoCo's outer "
             "Nesterov step on the averaged pseudo-gradient (`mode: diloco`, `outer_lr` LR, "
             "`outer_momentum` MU). The warm-up keeps its tokens "
             f"({args.warmup_sequences} sequences per node). Differences are from avg in the "
             "same regime at the same seed (mean and sample standard deviation over seeds; "
             "lower on: the seeds where the outer step ends below avg).", ""]
    summary = ["| regime | rounds | best outer setting | its difference from avg | lower on |",
               "|---|---|---|---|---|"]
    notes, every_step = [], []
    for regime, arms in grid.items():
        table, diffs, rounds, step_diffs = regime_table(regime, arms, seeds, args)
        lines += table + [""]
        every_step += [(d, regime, arm, seed, step) for d, arm, seed, step in step_diffs]
        if not diffs:
            continue
        best = min(diffs, key=lambda a: diffs[a][0])
        m, sd, lower = diffs[best]
        summary.append(f"| {regime} | {rounds} | {best} | {m:+.4f} ({sd:.4f}) | "
                       f"{lower} of {len(seeds)} |")
        for arm, (m, sd, lower) in diffs.items():
            beats = m < 0 and (len(seeds) == 1 or abs(m) > sd) and lower == len(seeds)
            verdict = ("beats plain averaging on every seed" if beats else
                       "worse than plain averaging on every seed" if lower == 0 else
                       "no difference beyond the spread over seeds")
            notes.append(f"- {regime}, {arm}: {m:+.4f} nats against avg (sd {sd:.4f}): {verdict}.")
    if every_step:
        d, regime, arm, seed, step = min(every_step)
        notes.append(f"- Every validation step of every seed ({len(every_step)} paired "
                     f"comparisons): the outer step's smallest difference from avg is {d:+.4f} "
                     f"({regime}, {arm}, seed {seed}, step {step}); "
                     f"{sum(x[0] < 0 for x in every_step)} of them are below avg.")
    if len(summary) > 2:  # a grid without avg arms has no differences to sum up
        lines += ["Summary over regimes:", ""] + summary + [""]
    if notes:
        lines += notes + [""]
    lines += alignment_table(grid, seeds) + [end, ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    for k in ("--sequences", "--nodes", "--warmup-sequences"):
        p.add_argument(k, type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--charts", required=True, help="the charts' path, {regime} in it")
    p.add_argument("--section", default="outer")
    add_output_args(p)
    p.add_argument("runs", nargs="+", help="hH-bB/ARM:SEED=DIR")
    args = p.parse_args()
    grid = {}
    for spec in args.runs:
        regime = spec.split("/", 1)[0]
        grid.setdefault(regime, []).append(spec.split("/", 1)[1])
    parsed, seeds = {}, None
    for regime, specs in grid.items():
        parsed[regime], s = parse_runs(specs, read_run, "experiment_outer_report.py")
        if seeds is not None and s != seeds:
            raise SystemExit(f"experiment_outer_report.py: regime {regime} has seeds {s}, "
                             f"the others {seeds}")
        seeds = s
    write_section(args.section, section(parsed, seeds, args), args.out, args.doc)


if __name__ == "__main__":
    main()
