"""s3stream.aio: the asyncio face (issue 14). Completion on the caller's loop, pipelining,
cancellation (nothing acknowledged lost, nothing wedged), errors, async with."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from s3stream import OffsetOutOfRangeError, RecordBatch, StreamClient, StreamClosedError, StreamNotFoundError
from s3stream.aio import AsyncStreamClient
from s3stream.objectstore import open_object_store
from conftest import KiB, small_config
from s3stream.cluster.aio import open_partition

pytestmark = pytest.mark.asyncio


def make_client(tmp_path, metadata_url=None, store=None, node_id=1, **kw) -> AsyncStreamClient:
    return AsyncStreamClient(node_id, tmp_path / f"node{node_id}.wal", store or f"file://{tmp_path}/objects",
                             metadata_url or f"sqlite:///{tmp_path}/meta.db", small_config(), **kw)


async def read_all(stream, max_bytes=16 * KiB) -> dict[int, bytes]:
    """base offset -> payload of every batch from the start offset to the confirm offset."""
    out = {}
    pos = stream.start_offset
    while pos < stream.confirm_offset:
        res = await stream.fetch(pos, max_bytes=max_bytes)
        out.update((b.base_offset, bytes(b.payload)) for b in res.batches)
        pos = res.end_offset
    return out


def assert_quiet(client: AsyncStreamClient) -> None:
    """Nothing left pending on the loop: no other task, no settled append waiting for a wake-up."""
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert client._settler.idle


class GatedStore:
    """An object store whose gets (or puts) wait while their gate is closed: a fetch or close
    blocked on the object store, on demand."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.url = inner.url
        self.part_size = getattr(inner, "part_size", None)
        self.gets = threading.Event()
        self.puts = threading.Event()
        self.gets.set()
        self.puts.set()
        self.blocked = threading.Event()     # set once an operation waits at a gate

    def _pass(self, gate: threading.Event) -> None:
        if not gate.is_set():
            self.blocked.set()
            assert gate.wait(30), "a gate stayed closed for 30 s"

    def put(self, key, data):
        self._pass(self.puts)
        return self.inner.put(key, data)

    def get(self, key, start=0, end=None):
        self._pass(self.gets)
        return self.inner.get(key, start, end)

    def size(self, key):
        return self.inner.size(key)

    def delete(self, keys):
        return self.inner.delete(keys)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def close(self):
        self.inner.close()


async def wait_for(event: threading.Event, seconds: float = 10) -> None:
    for _ in range(int(seconds / 0.01)):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the store was never reached")


async def test_append_fetch_round_trip(tmp_path):
    async with make_client(tmp_path) as client:
        stream = await client.create_stream()
        payloads = [bytes([i]) * (i + 1) for i in range(50)]
        results = [await stream.append(RecordBatch(p, count=2)) for p in payloads]
        assert [r.base_offset for r in results] == list(range(0, 100, 2))
        res = await stream.fetch(0)                          # the tail: inline from the log cache
        assert [bytes(b.payload) for b in res.batches] == payloads
        assert stream.sync.fetch_cached(10, 20).batches == (await stream.fetch(10, 20)).batches
        sid = stream.stream_id
        await stream.close()
        reopened = await client.open_stream(sid)
        assert await read_all(reopened) == {2 * i: p for i, p in enumerate(payloads)}
        assert (await reopened.append(RecordBatch(b"next"))).base_offset == 100
        await reopened.close()
        assert_quiet(client)


async def test_pipelined_appends_complete_in_order_on_the_loop_thread(tmp_path):
    loop_thread = threading.get_ident()
    async with make_client(tmp_path) as client:
        stream = await client.create_stream()
        order, threads = [], set()

        def done(future):
            threads.add(threading.get_ident())
            order.append(future.result().base_offset)

        futures = []
        for i in range(1000):
            future = stream.append_nowait(RecordBatch(b"%d" % i))
            future.add_done_callback(done)
            futures.append(future)
        results = await asyncio.gather(*futures)
        assert [r.base_offset for r in results] == list(range(1000))
        await asyncio.sleep(0)                               # done callbacks run one step later
        assert order == list(range(1000))
        assert threads == {loop_thread}
        got = await read_all(stream)
        assert got == {i: b"%d" % i for i in range(1000)}
        await stream.close()
        assert_quiet(client)


async def test_cancelled_appends_lose_nothing_acknowledged(tmp_path, metadata_url):
    rng = random.Random(14)
    client = make_client(tmp_path, metadata_url)
    await client.start()
    stream = await client.create_stream()
    sid = stream.stream_id
    acknowledged: dict[int, bytes] = {}
    cancelled = 0
    for round_ in range(4):
        payloads = [rng.randbytes(rng.choice([10, 300, 3000])) for _ in range(150)]
        tasks = [asyncio.create_task(stream.append(RecordBatch(p))) for p in payloads]
        # Cancel a third of them at random moments: before they ran, while waiting, or too late.
        victims = rng.sample(tasks, len(tasks) // 3)
        for i, task in enumerate(victims):
            if i % 5 == 0:
                await asyncio.sleep(0)
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for payload, outcome in zip(payloads, outcomes):
            if isinstance(outcome, asyncio.CancelledError):
                cancelled += 1
            else:
                acknowledged[outcome.base_offset] = payload
        # The stream still takes appends and serves reads after the cancellations.
        tail = await stream.append(RecordBatch(b"round %d" % round_))
        acknowledged[tail.base_offset] = b"round %d" % round_
    assert cancelled > 0 and len(acknowledged) > 4
    assert stream.next_offset > len(acknowledged)            # some were cancelled after their append
    got = await read_all(stream)
    assert {o: got[o] for o in acknowledged} == acknowledged
    await stream.close()
    await client.close()
    assert_quiet(client)

    again = make_client(tmp_path, metadata_url)              # the same node, restarted
    async with again:
        reopened = await again.open_stream(sid)
        got = await read_all(reopened)
        assert {o: got.get(o) for o in acknowledged} == acknowledged
        end = reopened.confirm_offset
        assert (await reopened.append(RecordBatch(b"after"))).base_offset == end
        await reopened.close()
        assert_quiet(again)


async def test_cancelled_fetch_finishes_in_the_background(tmp_path, metadata_url):
    async with make_client(tmp_path, metadata_url) as client:
        stream = await client.create_stream()
        expected = {(await stream.append(RecordBatch(b"%d" % i * 100))).base_offset: b"%d" % i * 100
                    for i in range(200)}
        sid = stream.stream_id
        await stream.close()

    store = GatedStore(open_object_store(f"file://{tmp_path}/objects"))
    async with make_client(tmp_path, metadata_url, store=store, executor_threads=1) as client:
        stream = await client.open_stream(sid)
        store.gets.clear()
        blocked = asyncio.create_task(stream.fetch(0))
        await wait_for(store.blocked)                        # its GET waits on the executor's only thread
        queued = asyncio.create_task(stream.fetch(0))        # waits for that thread
        await asyncio.sleep(0.05)
        blocked.cancel()
        queued.cancel()
        for task in (blocked, queued):
            with pytest.raises(asyncio.CancelledError):
                await task
        store.gets.set()
        assert await read_all(stream) == expected            # nothing wedged: the executor moves on
        await stream.close()
        assert_quiet(client)
    store.close()


async def test_cancelled_close_completes_in_the_background(tmp_path, metadata_url):
    store = GatedStore(open_object_store(f"file://{tmp_path}/objects"))
    async with make_client(tmp_path, metadata_url, store=store) as client:
        stream = await client.create_stream()
        expected = {(await stream.append(RecordBatch(b"%d" % i))).base_offset: b"%d" % i for i in range(100)}
        store.puts.clear()
        closing = asyncio.create_task(stream.close())
        await wait_for(store.blocked)                        # the close's upload waits
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        store.puts.set()
        await stream.close()                                 # awaits the same close, now done
        assert not stream.is_open
        with pytest.raises(StreamClosedError):
            await stream.append(RecordBatch(b"late"))
        reopened = await client.open_stream(stream.stream_id)
        assert await read_all(reopened) == expected
        await reopened.close()
        assert_quiet(client)
    store.close()


async def test_errors_are_the_sync_apis(tmp_path):
    async with make_client(tmp_path) as client:
        with pytest.raises(StreamNotFoundError):
            await client.open_stream(12345)
        stream = await client.create_stream()
        await stream.append(RecordBatch(b"x"))
        with pytest.raises(OffsetOutOfRangeError):
            await stream.fetch(5)
        assert [b.base_offset for b in (await stream.fetch(0, 100)).batches] == [0]    # capped, as Stream.fetch
        await stream.close()
        with pytest.raises(StreamClosedError):
            stream.append_nowait(RecordBatch(b"y"))          # refused at once
        with pytest.raises(StreamClosedError):
            await stream.append(RecordBatch(b"y"))
        with pytest.raises(StreamClosedError):
            await stream.fetch(0)
        with pytest.raises(StreamClosedError):
            await stream.trim(1)
        assert_quiet(client)
    # A closed client: every call raises why, at once.
    with pytest.raises(StreamClosedError):
        await client.create_stream()


async def test_async_with_closes_streams_and_client(tmp_path):
    async with make_client(tmp_path) as client:
        async with await client.create_stream() as stream:
            await stream.append(RecordBatch(b"a", count=3))
            await stream.trim(2)
            assert stream.start_offset == 2
        assert not stream.is_open
        async with await open_partition(client, "orders") as partition:
            assert (await partition.append(RecordBatch(b"p"))).base_offset == 0
            assert [bytes(b.payload) for b in (await partition.fetch(0)).batches] == [b"p"]
        assert not partition.is_open
    assert client._closing.done()
    assert await client.close() == await client.close()     # once; later calls await the first
    assert_quiet(client)


async def test_wrapped_client_needs_no_start(tmp_path):
    # wrap() takes a running StreamClient: its calls bind the loop themselves (they used to
    # reach an unbound loop: AttributeError).
    sync_client = StreamClient(1, tmp_path / "node1.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                               small_config())
    client = AsyncStreamClient.wrap(sync_client, executor_threads=2)
    stream = await client.create_stream()
    assert (await stream.append(RecordBatch(b"a"))).base_offset == 0
    await stream.close()
    await client.close()
    assert_quiet(client)


async def test_wrap_and_appends_from_another_loop(tmp_path):
    sync_client = StreamClient(1, tmp_path / "node1.wal", f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db",
                               small_config())
    client = AsyncStreamClient.wrap(sync_client, executor_threads=2)
    async with client:
        stream = await client.create_stream()
        assert (await stream.append(RecordBatch(b"a"))).base_offset == 0

        def elsewhere():
            async def append():
                return stream.append_nowait(RecordBatch(b"b"))
            return asyncio.run(append())
        with pytest.raises(RuntimeError, match="event loop"):
            await asyncio.to_thread(elsewhere)
        await stream.close()
    with pytest.raises(StreamClosedError):
        sync_client.create_stream()


async def test_append_records_on_streams_and_partitions(tmp_path):
    from s3stream import Record
    async with make_client(tmp_path) as client:
        stream = await client.create_stream()
        r = await stream.append_records([Record(b"a", b"1"), Record(b"b", b"2")], compression="lz4")
        assert r.base_offset == 0 and stream.sync.next_offset == 2
        res = await stream.fetch(0)
        assert [(x.offset, x.key) for b in res.batches for x in b.records()] == [(0, b"a"), (1, b"b")]
        async with await open_partition(client, "orders") as partition:
            r = await partition.append_records([Record(b"id", b"{}")])
            res = await partition.fetch(r.base_offset)
            assert [x.key for b in res.batches for x in b.records()] == [b"id"]
            producer = await client.new_producer()
            first = await partition.append_records([Record(b"k", b"v")], producer=producer)
            batch = producer.batch("orders", [Record(b"k2", b"v2")])
            assert (await partition.append(batch)).base_offset == first.base_offset + 1
            assert (await partition.append(batch)).base_offset == first.base_offset + 1   # a retry
            assert partition.sync.log.next_offset == first.base_offset + 2
        await stream.close()


async def test_an_async_partition_append_waits_for_a_move_without_blocking_the_loop(tmp_path):
    """A move on the node holds AsyncPartition.append (s3stream.cluster.hold) while the loop runs
    on; append_nowait is not held."""
    from s3stream.cluster.hold import AppendHold
    from s3stream.cluster import partition_table
    from s3stream.cluster.runtime import THREADS
    async with make_client(tmp_path) as client:
        async with await open_partition(client, "orders") as partition:
            hold = partition_table(client.client).hold = AppendHold(THREADS, 30.0, 1.0)
            move = hold.moving()
            move.__enter__()
            try:
                held = asyncio.ensure_future(partition.append(RecordBatch(b"held")))
                ticks = 0
                for _ in range(20):                   # the loop keeps running meanwhile
                    await asyncio.sleep(0.01)
                    ticks += 1
                assert ticks == 20 and not held.done()
                first = await partition.append_nowait(RecordBatch(b"first"))
            finally:
                move.__exit__(None, None, None)
            assert (await held).base_offset == first.base_offset + 1
            assert hold.stats["appends_held"] == 1 and hold.stats["append_hold_seconds"] >= 0.2
