#!/usr/bin/env python3
"""The seed table of scripts/experiment_baselines.sh: per data regime and arm, the final
validation loss (the mean over a run's nodes at its last evaluation, which in a cluster run is
the published model every node holds) over the seeds, as mean, sample standard deviation and
range; the difference from a reference arm paired by seed (same initialisation and data order),
as mean and standard deviation of the per-seed differences, and how many seeds were better; the
same against centralized training. Also the validation loss at each evaluation step (mean over
seeds), so that a curve can be read without the chart. Python 3 standard library only.

Usage: experiment_baselines_report.py --reference ARM [--centralized ARM=DIR[,DIR...] ...]
           REGIME/ARM=DIR[,DIR...] ...
The first --centralized arm is the one the cluster arms are compared with.
Each DIR is a run directory (`spes train --out`: DIR/metrics.jsonl, or `spes launch --out`:
DIR/node<i>/metrics.jsonl), one per seed, in the same seed order for every arm.
Prints markdown on stdout.
"""
import argparse
import glob
import json
import math
import os
import sys


def val_curve(run_dir):
    """{step: mean val_loss over the nodes that evaluated at that step}."""
    files = sorted(glob.glob(os.path.join(run_dir, "node*", "metrics.jsonl")))
    if not files:
        files = [os.path.join(run_dir, "metrics.jsonl")]
    by_step = {}
    for f in files:
        if not os.path.exists(f):
            sys.exit(f"experiment_baselines_report: {f} is missing (did the run finish?)")
        with open(f) as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if "val_loss" in rec and "step" in rec:
                    by_step.setdefault(rec["step"], []).append(rec["val_loss"])
    if not by_step:
        sys.exit(f"experiment_baselines_report: {run_dir} has no validation loss")
    return {s: sum(v) / len(v) for s, v in by_step.items()}


def mean(xs):
    return sum(xs) / len(xs)


def std(xs):  # sample standard deviation (n - 1); 0 for one value
    if len(xs) < 2:
        return 0.0
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def paired(xs, ys):
    """Per-seed differences x - y (an arm run with fewer seeds is paired with the first seeds
    of the other): 'mean +- std (k of n lower)'."""
    d = [x - y for x, y in zip(xs, ys)]
    if len(d) == 1:
        return f"{d[0]:+.3f} (one seed)"
    lower = sum(1 for v in d if v < 0)
    return f"{mean(d):+.3f} ± {std(d):.3f} ({lower} of {len(d)} lower)"


def spread(xs):
    """'mean +- std' and 'min - max' of final losses over seeds."""
    if len(xs) == 1:
        return f"{xs[0]:.3f} (one seed)", "-"
    return f"{mean(xs):.3f} ± {std(xs):.3f}", f"{min(xs):.3f} - {max(xs):.3f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True, help="arm the others are paired against")
    ap.add_argument("--centralized", action="append", default=[],
                    help="single-node runs, one per seed: ARM=DIR,DIR...")
    ap.add_argument("arms", nargs="+", help="REGIME/ARM=DIR[,DIR...]")
    a = ap.parse_args()

    central, central_final = None, None
    lines = []
    for spec in a.centralized:
        arm, _, dirs = spec.partition("=")
        finals = [c[max(c)] for c in (val_curve(d) for d in dirs.split(","))]
        if central_final is None:
            central, central_final = arm, finals
        lines.append(f"| {arm} | " + " | ".join(spread(finals)) + " | "
                     + ("-" if arm == central else paired(finals, central_final)) + " |")
    regimes = {}
    for spec in a.arms:
        key, _, dirs = spec.partition("=")
        regime, _, arm = key.partition("/")
        curves = [val_curve(d) for d in dirs.split(",")]
        regimes.setdefault(regime, []).append((arm, curves))

    out = []
    if central:
        out.append("#### One node (batch of the whole cluster)\n")
        out.append(f"| arm | final val loss, mean ± std | range over seeds | minus {central}, "
                   "paired by seed |")
        out.append("| --- | --- | --- | --- |")
        out.extend(lines)
        out.append("")
    for regime, arms in regimes.items():
        ref = dict(arms).get(a.reference)
        ref_final = [c[max(c)] for c in ref] if ref else None
        out.append(f"#### Data regime: {regime}\n")
        head = ["arm", "final val loss, mean ± std", "range over seeds"]
        if ref_final:
            head.append(f"minus {a.reference}, paired by seed")
        if central:
            head.append(f"minus {central}, paired by seed")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + " --- |" * len(head))
        for arm, curves in arms:
            final = [c[max(c)] for c in curves]
            row = [arm, *spread(final)]
            if ref_final:
                row.append("-" if arm == a.reference else paired(final, ref_final))
            if central:
                row.append(paired(final, central_final))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        steps = sorted(set.intersection(*[set(c) for _, cs in arms for c in cs]))
        out.append("<details><summary>Validation loss at each evaluation (mean over the seeds "
                   "each arm ran)"
                   "</summary>\n")
        out.append("| step | " + " | ".join(arm for arm, _ in arms) + " |")
        out.append("|" + " --- |" * (len(arms) + 1))
        for s in steps:
            out.append(f"| {s} | " + " | ".join(f"{mean([c[s] for c in cs]):.3f}"
                                                for _, cs in arms) + " |")
        out.append("\n</details>\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
