"""Partitions for asyncio code: AsyncPartition over an s3stream.aio.AsyncStreamClient.

    async with AsyncStreamClient(1, wal, store, meta) as client:
        async with await open_partition(client, "orders") as partition:
            await partition.append_records([Record(value=b"...")])

Appends complete on the loop as AsyncStream's do (s3stream.aio). A move on the node (its agent
closing or opening a partition, s3stream.cluster.hold) holds `AsyncPartition.append` without
blocking the loop (it sleeps on it until the move ends, at most ClusterConfig.move_hold);
`append_nowait` is not held.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from ..aio import AsyncStreamClient
from ..batches import AppendResult, FetchResult, RecordBatch, records_batch
from ..records import Record
from ..records.producers import Producer
from .partition import CloseReport, Partition, open_partition as open_sync

__all__ = ["AsyncPartition", "open_partition"]

#: How often an AsyncPartition.append held by a move on its node looks whether it may go on.
HOLD_POLL_S = 0.002


async def open_partition(client: AsyncStreamClient, name: str) -> "AsyncPartition":
    """Create the named partition or open it on the client's node (cluster.open_partition), on
    the client's executor."""
    return AsyncPartition(client, await client.run(lambda: open_sync(client.client, name)))


class AsyncPartition:
    """A Partition (see s3stream.cluster.partition) for asyncio code; `sync` is the Partition."""

    def __init__(self, client: AsyncStreamClient, partition: Partition) -> None:
        self._client = client
        self.sync = partition
        self._closing: asyncio.Future | None = None

    name = property(lambda self: self.sync.name)
    is_open = property(lambda self: self.sync.is_open)

    def append_nowait(self, batch: RecordBatch) -> "asyncio.Future[AppendResult]":
        """As AsyncStream.append_nowait; PartitionMovedError at once if it moved away. It does
        not wait for a move on this node (`append` does: s3stream.cluster.hold)."""
        return self._client.watch_append(lambda: self.sync.append(batch, wait_for_moves=False))

    async def append(self, batch: RecordBatch) -> AppendResult:
        """append_nowait, awaited, after waiting (without blocking the loop) for a move that
        holds this node's appends (Partition.append)."""
        await self._wait_for_moves()
        return await self.append_nowait(batch)

    async def _wait_for_moves(self) -> None:
        hold = self.sync.hold
        if hold is None or hold.remaining() <= 0:
            return
        started = time.monotonic()
        while (left := hold.remaining()) > 0:
            await asyncio.sleep(min(left, HOLD_POLL_S))
        hold.count_wait(time.monotonic() - started)

    async def append_records(self, records: Iterable[Record], *, compression: str | None = None,
                             producer: Producer | None = None) -> AppendResult:
        """Partition.append_records (with a `producer`: idempotent), awaited."""
        batch = records_batch(records, compression) if producer is None else producer.batch(self.name, records, compression)
        return await self.append(batch)

    async def fetch(self, start_offset: int, end_offset: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        """Partition.fetch on the executor (it meters every fetch)."""
        return await self._client.run(self.sync.fetch, start_offset, end_offset, max_bytes)

    async def close(self) -> CloseReport:
        """Partition.close on the executor, to its end even if this await is cancelled."""
        if self._closing is None:
            self._closing = self._client.run_to_end(self.sync.close)
        return await asyncio.shield(self._closing)

    async def __aenter__(self) -> "AsyncPartition":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._closing is not None or self.sync.is_open:
            await self.close()

