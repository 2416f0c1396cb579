"""What PostgreSQL's LISTEN/NOTIFY fan-out costs at scale (issue 53): every KV write notifies
every listening session (one per node agent, README). A failover of 10,000 partitions in a
cluster of 10 nodes sent each node some 20,000 notices, most about partitions it never holds;
a write of many keys now sends one per path segment (postgres.NOTICES_PER_WRITE).

    python3 -m s3stream bench --kind notify [-- --partitions 10000 --listeners 9 --rounds 3]

A throwaway PostgreSQL server holds `--partitions` x (listeners + 1) assignments, the cluster of
10 nodes x 10,000 the issue names. Each round, one burst, what a failover of one node's
partitions writes: Cluster.assign_many of its `--partitions` to the others (round-robin), then
their `opened/` records (put_kvs, as the targets' agents publish them); the next round moves
them back. Cases alternate within one run:
- quiet: nobody listens;
- listening: `--listeners` processes, each with the change feed a node agent opens
  (kv_changes of assignment/ and closed/) waking on it in a loop;
- listening+passes: as listening, and each wake-up followed by what an agent's pass reads (every
  assignment of the cluster, Cluster.assignments), at most once per twice its cost, as the agent
  spaces pushed changes (RECONCILE_SPACING).
Per case: the writer's seconds, PostgreSQL's CPU seconds (all its processes), the listeners' CPU
seconds (all of them), their wake-ups each, and how long after the burst's last commit the last
listener woke. Writes report.json and notify.png under `--out`. No target: the issue asks what
it costs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

CASES = ("quiet", "listening", "listening+passes")
#: Agents' prefixes (NodeAgent's kv_changes).
PREFIXES = ("assignment/", "closed/")


def listen_main(argv: list[str]) -> None:
    """One listener: a change feed as a node agent opens it, woken in a loop; with `--passes`,
    each wake-up reads every assignment (spaced as the agent spaces its passes). Commands on
    stdin: `report` (JSON: wakes, passes, CPU seconds, wall time of the last wake), `stop`."""
    p = argparse.ArgumentParser()
    p.add_argument("--meta", required=True)
    p.add_argument("--passes", action="store_true")
    args = p.parse_args(argv)
    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    meta = open_metadata(args.meta)
    feed = meta.kv_changes(PREFIXES)
    cluster = Cluster(meta, None) if args.passes else None
    if cluster is not None:
        cluster.assignments()          # an agent's first pass: the later ones decode only what changed
    state = {"wakes": 0, "passes": 0, "last_wake": 0.0, "in_pass": False}
    stop = threading.Event()

    def loop() -> None:
        next_pass = 0.0
        while not stop.is_set():
            if feed.wait(0.2):
                state["wakes"] += 1
                state["last_wake"] = time.time()
                if cluster is not None:
                    state["in_pass"] = True
                    time.sleep(max(0.0, next_pass - time.monotonic()))
                    t = time.monotonic()
                    cluster.assignments()
                    state["passes"] += 1
                    state["in_pass"] = False
                    next_pass = time.monotonic() + min(0.5, 2 * (time.monotonic() - t))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "report":
            cpu = os.times()
            print("report " + json.dumps(dict(state, cpu_s=cpu.user + cpu.system)), flush=True)
        elif line.strip() == "stop":
            break
    stop.set()
    feed.wake()
    thread.join(5)
    feed.close()
    meta.close()


class Listener:
    def __init__(self, meta_url: str, passes: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.notify", "listen", "--meta", meta_url]
                                     + (["--passes"] if passes else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._read("ready")

    def _read(self, answer: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a listener exited ({self.proc.wait()}) before saying {answer!r}")
            if line.startswith(answer):
                return line[len(answer):].strip()

    def report(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        return json.loads(self._read("report "))

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def postgres_cpu_seconds() -> float:
    """CPU seconds of every process named postgres on the host (the throwaway server's)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        if head.split("(", 1)[-1].startswith("postgres"):
            fields = rest.split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def burst(cluster, meta, names: list[str], targets: list[int]) -> float:
    """What a failover of `names` writes: their reassignment, then their targets' opened/
    records. Seconds it took the writer."""
    t0 = time.monotonic()
    moves = {name: targets[i % len(targets)] for i, name in enumerate(names)}
    versions = cluster.assign_many(moves)
    now = time.time()
    meta.put_kvs([(f"opened/{name}", json.dumps({"node": moves[name], "version": versions[name], "at": now})
                   .encode()) for name in names])
    return time.monotonic() - t0


def one_case(case: str, meta_url: str, cluster, meta, names: list[str], targets: list[int], args) -> dict:
    listeners = [Listener(meta_url, case == "listening+passes") for _ in range(args.listeners)] \
        if case != "quiet" else []
    try:
        time.sleep(0.5)
        before = [x.report() for x in listeners]
        pg0 = postgres_cpu_seconds()
        writer = burst(cluster, meta, names, targets)
        ended = time.time()
        # Settled once no listener has woken for a second, nor is in a pass.
        while listeners:
            time.sleep(1.0)
            if all(r["last_wake"] < time.time() - 1.0 and not r["in_pass"] for r in (x.report() for x in listeners)):
                break
        pg = postgres_cpu_seconds() - pg0
        after = [x.report() for x in listeners]
    finally:
        for x in listeners:
            x.stop()
    wakes = [a["wakes"] - b["wakes"] for a, b in zip(after, before)]
    return {"case": case, "writer_s": round(writer, 3), "postgres_cpu_s": round(pg, 3),
            "listeners_cpu_s": round(sum(a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before)), 3),
            "wakes_each": round(statistics.mean(wakes), 1) if wakes else 0,
            "passes_each": round(statistics.mean(a["passes"] - b["passes"] for a, b in zip(after, before)), 1)
            if listeners else 0,
            "last_wake_after_s": round(max(a["last_wake"] for a in after) - ended, 3) if listeners else None}


def format_report(report: dict) -> str:
    lines = [f"LISTEN/NOTIFY fan-out (issue 53): a burst reassigns {report['partitions']} partitions and publishes "
             f"their opened/ records, in a cluster of {report['assignments']} assignments; "
             f"{report['listeners']} listeners", "",
             f"{'case':>18} {'writer':>8} {'PG CPU':>8} {'listeners CPU':>14} {'wakes each':>11} "
             f"{'passes each':>12} {'last wake after':>16}"]
    for r in report["rows"]:
        late = "-" if r["last_wake_after_s"] is None else f"{r['last_wake_after_s']:.2f} s"
        lines.append(f"{r['case']:>18} {r['writer_s']:>7.2f}s {r['postgres_cpu_s']:>7.2f}s "
                     f"{r['listeners_cpu_s']:>13.2f}s {r['wakes_each']:>11} {r['passes_each']:>12} {late:>16}")
    lines.append("")
    lines.append("medians per case: " + "; ".join(
        f"{case}: writer {m['writer_s']} s, PG CPU {m['postgres_cpu_s']} s, listeners CPU {m['listeners_cpu_s']} s"
        for case, m in report["medians"].items()))
    lines.append("notices per burst: one per write and path segment (assignment/, opened/: a write of more than "
                 "NOTICES_PER_WRITE keys names its segments, not its keys), each sent to every listening session, "
                 "which filters them by prefix")
    return "\n".join(lines)


def plot(report: dict, out: str) -> list:
    from benchmarks.kit import pyplot, save_figure
    plt = pyplot("notify")
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = ("writer_s", "postgres_cpu_s", "listeners_cpu_s")
    width = 0.25
    for i, case in enumerate(report["medians"]):
        ax.bar([k + (i - 1) * width for k in range(len(keys))], [report["medians"][case][k] for k in keys],
               width, label=case)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(["writer (wall)", "PostgreSQL CPU", "listeners CPU (all)"])
    ax.set_ylabel("seconds per burst")
    ax.legend()
    return [save_figure(plt, fig, out, "notify.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind notify", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", type=int, default=10000, help="partitions per node (a burst moves one node's)")
    p.add_argument("--listeners", type=int, default=9, help="listening node agents (the other nodes)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three cases")
    p.add_argument("--meta", default=None, help="an empty PostgreSQL database's URL (default: a throwaway server)")
    p.add_argument("--out", default="reports/notify", help="report directory")
    p.add_argument("--quick", action="store_true", help="1,000 partitions, 3 listeners, 1 round")
    return p


def run(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    if parser.parse_args(argv).quick:
        parser.set_defaults(partitions=1000, listeners=3, rounds=1)
    args = parser.parse_args(argv)
    from benchmarks.kit import log_line, publish
    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    nodes = args.listeners + 1
    with contextlib.ExitStack() as stack:
        meta_url = args.meta
        if meta_url is None:
            from testservers.postgres import throwaway_postgres
            meta_url = stack.enter_context(throwaway_postgres()).create_database("notify")
        meta = open_metadata(meta_url)
        cluster = Cluster(meta, None)
        if meta.list_kv("assignment/"):
            raise SystemExit(f"{meta_url} holds assignments already: give an empty database")
        try:
            everyone = {f"p{n:02d}-{i:05d}": n for n in range(1, nodes + 1) for i in range(args.partitions)}
            cluster.assign_many(everyone)
            mine = [name for name, node in everyone.items() if node == 1]
            others = list(range(2, nodes + 1))
            rows = []
            back = False
            for r in range(args.rounds):
                for case in CASES:
                    row = one_case(case, meta_url, cluster, meta, mine, [1] if back else others, args)
                    back = not back
                    rows.append(dict(row, round=r))
                    log_line(f"round {r} {case}: {row}", sys.stderr)
        finally:
            cluster.close()
            meta.close()
    medians = {case: {k: round(statistics.median(x[k] for x in rows if x["case"] == case), 3)
                      for k in ("writer_s", "postgres_cpu_s", "listeners_cpu_s")} for case in CASES}
    report = {"partitions": args.partitions, "listeners": args.listeners, "assignments": nodes * args.partitions,
              "rows": rows, "medians": medians}
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "listen":
        listen_main(sys.argv[2:])
    else:
        run(sys.argv[1:])
