"""What the experiment report scripts share: the runs named on their command line as
ARM:SEED=DIR (every arm at every seed, refused otherwise), what a `spes launch` run directory
says (its summary and its nodes' metric records), and the mean and sample standard deviation of
paired differences. Python 3 standard library only."""
import json
import math
import os


def launch_summary(d):
    """(path, parsed summary, final validation loss as the mean over nodes) of the `spes launch`
    run in d (every node holds the published model of the last round)."""
    path = os.path.join(d, "summary.json")
    with open(path) as f:
        s = json.load(f)
    finals = [n["final_val_loss"] for n in s["nodes"]]
    return path, s, sum(finals) / len(finals)


def node_records(d, nodes):
    """Every metric record (one parsed line of DIR/node<i>/metrics.jsonl) of nodes 0..nodes-1."""
    for i in range(nodes):
        with open(os.path.join(d, f"node{i}", "metrics.jsonl")) as f:
            for line in f:
                yield json.loads(line)


def parse_runs(specs, read_run, script):
    """{arm: {seed: read_run(DIR)}} and the seeds in order, from ARM:SEED=DIR strings; exits with
    the missing ARM:SEED pairs when some arm lacks a seed that another has."""
    arms, seeds = {}, []
    for a in specs:
        key, _, d = a.partition("=")
        name, _, seed = key.rpartition(":")
        arms.setdefault(name, {})[seed] = read_run(d)
        if seed not in seeds:
            seeds.append(seed)
    missing = [f"{n}:{s}" for n, runs in arms.items() for s in seeds if s not in runs]
    if missing:
        raise SystemExit(f"{script}: every arm needs a run for every seed; missing " +
                         ", ".join(missing))
    return arms, seeds


def mean_sd(xs):
    """Mean and sample standard deviation (nan for one value)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan")
    return m, sd


def paired(arms, seeds, a, b):
    """Mean and sd over seeds of arm a's final loss minus arm b's (both {seed: run with
    "final"}), and on how many seeds a ends lower."""
    diffs = [arms[a][s]["final"] - arms[b][s]["final"] for s in seeds]
    m, sd = mean_sd(diffs)
    return m, sd, sum(1 for d in diffs if d < 0)


def fmt_diff(m, sd, n):
    """A paired difference as the tables print it: mean (sd), or mean (one seed)."""
    return f"{m:+.4f} ({sd:.4f})" if n > 1 else f"{m:+.4f} (one seed)"
