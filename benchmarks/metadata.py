"""Metadata benchmark: operations per second of each MetadataStore, with few and with many streams.

    python -m benchmarks.metadata [--meta URL ...] [--streams 10,100000] [--quick] [--out DIR]

The operations a cluster makes, each timed on its own for `--seconds` (median and p99 latency,
operations per second): a node's start (register_node), a heartbeat, creating a stream, a
partition move (open_stream on another node, then close_stream), an upload's commit (prepare one
object id, commit a StreamSetObject holding 4 streams), a read's lookup (get_object_refs), a trim,
a node's own open streams (list_streams(owner_node_id=...)) and the reclaimer's bounded scan
(objects_to_delete). Each store is measured in a fresh database holding first `streams[0]` other
streams, then `streams[1]`, ...: the figures should not depend on how many there are (issue 11:
metadata that scales with the cluster, not with its history). The other streams are created by
other nodes with one committed StreamSetObject per 100 of them, so their ranges and objects are
in the tables the operations search.

Then contended writes: WRITERS processes each write a KV key of its own in a loop (2 ms apart) for
`--seconds` x 4, and the latency of every write is reported (p50, p99, max): what a write on a
move's path (an assignment, a close's record) costs while other nodes write too.

Default stores: SQLite in a temporary directory, and PostgreSQL when `--meta postgresql://...` is
given or `--start-postgres` starts a throwaway server (testservers.postgres). Report: JSON and a PNG.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from typing import Callable

from benchmarks.kit import log_line, percentiles, progress, publish, pyplot, save_figure

from s3stream.metadata import CommitRange, CommitRequest, CommitSSO, CommitStreamObject, MetadataStore, open_metadata

WRITERS = 4                  # processes writing at once in the contended measurement
HOT = 8                      # streams the timed operations work on (owned by node 1)
POPULATE_NODES = 4           # nodes that own the other streams
SSO_STREAMS = 100            # other streams per committed StreamSetObject while populating
TTL_NS = 3600 * 10 ** 9


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.metadata {time.strftime('%H:%M:%S')}] {msg}")


def populate(meta: MetadataStore, count: int, already: int) -> None:
    """Grow the database from `already` to `count` other streams, owned by nodes 2.., each group
    of SSO_STREAMS with one committed StreamSetObject of 1 KiB per stream."""
    epochs = {n: meta.register_node(n, f"/bench/node{n}.wal").node_epoch for n in range(2, 2 + POPULATE_NODES)}
    made, last = already, time.monotonic()
    bar = progress(total=count - already, desc="populating", unit="stream")
    while made < count:
        node = 2 + (made // SSO_STREAMS) % POPULATE_NODES
        group = [meta.create_stream(node, epochs[node]) for _ in range(min(SSO_STREAMS, count - made))]
        (oid,) = meta.prepare_objects(1, TTL_NS)
        meta.commit(CommitRequest(node, epochs[node], sso=CommitSSO(oid, 1024 * len(group), tuple(
            CommitRange(s.stream_id, s.epoch, 0, 1024) for s in group))))
        made += len(group)
        bar.update(len(group))
        if time.monotonic() - last > 5:
            _progress(f"  {made:,} of {count:,} streams")
            last = time.monotonic()
    bar.close()


class Hot:
    """The streams node 1 works on, and the state the timed operations carry between calls."""

    def __init__(self, meta: MetadataStore) -> None:
        self.meta = meta
        self.node = meta.register_node(1, "/bench/node1.wal")
        self.mover = meta.register_node(POPULATE_NODES + 2, "/bench/mover.wal")
        self.streams = {s.stream_id: s for s in (meta.create_stream(1, self.node.node_epoch) for _ in range(HOT))}
        self.ids = itertools.cycle(sorted(self.streams))
        self.moved = sorted(self.streams)[0]
        self.meta.close_stream(self.moved, self.streams[self.moved].epoch, 1)
        # The trimmed stream holds 10^9 offsets in one StreamObject: each trim raises the start by 1.
        self.trimmed = sorted(self.streams)[-1]
        (oid,) = meta.prepare_objects(1, TTL_NS)
        s = self.streams[self.trimmed]
        meta.commit(CommitRequest(1, self.node.node_epoch, stream_objects=(
            CommitStreamObject(oid, 1 << 20, CommitRange(s.stream_id, s.epoch, 0, 10 ** 9)),)))
        self.trim_to = 0

    def commit(self) -> None:
        (oid,) = self.meta.prepare_objects(1, TTL_NS)
        ranges = []
        for sid in sorted(self.streams)[1:5]:     # not the moved one, not the trimmed one
            s = self.streams[sid]
            ranges.append(CommitRange(sid, s.epoch, s.end_offset, s.end_offset + 100))
        result = self.meta.commit(CommitRequest(1, self.node.node_epoch, sso=CommitSSO(oid, 400, tuple(ranges))))
        for sid, end in result.end_offsets.items():
            s = self.streams[sid]
            self.streams[sid] = type(s)(s.stream_id, s.epoch, s.state, s.owner_node_id, s.start_offset, end, s.ranges)

    def move(self) -> None:
        m = self.meta.open_stream(self.moved, self.mover.node_id, self.mover.node_epoch)
        self.meta.close_stream(self.moved, m.epoch, self.mover.node_id)

    def refs(self) -> None:
        sid = sorted(self.streams)[1]
        end = self.streams[sid].end_offset
        self.meta.get_object_refs(sid, max(0, end - 1000), end, limit=16)

    def trim(self) -> None:
        self.trim_to += 1
        self.meta.trim_stream(self.trimmed, self.streams[self.trimmed].epoch, self.trim_to)


def operations(hot: Hot) -> dict[str, Callable[[], object]]:
    meta = hot.meta
    return {
        "node start (register_node)": lambda: meta.register_node(POPULATE_NODES + 3, "/bench/restarts.wal"),
        "heartbeat": lambda: meta.heartbeat(1, hot.node.node_epoch),
        "create stream": lambda: meta.create_stream(POPULATE_NODES + 3, meta.get_node(POPULATE_NODES + 3).node_epoch),
        "move (open + close)": hot.move,
        "commit (prepare + SSO of 4 streams)": hot.commit,
        "get_object_refs": hot.refs,
        "trim": hot.trim,
        "a node's open streams": lambda: meta.list_streams(owner_node_id=1),
        "objects_to_delete (bounded)": lambda: meta.objects_to_delete(0, limit=100),
    }


def time_op(fn: Callable[[], object], seconds: float) -> dict:
    lat: list[int] = []
    fn()                                    # warm: caches, prepared statements
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter_ns()
        fn()
        lat.append(time.perf_counter_ns() - t0)
    p = percentiles(lat)
    return dict(ops=len(lat), ops_s=len(lat) / (sum(lat) / 1e9), p50_ms=p["p50_ms"], p99_ms=p["p99_ms"])


def _contended_writer(url: str, seconds: float, start: float, results) -> None:
    meta = open_metadata(url)
    lat: list[int] = []
    try:
        time.sleep(max(0.0, start - time.time()))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter_ns()
            meta.put_kv(f"bench/contended/{os.getpid()}", b"x" * 100)
            lat.append(time.perf_counter_ns() - t0)
            time.sleep(0.002)
    finally:
        meta.close()
    results.put(lat)


def contended_writes(url: str, seconds: float) -> dict:
    """WRITERS processes (spawned: nothing inherited) writing at once: each write's latency."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = time.time() + 3.0           # every writer connected and imported by then
    procs = [ctx.Process(target=_contended_writer, args=(url, seconds, start, results)) for _ in range(WRITERS)]
    for proc in procs:
        proc.start()
    lat = [x for _ in procs for x in results.get(timeout=seconds + 120)]
    for proc in procs:
        proc.join()
    p = percentiles(lat)
    return dict(writers=WRITERS, writes=len(lat), p50_ms=p["p50_ms"], p99_ms=p["p99_ms"], max_ms=p["max_ms"])


def bench_store(name: str, url: str, sizes: list[int], seconds: float) -> dict:
    meta = open_metadata(url)
    out: dict = dict(store=name, sizes={})
    try:
        hot = Hot(meta)
        ops = operations(hot)
        have = 0
        for size in sizes:
            _progress(f"{name}: populating {size:,} streams")
            t0 = time.monotonic()
            populate(meta, size, have)
            have = size
            _progress(f"{name}: {size:,} streams ({time.monotonic() - t0:.0f} s to populate); timing each "
                      f"operation for {seconds:g} s")
            for fn in ops.values():         # untimed: the database's files and caches settle first
                time_op(fn, min(0.5, seconds / 2))
            # advanced between operations, never while one is timed
            with progress(total=len(ops), desc=f"{name}, {size:,} streams", unit="op") as bar:
                timed = {}
                for op, fn in ops.items():
                    timed[op] = time_op(fn, seconds)
                    bar.update()
            out["sizes"][size] = timed
        _progress(f"{name}: {WRITERS} processes writing at once for {4 * seconds:g} s")
        out["contended"] = contended_writes(url, 4 * seconds)
    finally:
        meta.close()
    return out


def format_report(report: dict) -> str:
    lines = ["=" * 100, "s3stream metadata benchmark: operations per second (p50 / p99 ms), by streams in the store"]
    for r in report["stores"]:
        sizes = list(r["sizes"])
        lines.append(f"\n{r['store']}")
        head = f"  {'operation':<38}" + "".join(f"{f'{int(s):,} streams':>26}" for s in sizes)
        if len(sizes) > 1:
            head += f"{'last / first':>14}"
        lines.append(head)
        for op in r["sizes"][sizes[0]]:
            cells = [r["sizes"][s][op] for s in sizes]
            row = f"  {op:<38}" + "".join(f"{c['ops_s']:>10,.0f}/s ({c['p50_ms']:.2f}/{c['p99_ms']:.2f})" .rjust(26)
                                           for c in cells)
            if len(sizes) > 1:
                row += f"{cells[-1]['ops_s'] / cells[0]['ops_s']:>14.2f}"
            lines.append(row)
        c = r.get("contended")
        if c:
            lines.append(f"  contended: {c['writers']} processes writing a key each, 2 ms apart: {c['writes']:,} writes, "
                         f"p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.1f} ms")
    lines.append("=" * 100)
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.metadata")
    if plt is None:
        return []
    stores = report["stores"]
    fig, axes = plt.subplots(1, len(stores), figsize=(7 * len(stores), 5), squeeze=False)
    for ax, r in zip(axes[0], stores):
        sizes = list(r["sizes"])
        ops = list(r["sizes"][sizes[0]])
        width = 0.8 / len(sizes)
        for i, s in enumerate(sizes):
            ax.barh([j + i * width for j in range(len(ops))], [r["sizes"][s][op]["ops_s"] for op in ops], width,
                    label=f"{int(s):,} streams")
        ax.set_yticks([j + 0.4 - width / 2 for j in range(len(ops))], ops, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("operations / s")
        ax.set_title(r["store"])
        ax.legend()
    return [save_figure(plt, fig, out, "metadata.png")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.metadata", description=__doc__.split("\n\n")[0])
    ap.add_argument("--meta", action="append", default=[], help="a metadata URL to measure (repeatable; each "
                    "must name an empty database). Default: SQLite in a temporary directory")
    ap.add_argument("--start-postgres", action="store_true", help="also measure PostgreSQL on a throwaway local "
                    "server (needs the postgresql binaries: initdb, pg_ctl)")
    ap.add_argument("--streams", default=None, help="stream counts, ascending (default 10,100000; --quick 10,2000)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per operation (default 2; --quick 0.3)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join("reports", "metadata-bench"))
    return ap


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in (args.streams or ("10,2000" if args.quick else "10,100000")).split(",")]
    if sizes != sorted(sizes):
        raise SystemExit(f"--streams must be ascending, got {args.streams}")
    seconds = args.seconds or (0.3 if args.quick else 2.0)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="s3stream-metabench-")
    stores = [(url.split(":", 1)[0], url) for url in args.meta] or [("sqlite", f"sqlite:///{tmp}/meta.db")]
    report: dict = dict(streams=sizes, seconds=seconds, stores=[])
    try:
        for name, url in stores:
            report["stores"].append(bench_store(name, url, sizes, seconds))
        if args.start_postgres:
            from testservers.postgres import throwaway_postgres
            with throwaway_postgres() as server:
                report["stores"].append(bench_store("postgresql", server.create_database("metabench"), sizes,
                                                    seconds))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    run()
