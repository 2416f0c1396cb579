"""Reader benchmark (issue 29): a reader that is not a node (s3stream.open_reader) against a node,
and how soon a tailing reader in another process sees a commit.

    python3 -m s3stream bench --kind reader [--quick] [-- --data 512M --rounds 5 --commits 300]

Everything is measured in one run, each figure beside the issue's target:
- Catch-up, on SQLite metadata and again on PostgreSQL (see below): a node (StreamClient: WAL in
  a temporary directory, local object store) appends --data bytes of Kafka record batches (--batch-records records of --value-size
  bytes each, one batch encoded once and appended again and again) to one stream, uploads and
  closes it. Then, --rounds times, a fresh node (another node id: cold log cache, cold block
  cache; it opens the stream, as a consumer on a node would) reads the stream from its start with
  Stream.fetch, and a fresh open_reader reads it with fetch_committed, both max_bytes=--fetch-bytes,
  taking turns (node first in even rounds, reader first in odd ones) so that drift hits them
  alike. The object files are evicted from the page cache before every read (--warm keeps them),
  and setting up either side (registering the node, opening the stream) is not timed. Each
  side's bytes, records and offsets are checked against what was written. Target: the median
  of the rounds' reader/node ratios >= 0.9.
- Visibility: for SQLite (its host feed pushes commits between processes) and PostgreSQL
  (LISTEN/NOTIFY), a node appends one record and force-uploads it (one commit) --commit-rate times
  a second, --commits times, while a reader in another process tails the stream
  (StreamReader.tail, default poll_interval 0.1 s). Both processes read the same wall clock
  (time.time_ns): the latency of a commit is when the tail yielded its record minus when
  force_upload returned (it can be slightly negative: the commit is readable before the call
  returns). Also shown: from the force_upload call. Target: p99 <= 100 ms.
PostgreSQL is a throwaway server on 127.0.0.1 unless --pg-url names a database; --no-postgres
measures on SQLite only.

Report: report.json and reader.png in --out (default reports/reader-bench).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import wal
from benchmarks.kit import fmt_size, log_line, parse_size, percentiles, progress, publish, pyplot, save_figure

from benchmarks.engine_reads import evict
from s3stream.client import StreamClient
from s3stream.config import Config, MiB
from s3stream.metadata import ObjectMeta, ObjectState, open_metadata
from s3stream.reader import open_reader
from s3stream.batches import RecordBatch
from s3stream.records import Record, encode_batch

#: The issue's targets: a reader catches up at least 0.9 as fast as a node; a commit is visible
#: to a tailing reader within 100 ms.
TARGET_CATCHUP_RATIO = 0.9
TARGET_VISIBILITY_MS = 100.0
#: Seconds the tailing child may take to start and see the first commit.
CHILD_START_TIMEOUT = 60.0
#: The nodes' WALs: trimmed after each upload, so they never hold much; at least twice the
#: default upload threshold (a block uploads while the next fills).
WAL_CAPACITY = 160 * MiB
#: Appends pending at a time while writing the data set.
INFLIGHT = 64


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.reader {time.strftime('%H:%M:%S')}] {msg}")


# ---- catch-up ----------------------------------------------------------------------------------

def make_batch(records: int, value_size: int) -> bytes:
    """One Kafka record batch of `records` records with `value_size`-byte values (and 8-byte keys)."""
    return encode_batch([Record(b"k%07d" % i, bytes([65 + i % 26]) * value_size, 1_700_000_000_000 + i)
                         for i in range(records)])


def write_data_set(work: str, meta_url: str, data_bytes: int, batch: bytes, batch_records: int) -> dict:
    """A node appends `data_bytes` of `batch` to one stream (objects in `work`/objects), uploads
    and closes it: the stream and what it holds."""
    config = Config(reclaim_interval=None, wal=wal.WALConfig(capacity=WAL_CAPACITY))
    client = StreamClient(1, os.path.join(work, "writer.wal"), f"file://{work}/objects", meta_url, config)
    batches = max(1, data_bytes // len(batch))
    try:
        stream = client.create_stream()
        payload = RecordBatch(batch, batch_records)
        pending: list = []
        bar = progress(total=batches * len(batch), desc="write", unit="B", unit_scale=True)
        t0 = time.perf_counter()
        for i in range(batches):
            pending.append(stream.append(payload))
            if len(pending) >= INFLIGHT:
                for fut in pending:
                    fut.result(60)
                bar.update(len(pending) * len(batch))
                pending.clear()
        for fut in pending:
            fut.result(60)
        bar.update(len(pending) * len(batch))
        stream.close()
        client.force_upload(120)
        seconds = time.perf_counter() - t0
        bar.close()
        stream_id = stream.stream_id
    finally:
        client.close()
    return dict(meta_url=meta_url, stream_id=stream_id, batches=batches, records=batches * batch_records,
                bytes=batches * len(batch), write_seconds=seconds)


def object_list(meta_url: str) -> list[ObjectMeta]:
    """The committed objects of the data set."""
    meta = open_metadata(meta_url)
    try:
        return meta.list_objects(state=ObjectState.COMMITTED)
    finally:
        meta.close()


def _read_loop(fetch, expected: dict) -> dict:
    """Read the stream from 0 to its end with `fetch(pos)` (a FetchResult): bytes, records,
    seconds; raises AssertionError if a batch is missing, repeated or out of order."""
    got = records = pos = 0
    t0 = time.perf_counter()
    end = expected["records"]
    while pos < end:
        result = fetch(pos)
        for b in result.batches:
            if b.base_offset != pos:
                raise AssertionError(f"read batch at {b.base_offset}, expected {pos}")
            pos += b.count
            records += b.count
            got += len(b.payload)
    seconds = time.perf_counter() - t0
    if got != expected["bytes"] or records != expected["records"]:
        raise AssertionError(f"read {got} bytes / {records} records, wrote {expected['bytes']} / "
                             f"{expected['records']}")
    return dict(bytes=got, records=records, seconds=seconds, mb_s=got / seconds / 1e6)


def read_as_node(work: str, node_id: int, expected: dict, fetch_bytes: int) -> dict:
    """A fresh node opens the stream and reads it whole with Stream.fetch (setup not timed)."""
    config = Config(reclaim_interval=None, wal=wal.WALConfig(capacity=WAL_CAPACITY))
    wal_path = os.path.join(work, f"node{node_id}.wal")
    client = StreamClient(node_id, wal_path, f"file://{work}/objects", expected["meta_url"], config)
    try:
        stream = client.open_stream(expected["stream_id"])
        out = _read_loop(lambda pos: stream.fetch(pos, max_bytes=fetch_bytes), expected)
        out["stats"] = client.stats()["read"]
    finally:
        client.close()
        with contextlib.suppress(OSError):
            os.unlink(wal_path)
    return out


def read_as_reader(work: str, expected: dict, fetch_bytes: int) -> dict:
    """A fresh open_reader reads the stream whole with fetch_committed (setup not timed)."""
    with open_reader(expected["meta_url"], f"file://{work}/objects") as reader:
        sid = expected["stream_id"]
        out = _read_loop(lambda pos: reader.fetch_committed(sid, pos, max_bytes=fetch_bytes), expected)
        out["stats"] = reader.stats
    return out


def bench_catchup(name: str, meta_url: str, work: str, data_bytes: int, batch_records: int, value_size: int,
                  rounds: int, fetch_bytes: int, warm: bool) -> dict:
    """Node against reader on one data set whose metadata is at `meta_url` (module docstring)."""
    work = os.path.join(work, f"catchup-{name}")
    os.makedirs(work)
    batch = make_batch(batch_records, value_size)
    _progress(f"catch-up, {name} metadata: writing {fmt_size(data_bytes)} of {batch_records} x {value_size} B "
              f"record batches ({len(batch):,} B each) through a node")
    written = write_data_set(work, meta_url, data_bytes, batch, batch_records)
    paths = [os.path.join(work, "objects", o.key) for o in object_list(meta_url)]
    _progress(f"catch-up, {name} metadata: {len(paths)} objects; {rounds} round(s) of node and reader reads, "
              "alternating")
    out_rounds = []
    bar = progress(total=rounds, desc=f"catch-up {name}", unit="round")
    for round_ in range(rounds):
        order = ("node", "reader") if round_ % 2 == 0 else ("reader", "node")
        row: dict = dict(round=round_, order=list(order))
        for side in order:
            if not warm:
                evict(paths)
            if side == "node":
                row["node"] = read_as_node(work, 2 + round_, written, fetch_bytes)
            else:
                row["reader"] = read_as_reader(work, written, fetch_bytes)
        row["ratio"] = row["reader"]["mb_s"] / row["node"]["mb_s"]
        out_rounds.append(row)
        bar.update()
        bar.set_postfix_str(f"reader/node {row['ratio']:.2f}")
    bar.close()
    ratio = statistics.median(r["ratio"] for r in out_rounds)
    written.pop("meta_url")
    return dict(written, metadata=name, batch_records=batch_records, value_size=value_size, batch_bytes=len(batch),
                objects=len(paths), fetch_bytes=fetch_bytes, page_cache="warm" if warm else "evicted before each read",
                rounds=out_rounds, ratio=ratio,
                node_mb_s=statistics.median(r["node"]["mb_s"] for r in out_rounds),
                reader_mb_s=statistics.median(r["reader"]["mb_s"] for r in out_rounds),
                target_ratio=TARGET_CATCHUP_RATIO, met=ratio >= TARGET_CATCHUP_RATIO)


# ---- visibility ----------------------------------------------------------------------------------

#: The tailing reader, in a process of its own: prints "ready <pushes>" once it has seen the first
#: record (sequence 0), then one JSON line at the end: [[sequence, wall ns seen], ...].
TAIL_CHILD = """
import json, sys, time
from s3stream import open_reader
from s3stream.metadata import commit_key
meta, store, sid, last, idle = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
seen = []
with open_reader(meta, store) as reader:
    feed = reader.metadata.kv_changes((commit_key(sid),))
    pushes = feed.pushes
    feed.close()
    for batch in reader.tail(sid, 0, idle_timeout=idle):
        now = time.time_ns()
        for record in batch.records():
            seq = int(record.value.split(b" ", 1)[0])
            seen.append((seq, now))
            if seq == 0:
                print("ready", int(pushes), flush=True)
        if seen and seen[-1][0] >= last:
            break
print(json.dumps(seen), flush=True)
"""


def child_lines(pipe) -> "queue.Queue[str | None]":
    """The child's stdout lines on a queue (None at its end), read by a daemon thread so that the
    parent's waits for them are bounded."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in pipe:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, name="tail-child-stdout", daemon=True).start()
    return lines


def bench_visibility(name: str, meta_url: str, work: str, commits: int, rate: float) -> dict:
    """A node commits one record `rate` times a second, `commits` times; a reader process tails."""
    store_url = f"file://{work}/objects-{name}"
    config = Config(reclaim_interval=None, wal=wal.WALConfig(capacity=WAL_CAPACITY))
    client = StreamClient(1, os.path.join(work, f"visibility-{name}.wal"), store_url, meta_url, config)
    child = None
    try:
        stream = client.create_stream()

        def commit(seq: int) -> tuple[int, int]:
            stream.append_records([Record(value=b"%d %d" % (seq, time.time_ns()))]).result(30)
            start = time.time_ns()
            client.force_upload(30)
            return start, time.time_ns()

        commit(0)
        child = subprocess.Popen([sys.executable, "-c", TAIL_CHILD, meta_url, store_url, str(stream.stream_id),
                                  str(commits), "30"], stdout=subprocess.PIPE, text=True)
        lines = child_lines(child.stdout)
        try:
            first = lines.get(timeout=CHILD_START_TIMEOUT)
        except queue.Empty:
            first = None
        if first is None or not first.startswith("ready "):
            raise RuntimeError(f"the tailing reader did not start within {CHILD_START_TIMEOUT:g} s "
                               f"(said {first!r}, exit code {child.poll()})")
        pushes = first.split()[1] == "1"
        times: dict[int, tuple[int, int]] = {}
        interval = 1.0 / rate
        next_at = time.monotonic()
        for seq in progress(range(1, commits + 1), desc=f"visibility {name}", unit="commit"):
            next_at += interval
            times[seq] = commit(seq)
            time.sleep(max(0.0, next_at - time.monotonic()))
        try:
            final = lines.get(timeout=60)
        except queue.Empty:
            final = None
        child.wait(30)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        client.close()
    seen = [tuple(x) for x in json.loads(final)] if final else []
    seen = [(seq, ns) for seq, ns in seen if seq >= 1]
    seqs = [seq for seq, _ in seen]
    from_return = [ns - times[seq][1] for seq, ns in seen if seq in times]
    from_call = [ns - times[seq][0] for seq, ns in seen if seq in times]
    commit_ms = [(end - start) / 1e6 for start, end in times.values()]
    lat = percentiles(from_return)
    return dict(metadata=name, pushes=pushes, commits=commits, rate=rate, seen=len(set(seqs)),
                lost=commits - len(set(seqs)), in_order=seqs == sorted(seqs) and len(seqs) == len(set(seqs)),
                from_commit_return=lat, from_commit_call=percentiles(from_call),
                force_upload_ms=dict(p50=statistics.median(commit_ms) if commit_ms else None),
                samples_ms=[x / 1e6 for x in from_return],
                target_ms=TARGET_VISIBILITY_MS,
                met=lat["p99_ms"] is not None and lat["p99_ms"] <= TARGET_VISIBILITY_MS and seqs != [])


@contextlib.contextmanager
def postgres_database(args) -> Iterator[tuple[str | None, str]]:
    """(URL, note): --pg-url, a database on a throwaway server on 127.0.0.1, or (None, why not)."""
    if args.no_postgres:
        yield None, "skipped (--no-postgres)"
        return
    if args.pg_url:
        yield args.pg_url, "the database of --pg-url"
        return
    from testservers.postgres import MissingBinaries, throwaway_postgres
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(throwaway_postgres())
        except MissingBinaries as e:
            yield None, f"skipped: {e}"
            return
        yield server.create_database("reader_bench"), "a throwaway server on 127.0.0.1"


# ---- report --------------------------------------------------------------------------------------

def format_report(report: dict) -> str:
    lines = ["=" * 110]
    for c in report["catchup"]:
        if "skipped" in c:
            lines.append(f"Catch-up, {c['metadata']} metadata: {c['skipped']}")
            continue
        lines.append(f"Catch-up, {c['metadata']} metadata: {c['bytes'] / MiB:,.1f} MiB in {c['objects']} objects, "
                     f"{c['batches']:,} batches of {c['batch_records']} x {c['value_size']} B records; fetch max_bytes "
                     f"{fmt_size(c['fetch_bytes'])}; page cache {c['page_cache']}")
        for r in c["rounds"]:
            lines.append(f"  round {r['round']} ({' then '.join(r['order'])}): node {r['node']['mb_s']:7.1f} MB/s, "
                         f"reader {r['reader']['mb_s']:7.1f} MB/s, reader/node {r['ratio']:.3f}")
        lines.append(f"  medians: node {c['node_mb_s']:.1f} MB/s, reader {c['reader_mb_s']:.1f} MB/s; reader/node "
                     f"{c['ratio']:.3f}   target >= {c['target_ratio']}: {'met' if c['met'] else 'MISSED'}")
    lines.append("Visibility, commit (force_upload returned) -> seen by a tailing reader in another process:")
    for v in report["visibility"]:
        if "skipped" in v:
            lines.append(f"  {v['metadata']:<11} {v['skipped']}")
            continue
        a, b = v["from_commit_return"], v["from_commit_call"]
        lines.append(f"  {v['metadata']:<11} p50 {a['p50_ms']:6.1f} ms, p99 {a['p99_ms']:6.1f} ms, max "
                     f"{a['max_ms']:6.1f} ms (from the call: p50 {b['p50_ms']:.1f}, p99 {b['p99_ms']:.1f}); "
                     f"{v['seen']}/{v['commits']} seen at {v['rate']:g}/s, lost {v['lost']}, "
                     f"{'pushed' if v['pushes'] else 'polled'}   target p99 <= {v['target_ms']:g} ms: "
                     f"{'met' if v['met'] else 'MISSED'}")
    lines.append("=" * 110)
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.reader")
    if plt is None:
        return []
    cases = [c for c in report["catchup"] if "skipped" not in c]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    labels, node, reader = [], [], []
    for c in cases:
        for r in c["rounds"]:
            labels.append(f"{c['metadata'][:6]} {r['round']}\n{r['ratio']:.2f}")
            node.append(r["node"]["mb_s"])
            reader.append(r["reader"]["mb_s"])
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], node, 0.4, label="node (Stream.fetch)")
    ax1.bar([i + 0.2 for i in x], reader, 0.4, label="open_reader (fetch_committed)")
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_xlabel("metadata, round / reader:node")
    ax1.set_ylabel("MB/s")
    medians = ", ".join(f"{c['metadata']} {c['ratio']:.2f}" for c in cases)
    ax1.set_title(f"Catch-up of {cases[0]['bytes'] / MiB:,.0f} MiB: median ratios {medians} "
                  f"(target >= {TARGET_CATCHUP_RATIO})" if cases else "Catch-up", fontsize=10)
    ax1.legend(fontsize=8, loc="lower right")
    for v in report["visibility"]:
        if "skipped" in v or not v["samples_ms"]:
            continue
        data = sorted(v["samples_ms"])
        ax2.plot(data, [(i + 1) / len(data) for i in range(len(data))],
                 label=f"{v['metadata']}: p50 {v['from_commit_return']['p50_ms']:.1f}, "
                       f"p99 {v['from_commit_return']['p99_ms']:.1f} ms")
    ax2.axvline(TARGET_VISIBILITY_MS, color="red", linestyle="--", label=f"target {TARGET_VISIBILITY_MS:g} ms")
    ax2.set_xscale("symlog", linthresh=1.0)
    ax2.set_xlabel("ms from commit to the tail in another process")
    ax2.set_ylabel("fraction of commits")
    ax2.set_title("Visibility to a tailing reader", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    return [save_figure(plt, fig, out, "reader.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind reader", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=parse_size, default=None, help="bytes the node writes for the catch-up "
                   "(default 512M; --quick 16M)")
    p.add_argument("--batch-records", type=int, default=16, help="records a batch")
    p.add_argument("--value-size", type=int, default=1024, help="bytes a record's value")
    p.add_argument("--rounds", type=int, default=None, help="catch-up rounds, node and reader each "
                   "(default 5; --quick 2)")
    p.add_argument("--fetch-bytes", type=parse_size, default=1 * MiB, help="max_bytes of a fetch")
    p.add_argument("--warm", action="store_true", help="leave the objects in the page cache between reads")
    p.add_argument("--commits", type=int, default=None, help="commits per metadata store (default 300; "
                   "--quick 10)")
    p.add_argument("--commit-rate", type=float, default=None, help="commits a second (default 20; --quick 50)")
    p.add_argument("--pg-url", default=None, help="a PostgreSQL database for the visibility part (default: a "
                   "throwaway server on 127.0.0.1)")
    p.add_argument("--no-postgres", action="store_true", help="measure visibility on SQLite only")
    p.add_argument("--workdir", default=None, help="where WALs, objects and metadata go (default: a temporary "
                   "directory)")
    p.add_argument("--out", default=os.path.join("reports", "reader-bench"), help="report directory")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    return p


def run(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    data_bytes = args.data or (16 if args.quick else 512) * MiB
    rounds = args.rounds or (2 if args.quick else 5)
    commits = args.commits or (10 if args.quick else 300)
    rate = args.commit_rate or (50.0 if args.quick else 20.0)
    for name, value in (("--batch-records", args.batch_records), ("--value-size", args.value_size),
                        ("--rounds", rounds), ("--commits", commits), ("--fetch-bytes", args.fetch_bytes)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if not rate > 0:
        parser.error(f"--commit-rate must be positive, got {rate}")
    work = tempfile.mkdtemp(prefix="s3stream-readerbench-", dir=args.workdir)
    catchup: list[dict] = []
    visibility: list[dict] = []
    try:
        with postgres_database(args) as (pg_url, note):
            if pg_url is not None:
                _progress(f"PostgreSQL: {note}")
            for name, url in (("sqlite", f"sqlite:///{work}/catchup.db"), ("postgresql", pg_url)):
                if url is None:
                    catchup.append(dict(metadata=name, skipped=note))
                    continue
                catchup.append(bench_catchup(name, url, work, data_bytes, args.batch_records, args.value_size,
                                             rounds, args.fetch_bytes, args.warm))
            _progress(f"visibility: {commits} commits at {rate:g}/s, a reader tailing in another process")
            for name, url in (("sqlite", f"sqlite:///{work}/visibility.db"), ("postgresql", pg_url)):
                if url is None:
                    visibility.append(dict(metadata=name, skipped=note))
                    continue
                visibility.append(bench_visibility(name, url, work, commits, rate))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    measured = [x for x in catchup + visibility if "skipped" not in x]
    report = dict(kind="reader", catchup=catchup, visibility=visibility,
                  targets=dict(reader_over_node=TARGET_CATCHUP_RATIO, visibility_p99_ms=TARGET_VISIBILITY_MS),
                  met=all(x["met"] for x in measured))
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    run()
