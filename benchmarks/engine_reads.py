"""The read half of the engine benchmark (benchmarks/engine.py): catch-up reads from objects on the
local store and on S3 through a moto server, each against a raw read of the same objects, and
tail reads from the log cache.

Catch-up: a fresh node (cold block cache) reads every stream of a data set from its start with
fetch(max_bytes=1 MiB), stream after stream, as a consumer catching up would; the raw read reads
every object of the data set whole, once, in one sequential pass: on the local store 1 MiB reads
of the files with the page cache evicted before each pass, on S3 one boto3 GetObject per object.

Two layouts of the same 1 GiB into 10 streams: as uploaded with the default config, where each
stream's part of a 64 MiB block is under split_size, so all of it lands in StreamSetObjects that
every stream reads a slice of; and with split_size 4 MiB, where each stream's part is its own
StreamObject (what compaction's force split makes of catch-up data). On moto a ranged GET costs
about as much as reading the whole object (measured: 1 MiB of a 64 MiB object 53 ms, all of it
159 ms), so reading 10 slices of each StreamSetObject is bound by moto, not by the engine; the
target is judged on the StreamObject layout there, and both figures are reported.
"""
from __future__ import annotations

import os
import time

from s3stream import Config, StreamClient
from s3stream.metadata import ObjectState, SqliteMetadataStore

MiB = 1024 ** 2
FETCH_BYTES = 1 * MiB


def object_paths(workdir: str, store_dir: str) -> tuple[list[str], list[str]]:
    """(keys, local paths) of the data set's committed objects."""
    meta = SqliteMetadataStore(os.path.join(workdir, "meta.db"))
    try:
        keys = [o.key for o in meta.list_objects(state=ObjectState.COMMITTED)]
    finally:
        meta.close()
    return keys, [os.path.join(store_dir, k) for k in keys]


def evict(paths: list[str]) -> None:
    """Drop the files from the page cache (clean pages; no root needed) so reads are cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(client: StreamClient) -> tuple[int, float]:
    """Read every stream from its start, stream after stream: (bytes, seconds)."""
    ids = [m.stream_id for m in client.list_streams()]
    got = 0
    t0 = time.perf_counter()
    for sid in ids:
        s = client.open_stream(sid)
        pos = s.start_offset
        while pos < s.confirm_offset:
            res = s.fetch(pos, max_bytes=FETCH_BYTES)
            got += res.total_bytes
            pos = res.end_offset
    return got, time.perf_counter() - t0


def _result(got: int, seconds: float, raw: int, raw_seconds: float, stats: dict, **extra) -> dict:
    return dict(bytes=got, mb_s=got / seconds / 1e6, raw_bytes=raw, raw_mb_s=raw / raw_seconds / 1e6,
                ratio=(got / seconds) / (raw / raw_seconds), reader=stats, **extra)


def catchup_local(workdir: str, store_dir: str, config: Config, node_id: int = 2) -> dict:
    """Catch-up from the local store vs a raw read of the object files, both cold."""
    _, paths = object_paths(workdir, store_dir)
    evict(paths)
    t0 = time.perf_counter()
    raw = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(MiB):
                raw += len(chunk)
    raw_s = time.perf_counter() - t0
    evict(paths)
    client = StreamClient(node_id, os.path.join(workdir, f"node{node_id}.wal"), f"file://{store_dir}",
                          f"sqlite:///{workdir}/meta.db", config)
    try:
        got, read_s = read_all(client)
        stats = client.stats()["read"]
    finally:
        client.close()
    return _result(got, read_s, raw, raw_s, stats, objects=len(paths), store="local disk, page cache evicted")


def catchup_s3(workdir: str, store_dir: str, config: Config, endpoint: str, bucket: str, node_id: int = 3) -> dict:
    """Copy the data set's objects to `bucket` on the S3 endpoint (same keys), then catch up from
    there vs one raw boto3 GetObject per object."""
    import boto3
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=bucket)
    keys, paths = object_paths(workdir, store_dir)
    for key, path in zip(keys, paths):
        with open(path, "rb") as f:
            s3.put_object(Bucket=bucket, Key=f"data/{key}", Body=f.read())
    t0 = time.perf_counter()
    raw = sum(len(s3.get_object(Bucket=bucket, Key=f"data/{key}")["Body"].read()) for key in keys)
    raw_s = time.perf_counter() - t0
    client = StreamClient(node_id, os.path.join(workdir, f"node{node_id}.wal"),
                          f"s3://{bucket}/data?endpoint_url={endpoint}", f"sqlite:///{workdir}/meta.db", config)
    try:
        got, read_s = read_all(client)
        stats = client.stats()["read"]
    finally:
        client.close()
    for key in keys:
        s3.delete_object(Bucket=bucket, Key=f"data/{key}")
    return _result(got, read_s, raw, raw_s, stats, objects=len(keys), store=f"S3 through moto ({endpoint})")


def tail_read(client: StreamClient, streams, rounds: int = 3) -> dict:
    """Fetch the newest record of every stream written to (the client is still open), as a
    consumer at the tail does; `from_cache` is the share of fetches the log cache answered
    (the rest went to objects: the cache holds the newest cache_size bytes of all streams)."""
    before = client.stats()["read"]
    t0 = time.perf_counter()
    got = records = fetches = 0
    for _ in range(rounds):
        for s in streams:
            if s.confirm_offset == s.start_offset:
                continue                        # nothing written to this one
            res = s.fetch(s.confirm_offset - 1, max_bytes=MiB)
            got += res.total_bytes
            records += sum(b.count for b in res.batches)
            fetches += 1
    el = time.perf_counter() - t0
    after = client.stats()["read"]
    from_objects = after["object_reads"] - before["object_reads"]
    return dict(bytes=got, records=records, fetches=fetches, mb_s=got / el / 1e6, records_s=records / el,
                fetches_s=fetches / el, object_gets=from_objects,
                from_cache=(after["cache_reads"] - before["cache_reads"]) / max(1, fetches))


def tail_read_sizes(workdir: str, store_dir: str, config: Config, sizes=(128, 1024, 65536),
                    streams: int = 4, per_stream: int = 16 * MiB, rounds: int = 200) -> list[dict]:
    """Records of each size appended to `streams` streams (still in the log cache), then fetched
    back 1 MiB at a time from the newest MiB of each stream, `rounds` times over."""
    from s3stream import RecordBatch
    out = []
    client = StreamClient(7, os.path.join(workdir, "tail.wal"), f"file://{store_dir}",
                          f"sqlite:///{workdir}/tail-meta.db", config)
    try:
        for size in sizes:
            handles = [client.create_stream() for _ in range(streams)]
            batch = RecordBatch(os.urandom(size), 1)
            for s in handles:
                futures = s.append_many([batch] * (per_stream // size))
                futures[-1].result()
            newest = MiB // size
            before = client.stats()["read"]
            t0 = time.perf_counter()
            got = records = 0
            for _ in range(rounds):
                for s in handles:
                    res = s.fetch(s.confirm_offset - newest, max_bytes=MiB)
                    got += res.total_bytes
                    records += len(res.batches)
            el = time.perf_counter() - t0
            after = client.stats()["read"]
            out.append(dict(size=size, mb_s=got / el / 1e6, records_s=records / el, fetches=rounds * streams,
                            from_cache=(after["cache_reads"] - before["cache_reads"]) / (rounds * streams)))
            client.close_streams(handles)
    finally:
        client.close()
    return out


def format_catchup(name: str, c: dict, target: float | None) -> str:
    verdict = "" if target is None else f" (target >= {target}: {'MET' if c['ratio'] >= target else 'MISSED'})"
    r = c["reader"]
    return (f"  catch-up, {name}: {c['bytes'] / MiB:,.0f} MiB at {c['mb_s']:.0f} MB/s; raw read of the same "
            f"{c['objects']} objects {c['raw_mb_s']:.0f} MB/s  ->  ratio {c['ratio']:.2f}{verdict}\n"
            f"      GETs {r['object_reads']} ({r['whole_object_reads']} whole objects), read-ahead "
            f"{r['readahead_bytes'] / MiB:,.0f} MiB of which unused {r['readahead_wasted_bytes'] / MiB:,.0f} MiB, "
            f"reader waited for {r['block_waits']} blocks and fetched {r['block_fetches']} itself, "
            f"metadata queries {r['metadata_lookups']}")
