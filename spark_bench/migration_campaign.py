"""Issue 28's benchmark as a campaign: `migration` in every case the issue names, several rounds.

One run of `python -m spark_bench migration --histories 16M,256M,1G --migrations 10` judges p99
and flatness on the slowest of 10 moves per history, so a single stall of the host can decide
a run; how often the targets hold is the figure to compare between builds. This runs the
issue's four cases (SQLite and a throwaway PostgreSQL, at half and at the saturating load),
`--rounds` times over, each run in a process of its own (as a user would start it), and prints
which run met every target, with the moves pooled per history (no single move decides those).

    python -m spark_bench migration-campaign --rounds 2 --out reports/migration-campaign
    python -m spark_bench migration-campaign --cases sqlite-1 -- --tail-limit 4M

Arguments after `--` go to every run. Report: report.json and migration-campaign.png in --out (each run's own report
stays in its directory there, with its log).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.kit import percentiles, publish, pyplot, save_figure

from .common import progress
from .migration import ANCHORS, TARGETS, _ratio, targets_met

#: The issue's cases: metadata store and load (a fraction of the saturating rate).
CASES = ("postgres-0.5", "postgres-1", "sqlite-0.5", "sqlite-1")
#: The issue's command.
COMMAND = ["--histories", "16M,256M,1G", "--migrations", "10"]


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m spark_bench migration-campaign",
                                 description="issue 28's migration benchmark, every case, several rounds")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each case (default 2)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated META-LOAD cases, META sqlite or postgres (default {','.join(CASES)})")
    ap.add_argument("--out", default=os.path.join("reports", "migration-campaign"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take before it is killed")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: arguments for every run")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in args.cases:
        meta, _, load = case.partition("-")
        try:
            ok = meta in ("sqlite", "postgres") and 0 < float(load) <= 1
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"--cases: {case!r} is not META-LOAD with META sqlite or postgres and LOAD in (0, 1], "
                     "e.g. sqlite-0.5")
    args.extra = [a for a in args.extra if a != "--"]
    return args


def case_argv(case: str, out: str, extra: list[str]) -> list[str]:
    """The `migration` arguments of one run of `case`."""
    meta, _, load = case.partition("-")
    argv = [*COMMAND, "--load", load, "--out", out]
    if meta == "postgres":
        argv += ["--meta", "postgres"]
    return argv + extra


def judge(report: dict) -> dict:
    """The issue's targets for one run's report: each target met or not, and the figures."""
    met = dict(targets_met(report), no_failures=not report["failures"])
    return dict(p99_s=[h["p99_s"] for h in report["histories"]], p99_target_s=report["p99_target_s"],
                flatness=report["flatness"], throughput_ratio=report["throughput_ratio"],
                lost=report["verification"]["lost"], load_mb_s=report["load_mb_s"],
                met=met, every_target=all(met.values()))


def pooled(reports: list[dict]) -> dict:
    """Every run's moves together, per history: count, mean, p50, p90 and max in seconds."""
    by: dict[str, list[float]] = {}
    for r in reports:
        for m in r["moves"]:
            by.setdefault(m["partition"], []).append(m["seconds"])
    out = {}
    for name, values in by.items():
        ms = percentiles([int(v * 1e9) for v in values], ps=(0.5, 0.9))
        out[name] = dict(moves=ms["samples"], **{f"{k}_s": ms[f"{k}_ms"] / 1e3 for k in ("mean", "p50", "p90", "max")})
    return out


def run(argv=None) -> dict:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    runs, reports = [], []
    total = args.rounds * len(args.cases)
    for r in range(1, args.rounds + 1):
        for case in args.cases:
            name = f"r{r}-{case}"
            out = os.path.join(args.out, name)
            progress(f"run {len(runs) + 1} of {total}: {name}")
            started = time.monotonic()
            with open(out + ".log", "w") as log:
                try:
                    rc = subprocess.run([sys.executable, "-m", "spark_bench", "migration",
                                         *case_argv(case, out, args.extra)],
                                        stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = None
            row: dict = dict(run=name, case=case, round=r, rc=rc, seconds=round(time.monotonic() - started, 1))
            path = os.path.join(out, "report.json")
            if rc == 0 and os.path.exists(path):
                with open(path) as f:
                    report = json.load(f)
                reports.append(report)
                row.update(judge(report))
            else:
                row.update(every_target=False, error=f"exit status {rc} (see {out}.log)" if rc is not None
                           else f"killed after {args.timeout:g} s (see {out}.log)")
            runs.append(row)
            progress("  " + format_row(row))
    met = sum(r["every_target"] for r in runs)
    result = dict(kind="migration-campaign", command=COMMAND, extra=args.extra, targets=TARGETS, runs=runs,
                  every_target=met, of=len(runs), pooled=pooled(reports))
    return publish(result, args.out, plot, format_report)


def plot(result: dict, out: str) -> list[str]:
    """Each run's p99 per history (a line per run) over its load's target; pooled p50/p90."""
    plt = pyplot("spark_bench")
    runs = [r for r in result["runs"] if "p99_s" in r]
    if plt is None or not runs:
        return []
    fig, (each, pool) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        style = "-" if r["every_target"] else ":"
        each.plot(range(len(r["p99_s"])), [v * 1000 for v in r["p99_s"]], style, marker="o", label=r["run"])
    for name, value in (("saturation", TARGETS["p99_s_at_saturation"]), ("half load", TARGETS["p99_s_at_half_load"])):
        each.axhline(value * 1000, color="red", ls="--", lw=1, label=f"p99 target at {name}")
    names = list(result["pooled"])
    each.set_xticks(range(len(names)), names)
    each.set_ylabel("p99 of the run's moves, ms")
    each.set_title(f"{result['every_target']} of {result['of']} runs met every target (dotted: missed one)")
    each.legend(fontsize=6, ncol=2)
    for key in ("p50_s", "p90_s", "max_s"):
        pool.plot(names, [result["pooled"][n][key] * 1000 for n in names], marker="o", label=key[:-2])
    pool.set_ylim(bottom=0)
    pool.set_ylabel("ms")
    pool.set_title("every run's moves pooled per history")
    pool.legend(fontsize=8)
    return [save_figure(plt, fig, out, "migration-campaign.png")]


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['run']:<16} {row['error']}"
    p99 = "/".join(f"{v * 1000:.0f}" for v in row["p99_s"])
    missed = [k for k, ok in row["met"].items() if not ok]
    return (f"{row['run']:<16} load {row['load_mb_s']:4.0f} MB/s  p99 ms {p99:<10} (< {row['p99_target_s'] * 1000:.0f})  "
            f"flatness {_ratio(row['flatness'])}  throughput ratio {_ratio(row['throughput_ratio'])}  "
            f"lost {row['lost']}  "
            + ("every target met" if not missed else "MISSED " + ", ".join(missed)))


def format_report(result: dict) -> str:
    lines = ["=" * 100, f"migration campaign: {result['every_target']} of {result['of']} runs met every target "
             f"(p99 per history below the load's target, flatness <= {TARGETS['flatness']}, throughput ratio >= "
             f"{TARGETS['throughput_ratio_during_migrations']}, 0 lost)"]
    lines += ["  " + format_row(r) for r in result["runs"]]
    lines.append("  moves of every run pooled per history (ms): " + "; ".join(
        f"{name} {p['moves']} moves, mean {p['mean_s'] * 1000:.1f}, p50 {p['p50_s'] * 1000:.1f}, "
        f"p90 {p['p90_s'] * 1000:.1f}, max {p['max_s'] * 1000:.1f}" for name, p in result["pooled"].items()))
    lines.append(f"  anchors: {ANCHORS['automq']}; Apache Kafka copies the history (each run's report measures the copy)")
    return "\n".join(lines)
