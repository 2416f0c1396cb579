"""Many partitions on one node (issue 53): how long opening, failing over and draining take, and
what idle partitions cost, with N partitions per node, nodes as processes, the default
ClusterConfig, a local store and SQLite or PostgreSQL metadata.

    python3 -m s3stream bench --kind scale [-- --partitions 100,1000 --meta sqlite,postgres]

Per N and metadata store, in order:
1. node A (id 1) starts alone; N new partitions are assigned to it (Cluster.assign_many, one
   write): "first open" is the time until every one is created and open (its `opened/` record
   written).
2. A appends one record to each partition, is killed (SIGKILL) and started again on its WAL:
   "open after restart" runs from the new process's start to every partition open, the WAL's
   replay included. Then, idle: A's CPU (% of a core) over `--idle` seconds and its RSS.
3. node B (id 2) starts; A appends one record to each partition and is killed again. B's agent
   judges A silent (heartbeat_timeout) and fails it over: per partition, the time from the kill
   to its open on B ("failover", p50 / p99 / all), beside the target heartbeat_timeout + 2 s.
4. A starts once more; a drain moves `--drain` of B's partitions to A (Cluster.migrate_many:
   closed on B and opened on A in batches): "drain" is the time until all are open on A.
5. Busy among idle: node C (id 3) starts with `--busy` partitions of its own and appends to them
   as fast as it can for `--load` seconds (64 KiB batches, 8 in flight per partition), after a
   warm-up of up to 2 s: MB/s alone. Then all N idle partitions move to C (migrate_many: "move
   all") and C appends to its busy ones again: MB/s among N idle, and the ratio, beside the
   target 0.9.

Each phase also counts the metadata operations of the nodes (InstrumentedMetadataStore: calls
per operation) and prints them per partition. Reports: reports/scale/report.json and a PNG.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

#: The issue's targets (10,000 partitions on one node, both metadata stores).
TARGETS = {
    "open_after_restart_s": 5.0,
    "failover_all_over_heartbeat_timeout_s": 2.0,
    "drain_1000_s": 5.0,
    "idle_cpu_percent": 5.0,
    "rss_per_idle_partition_kib": 32.0,
    "busy_among_idle_ratio": 0.9,
}
#: Published figures to read ours against: Kafka's, from the ZooKeeper era and KRaft.
ANCHORS = [
    "Confluent's rule of thumb (ZooKeeper era): up to 4,000 partitions per broker, 200,000 per cluster",
    "Kafka 1.1 (KAFKA-5642, batched metadata writes): controlled shutdown of a broker 6.5 min -> 3 s",
    "KRaft (KIP-500): clusters of millions of partitions; tens of thousands per broker in practice",
]
#: The issue's own measurement before any batching (SQLite, local store): N -> (open all s,
#: failover p50, p99, all s, idle CPU %, RSS MiB).
BEFORE = {10: (0.20, 5.12, 5.12, 5.12, 0.6, 51), 100: (1.16, 5.35, 5.45, 5.45, 0.4, 54),
          1000: (11.5, 12.4, 16.5, 16.6, 2.6, 82)}


# ---- a node, as a process ------------------------------------------------------------------------

def node_main(argv: list[str]) -> None:
    """One node: a StreamClient (default Config) and its NodeAgent (default ClusterConfig).
    Commands on stdin, one per line: `append` (one record to every partition open here, waits
    for all to be durable), `load PREFIX SECONDS` (appends to the partitions open here whose
    names start with PREFIX as fast as they take them; MB/s acknowledged, JSON), `ops` (metadata
    calls so far, JSON), `stop` (a clean close)."""
    p = argparse.ArgumentParser()
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--meta", required=True)
    p.add_argument("--store", required=True)
    args = p.parse_args(argv)
    from s3stream import RecordBatch, StreamClient
    from s3stream.cluster import Cluster, NodeAgent, partitions_on
    from s3stream.metadata import open_metadata
    from s3stream.metadata.wrappers import InstrumentedMetadataStore
    from s3stream.objectstore import open_object_store

    meta = InstrumentedMetadataStore(open_metadata(args.meta))
    store = open_object_store(args.store)
    client = StreamClient(args.id, os.path.join(args.dir, f"node{args.id}.wal"), store, meta)
    cluster = Cluster(meta, store)
    agent = NodeAgent(client, cluster)
    print(f"ready {client.node_epoch}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "append":
            parts = partitions_on(client)
            futures = [q.append(RecordBatch(b"x", 1)) for q in parts]
            for f in futures:
                f.result(60)
            print(f"appended {len(futures)}", flush=True)
        elif command.startswith("load "):
            _, prefix, seconds = command.split()
            busy = [q for q in partitions_on(client) if q.name.startswith(prefix)]
            print("loaded " + json.dumps(load(busy, float(seconds))), flush=True)
        elif command == "ops":
            print("ops " + json.dumps({op: h["count"] for op, h in meta.latencies().items()}), flush=True)
        elif command == "stop":
            agent.stop()
            client.close()
            cluster.close()
            print("stopped", flush=True)
            return


#: The busy partitions' appends: batches of LOAD_BATCH bytes, LOAD_WINDOW in flight per partition.
LOAD_BATCH = 64 << 10
LOAD_WINDOW = 8


def load(partitions: list, seconds: float) -> dict:
    """Append to every partition round-robin for `seconds`, at most LOAD_WINDOW unacknowledged
    per partition (the oldest is waited for before the next is sent): bytes and MB/s
    acknowledged, all waited for at the end."""
    import collections
    from s3stream import RecordBatch
    payload = os.urandom(LOAD_BATCH)
    inflight: collections.deque = collections.deque()
    acked = 0
    t0 = time.monotonic()
    limit = t0 + seconds
    while time.monotonic() < limit:
        for q in partitions:
            if len(inflight) >= LOAD_WINDOW * len(partitions):
                inflight.popleft().result(60)
                acked += LOAD_BATCH
            inflight.append(q.append(RecordBatch(payload, 16)))
    for f in inflight:
        f.result(60)
        acked += LOAD_BATCH
    elapsed = time.monotonic() - t0
    return {"partitions": len(partitions), "bytes": acked, "seconds": round(elapsed, 3),
            "mb_s": round(acked / elapsed / 1e6, 1)}


class Node:
    """A node process (python -m benchmarks.scale node ...), driven through its stdin."""

    def __init__(self, node_id: int, work: str, meta_url: str, store_url: str) -> None:
        self.node_id = node_id
        self.started = time.time()             # wall clock: what the nodes stamp `opened/` records with
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "node", "--id", str(node_id), "--dir", work,
             "--meta", meta_url, "--store", store_url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.node_epoch = int(self.ask(None, "ready "))

    def ask(self, command: str | None, answer: str, timeout: float = 600.0) -> str:
        """Send `command` (if any) and return the first line starting with `answer`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        limit = time.monotonic() + timeout
        while time.monotonic() < limit:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"node {self.node_id} exited ({self.proc.wait()}) before answering {command!r}")
            if line.startswith(answer):
                return line[len(answer):].strip()
        raise TimeoutError(f"node {self.node_id} did not answer {command!r} within {timeout} s")

    def ops(self) -> dict[str, int]:
        return json.loads(self.ask("ops", "ops "))

    def kill(self) -> float:
        """SIGKILL; returns when (wall clock)."""
        self.proc.send_signal(signal.SIGKILL)
        killed = time.time()
        self.proc.wait()
        return killed

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("stop", "stopped", timeout=120)
            except (RuntimeError, TimeoutError, BrokenPipeError):
                self.proc.kill()
            self.proc.wait()

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")


def ops_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in sorted(after.items()) if n - before.get(op, 0)}


# ---- the driver ------------------------------------------------------------------------------------

def wait_open(meta, names: list[str], node: "Node", since: float, timeout: float, poll: float = 1.0) -> dict[str, float]:
    """Seconds from `since` (wall clock) until each partition's `opened/` record names `node`
    (its id and its incarnation) at its current assignment version: the record's own time
    (`at`, stamped by the node when it wrote it; one host, one clock), found by polling every
    `poll` seconds, so that this reader, which lists every assignment and record, takes little
    of the CPU the nodes are measured with (the record's time is the measure: a poll's interval
    only delays the reading; at 0.25 s, in a failover of 10,000 partitions, these lists and
    the agents' were 0.52 s of PostgreSQL's 3.49 s of statements). TimeoutError with how many
    are missing."""
    node_id = node.node_id
    wanted = set(names)
    seen: dict[str, float] = {}
    limit = time.monotonic() + timeout
    while len(seen) < len(wanted):
        if time.monotonic() > limit:
            raise TimeoutError(f"{len(wanted) - len(seen)} of {len(wanted)} partitions not open on node {node_id} "
                               f"after {timeout} s")
        assigned = {k.split("/", 1)[1]: json.loads(v) for k, v in meta.list_kv("assignment/").items()}
        opened = meta.list_kv("opened/")
        for key, raw in opened.items():
            name = key.split("/", 1)[1]
            if name in wanted and name not in seen:
                record = json.loads(raw)
                a = assigned.get(name)
                if (a and record["node"] == node_id == a["node"] and record["version"] == a["version"]
                        and record.get("node_epoch") == node.node_epoch):
                    seen[name] = max(0.0, record["at"] - since)
        time.sleep(poll)
    return seen


def spread(seconds: dict[str, float]) -> dict[str, float]:
    values = sorted(seconds.values())
    return {"p50": round(values[len(values) // 2], 3),
            "p99": round(values[min(len(values) - 1, int(len(values) * 0.99))], 3),
            "all": round(values[-1], 3)}


def one_case(n: int, meta_kind: str, meta_url: str, work: str, args) -> dict:
    from s3stream.cluster import Cluster, ClusterConfig
    from s3stream.metadata import open_metadata
    store_url = f"file://{work}/objects"
    defaults = ClusterConfig()
    names = [f"p{i:05d}" for i in range(n)]
    row: dict = {"partitions": n, "metadata": meta_kind, "heartbeat_timeout_s": defaults.heartbeat_timeout}
    meta = open_metadata(meta_url)
    cluster = Cluster(meta, open_object_store_url(store_url))
    nodes: list[Node] = []
    try:
        a = Node(1, work, meta_url, store_url)
        nodes.append(a)
        before = a.ops()
        t0 = time.time()
        if hasattr(cluster, "assign_many"):
            cluster.assign_many({name: 1 for name in names})      # one write, as a user places many
        else:                             # a build from before assign_many (to compare with)
            for name in names:
                cluster.assign(name, 1)
        row["assign_s"] = round(time.time() - t0, 3)
        row["first_open_s"] = spread(wait_open(meta, names, a, t0, args.timeout, args.poll))["all"]
        row["first_open_ops_per_partition"] = per_partition(ops_delta(a.ops(), before), n)
        log(f"{meta_kind} N={n}: assigned in {row['assign_s']} s, all open after {row['first_open_s']} s")

        a.ask("append", "appended")
        a.kill()
        a = Node(1, work, meta_url, store_url)
        nodes.append(a)
        restarted = a.started
        row["open_after_restart_s"] = spread(wait_open(meta, names, a, restarted, args.timeout, args.poll))["all"]
        row["restart_ops_per_partition"] = per_partition(a.ops(), n)
        log(f"{meta_kind} N={n}: after a kill -9, open again after {row['open_after_restart_s']} s")
        time.sleep(1.0)
        cpu0, w0 = a.cpu_seconds(), time.monotonic()
        time.sleep(args.idle)
        row["idle_cpu_percent"] = round(100 * (a.cpu_seconds() - cpu0) / (time.monotonic() - w0), 2)
        row["rss_mib"] = round(a.rss_mib(), 1)
        log(f"{meta_kind} N={n}: idle CPU {row['idle_cpu_percent']} %, RSS {row['rss_mib']} MiB")

        b = Node(2, work, meta_url, store_url)
        nodes.append(b)
        row["rss_mib_no_partitions"] = round(b.rss_mib(), 1)
        # B judges its peers from its first judgement on, which follows its first heartbeat: a
        # judge that has just started counts a whole heartbeat_timeout of A's silence from
        # then, not from A's last heartbeat. B is given the time a peer that has been up has
        # had (the drain below waits likewise); `failover_detect_s` is when its judge decided.
        time.sleep(2 * defaults.heartbeat_interval)
        b_before = b.ops()
        a.ask("append", "appended")
        killed = a.kill()
        failover = wait_open(meta, names, b, killed, args.timeout + defaults.heartbeat_timeout, args.poll)
        row["failover_s"] = spread(failover)
        decided = [h["decided_ns"] for h in cluster.failover_history()
                   if h.get("node") == 1 and h.get("kind") == "failover" and h.get("ok")]
        if decided:
            row["failover_detect_s"] = round(decided[-1] / 1e9 - killed, 3)
        row["failover_ops_per_partition"] = per_partition(ops_delta(b.ops(), b_before), n)
        log(f"{meta_kind} N={n}: failover {row['failover_s']}, decided {row.get('failover_detect_s')} s after the "
            f"kill (target: all <= "
            f"{defaults.heartbeat_timeout + TARGETS['failover_all_over_heartbeat_timeout_s']} s)")

        drain = names[:min(args.drain, n)]
        a = Node(1, work, meta_url, store_url)
        nodes.append(a)
        time.sleep(2 * defaults.heartbeat_interval)          # A live again, seen by the cluster
        t0 = time.monotonic()
        if hasattr(cluster, "migrate_many"):
            moved = cluster.migrate_many({name: 1 for name in drain}, timeout=args.timeout)
            if moved.waiting:
                raise TimeoutError(f"drain: {len(moved.waiting)} partitions not open on node 1 after {args.timeout} s")
        else:                             # a build from before migrate_many (to compare with)
            with concurrent.futures.ThreadPoolExecutor(max_workers=defaults.max_parallel_moves) as pool:
                list(pool.map(lambda name: cluster.migrate(name, 1), drain))
        row["drain"] = len(drain)
        row["drain_s"] = round(time.monotonic() - t0, 3)
        log(f"{meta_kind} N={n}: drained {len(drain)} partitions in {row['drain_s']} s")
        if args.busy and hasattr(cluster, "migrate_many"):
            row.update(busy_among_idle(cluster, meta, work, meta_url, store_url, names, nodes, args))
            log(f"{meta_kind} N={n}: {args.busy} busy partitions alone {row['busy_alone']['mb_s']} MB/s, "
                f"among {n} idle {row['busy_among_idle']['mb_s']} MB/s: ratio {row['busy_ratio']} "
                f"(target >= {TARGETS['busy_among_idle_ratio']}); all {n} moved in {row['move_all_s']} s")
    finally:
        for node in nodes:
            node.stop()
        cluster.close()
        meta.close()
    return row


def busy_among_idle(cluster, meta, work: str, meta_url: str, store_url: str, names: list[str],
                    nodes: list["Node"], args) -> dict:
    """Step 5: node 3 with `args.busy` partitions alone, then with every idle one moved to it."""
    busy = [f"busy{i:04d}" for i in range(args.busy)]
    c = Node(3, work, meta_url, store_url)
    nodes.append(c)
    t0 = time.time()
    cluster.assign_many({name: 3 for name in busy})
    wait_open(meta, busy, c, t0, args.timeout, args.poll)
    c.ask(f"load busy {min(2.0, args.load)}", "loaded ")        # warm-up: the WAL's first pass, the caches
    alone = json.loads(c.ask(f"load busy {args.load}", "loaded "))
    t0 = time.monotonic()
    moved = cluster.migrate_many({name: 3 for name in names}, timeout=args.timeout)
    if moved.waiting:
        raise TimeoutError(f"{len(moved.waiting)} partitions not open on node 3 after {args.timeout} s")
    move_all = round(time.monotonic() - t0, 3)
    time.sleep(1.0)
    among = json.loads(c.ask(f"load busy {args.load}", "loaded "))
    return {"busy": args.busy, "busy_alone": alone, "busy_among_idle": among, "move_all_s": move_all,
            "busy_ratio": round(among["mb_s"] / alone["mb_s"], 3) if alone["mb_s"] else None}


def open_object_store_url(url: str):
    from s3stream.objectstore import open_object_store
    return open_object_store(url)


def per_partition(ops: dict[str, int], n: int) -> dict[str, float]:
    """Calls per partition, to 4 decimals: a batched call of 500 partitions is 0.002."""
    return {op: round(count / n, 4) for op, count in ops.items()}


def log(text: str) -> None:
    from benchmarks.kit import log_line
    log_line(text, sys.stderr)


@contextlib.contextmanager
def metadata_url(kind: str, work: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{work}/meta.db"
        return
    from testservers.postgres import throwaway_postgres
    with throwaway_postgres() as server:           # its own directory, which its server user can enter
        yield server.create_database("scale")


def _seconds(value: float | None) -> str:
    """A figure in seconds for the table, "-" where the run did not record it."""
    return "-" if value is None else f"{value:.2f}s"


def format_report(report: dict) -> str:
    lines = ["Many partitions per node (issue 53): nodes as processes, default ClusterConfig, local store", ""]
    head = (f"{'N':>6} {'meta':>8} {'first open':>10} {'restart':>8} {'failover p50/p99/all':>22} "
            f"{'detect':>7} {'drain':>12} {'idle CPU':>8} {'RSS':>8}")
    lines.append(head)
    for r in report["rows"]:
        f = r["failover_s"]
        lines.append(f"{r['partitions']:>6} {r['metadata']:>8} {r['first_open_s']:>9.2f}s {r['open_after_restart_s']:>7.2f}s "
                     f"{f['p50']:>6.2f}/{f['p99']:>6.2f}/{f['all']:>6.2f} s {_seconds(r.get('failover_detect_s')):>7} "
                     f"{r['drain']:>5} in {r['drain_s']:>4.1f}s "
                     f"{r['idle_cpu_percent']:>7.1f}% {r['rss_mib']:>6.0f}MiB")
    busy = [r for r in report["rows"] if "busy_ratio" in r]
    if busy:
        lines.append("")
        lines.append("busy among idle (node 3): MB/s of appends to its busy partitions, alone and among the N idle")
        for r in busy:
            lines.append(f"  N={r['partitions']} {r['metadata']}: {r['busy']} busy alone {r['busy_alone']['mb_s']} MB/s, "
                         f"among {r['partitions']} idle {r['busy_among_idle']['mb_s']} MB/s: ratio {r['busy_ratio']} "
                         f"(target >= {TARGETS['busy_among_idle_ratio']}); all {r['partitions']} moved to it in "
                         f"{r['move_all_s']} s")
    lines.append("")
    lines.append("metadata calls per partition (node A's first open; A's restart; B's failover):")
    for r in report["rows"]:
        lines.append(f"  N={r['partitions']} {r['metadata']}: open {r['first_open_ops_per_partition']}")
        lines.append(f"  N={r['partitions']} {r['metadata']}: restart {r['restart_ops_per_partition']}")
        lines.append(f"  N={r['partitions']} {r['metadata']}: failover {r['failover_ops_per_partition']}")
    lines.append("")
    lines.append("before (the issue's measurement, SQLite): N: open all, failover p50/p99/all, idle CPU, RSS")
    for n, (o, p50, p99, al, cpu, rss) in BEFORE.items():
        lines.append(f"  {n:>5}: {o:.2f} s, {p50:.2f}/{p99:.2f}/{al:.2f} s, {cpu} %, {rss} MiB")
    lines.append("targets at 10,000 partitions: open after restart < 5 s; failover all <= heartbeat_timeout + 2 s; "
                 "drain of 1,000 < 5 s; idle CPU <= 5 %; RSS <= 32 KiB per idle partition; 100 busy among 10,000 "
                 "idle >= 0.9 of their MB/s alone")
    lines.append("anchors: " + "; ".join(ANCHORS))
    return "\n".join(lines)


def plot(report: dict, out: str) -> list:
    from benchmarks.kit import pyplot, save_figure
    plt = pyplot("scale")
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind in sorted({r["metadata"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["metadata"] == kind]
        xs = [r["partitions"] for r in rows]
        ax.plot(xs, [r["open_after_restart_s"] for r in rows], marker="o", label=f"open after restart ({kind})")
        ax.plot(xs, [r["failover_s"]["all"] for r in rows], marker="s", label=f"failover, all ({kind})")
    ax.set_xscale("log")
    ax.set_xlabel("partitions on the node")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return [save_figure(plt, fig, out, "scale.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", default="100,1000", help="partitions per node, comma-separated")
    p.add_argument("--meta", default="sqlite", help="metadata stores: sqlite, postgres or both, comma-separated")
    p.add_argument("--drain", type=int, default=1000, help="partitions the drain moves (at most N)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds over which idle CPU is measured")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a phase may take at most")
    p.add_argument("--workdir", default=None, help="where nodes keep their WALs, the store and SQLite")
    p.add_argument("--out", default="reports/scale", help="report directory")
    p.add_argument("--busy", type=int, default=100, help="busy partitions of step 5 (0: no step 5)")
    p.add_argument("--load", type=float, default=5.0, help="seconds the busy partitions take appends, each time")
    p.add_argument("--poll", type=float, default=1.0,
                   help="seconds between the reads of opened/ records (their own stamps are the figures)")
    p.add_argument("--quick", action="store_true",
                   help="N=20, SQLite, a drain of 5, 2 s idle, 4 busy for 1 s, reads every 0.2 s")
    return p


def run(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    if parser.parse_args(argv).quick:                  # its figures, unless given too
        parser.set_defaults(partitions="20", meta="sqlite", drain=5, idle=2.0, busy=4, load=1.0, poll=0.2)
    args = parser.parse_args(argv)
    from benchmarks.kit import publish
    rows = []
    for kind in args.meta.split(","):
        for n in (int(x) for x in args.partitions.split(",")):
            work = tempfile.mkdtemp(prefix=f"s3stream-scale-{kind}-{n}-", dir=args.workdir)
            try:
                with metadata_url(kind, work) as url:
                    rows.append(one_case(n, kind, url, work, args))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    report = {"rows": rows, "targets": TARGETS, "anchors": ANCHORS,
              "before": {str(n): v for n, v in BEFORE.items()}}
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_main(sys.argv[2:])
    else:
        run(sys.argv[1:])
