"""Appends per second of s3stream.aio against the sync API, and the cost of a fetch on the
executor against one served inline from the log cache. One stream, 100-byte batches, a local
object store and SQLite; a standalone script (not collected by pytest):

    python tests/bench/aio_throughput.py [--seconds 3] [--inflight 256]

Variants: the sync `append().result()` loop; the sync pipeline (append, keep `inflight`
pending); `await stream.append()` in a loop; `append_nowait` keeping `inflight` pending, with
s3stream.aio's wake-up per burst and with one `call_soon_threadsafe` per append; and the
AppendFuture's own `__await__` (a concurrent Future wrapped per append) for comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import wal  # noqa: E402
from s3stream import Config, RecordBatch, aio  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BATCH = RecordBatch(b"x" * 100)


def config() -> Config:
    return Config(upload_threshold=4 * MiB, split_size=1 * MiB, max_batch_bytes=64 * KiB, cache_size=32 * MiB,
                  reclaim_interval=None, wal=wal.WALConfig(capacity=128 * MiB, full_timeout=10.0))


class _SettlerPerAppend(aio._Settler):
    """One call_soon_threadsafe per settled append (the unbatched design)."""

    def _settled(self, future, handle):
        self._ready.append((future, handle))
        self._loop.call_soon_threadsafe(self._drain)


def rate(run, seconds: float) -> float:
    t0 = time.perf_counter()
    n = run(t0 + seconds)
    return n / (time.perf_counter() - t0)


def sync_loop(stream, deadline):
    n = 0
    while time.perf_counter() < deadline:
        stream.append(BATCH).result(30)
        n += 1
    return n


def sync_pipelined(stream, deadline, inflight):
    pending = collections.deque()
    n = 0
    while time.perf_counter() < deadline:
        pending.append(stream.append(BATCH))
        if len(pending) >= inflight:
            pending.popleft().result(30)
        n += 1
    for f in pending:
        f.result(30)
    return n


async def await_loop(stream, deadline):
    n = 0
    while time.perf_counter() < deadline:
        await stream.append(BATCH)
        n += 1
    return n


async def pipelined(stream, deadline, inflight, submit):
    pending = collections.deque()
    n = 0
    while time.perf_counter() < deadline:
        pending.append(submit(BATCH))
        if len(pending) >= inflight:
            await pending.popleft()
        n += 1
    for f in pending:
        await f
    return n


async def arate(coro_fn, seconds: float) -> float:
    t0 = time.perf_counter()
    n = await coro_fn(t0 + seconds)
    return n / (time.perf_counter() - t0)


async def main(args) -> None:
    tmp = tempfile.mkdtemp(prefix="aio-bench-")
    async with aio.AsyncStreamClient(1, f"{tmp}/node.wal", f"file://{tmp}/objects", f"sqlite:///{tmp}/meta.db",
                                     config()) as client:
        stream = await client.create_stream()
        await stream.append(BATCH)                 # the WAL's writer session starts outside the figures
        s, k, secs = stream.sync, args.inflight, args.seconds
        rows = []
        for _ in range(args.rounds):
            rows.append(("sync append().result() loop", rate(lambda d: sync_loop(s, d), secs)))
            rows.append((f"sync append, {k} pending", rate(lambda d: sync_pipelined(s, d, k), secs)))
            rows.append(("await stream.append() loop", await arate(lambda d: await_loop(stream, d), secs)))
            rows.append((f"append_nowait, {k} pending (wake-up per burst)",
                         await arate(lambda d: pipelined(stream, d, k, stream.append_nowait), secs)))
            batched = client._settler
            client._settler = _SettlerPerAppend(batched._loop)
            rows.append((f"append_nowait, {k} pending (call_soon_threadsafe per append)",
                         await arate(lambda d: pipelined(stream, d, k, stream.append_nowait), secs)))
            client._settler = batched
            rows.append((f"AppendFuture.__await__ (wrap_future), {k} pending",
                         await arate(lambda d: pipelined(stream, d, k, lambda b: asyncio.ensure_future(
                             s.append(b))), secs)))
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for name, r in rows:
            by_name[name].append(r)
        for name, rs in by_name.items():
            print(f"{name:<62} {' '.join(f'{r:>9,.0f}' for r in rs)} appends/s")

        # fetch of the last 100 records: inline from the log cache vs the same read on the executor
        end = stream.confirm_offset
        start = end - 100
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < t0 + 1:
            await stream.fetch(start, max_bytes=64 * KiB)
            n += 1
        inline = n / (time.perf_counter() - t0)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < t0 + 1:
            await client._run(s.fetch, start, None, 64 * KiB)
            n += 1
        pool = n / (time.perf_counter() - t0)
        print(f"{'fetch of 100 cached records, inline':<62} {inline:>9,.0f} fetches/s")
        print(f"{'fetch of 100 cached records, on the executor':<62} {pool:>9,.0f} fetches/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--inflight", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
