"""Metadata store wrappers: InstrumentedMetadataStore times every operation of the store it wraps.
It keeps the MetadataStore contract of what it wraps (every call is delegated unchanged)."""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, ParamSpec, Sequence, TypeVar

from ..latency import LatencyHistogram
from .base import (ChangeFeed, CommitRequest, CommitResult, MetadataStore, NodeMeta, ObjectMeta, ObjectRef,
                   ObjectState, ObjectType, StreamMeta)

_P = ParamSpec("_P")
_T = TypeVar("_T")

#: The operations timed: every state change and lookup of the MetadataStore contract. The
#: method name is the operation's name in latencies() and in the metrics' `operation` label.
TIMED_OPERATIONS = (
    "register_node", "get_node", "list_nodes", "heartbeat", "fence_node",
    "create_stream", "create_streams", "open_stream", "open_streams", "reserve_offsets", "abandon_stream",
    "close_stream", "trim_stream",
    "delete_stream", "get_stream",
    "get_streams", "list_streams",
    "prepare_objects", "commit", "get_object", "list_objects", "get_object_refs", "get_object_refs_at",
    "node_stream_set_objects",
    "mark_destroyed", "objects_to_delete", "remove_objects",
    "get_kv", "get_kvs", "get_kv_and_node", "put_kv", "put_kvs", "put_kv_if_absent", "replace_kv", "replace_kvs", "delete_kv",
    "list_kv",
)


class InstrumentedMetadataStore(MetadataStore):
    """Delegates to `inner`, observing each call's seconds (successful or not) in a
    LatencyHistogram per operation and counting the calls that raised. A histogram is created
    at an operation's first call, so `latencies()` lists only the operations used. Attributes
    outside the contract (a store's `path`, say) are read from `inner`."""

    def __init__(self, inner: MetadataStore) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._latency: dict[str, LatencyHistogram] = {}
        self._errors: dict[str, int] = {}

    def _timed(self, operation: str, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`call(*args, **kwargs)`, its seconds observed under `operation`."""
        t0 = time.perf_counter()
        failed = True
        try:
            result = call(*args, **kwargs)
            failed = False
            return result
        finally:
            self._observe(operation, time.perf_counter() - t0, failed)

    def _observe(self, operation: str, seconds: float, failed: bool) -> None:
        hist = self._latency.get(operation)
        if hist is None:
            with self._lock:
                hist = self._latency.setdefault(operation, LatencyHistogram())
        hist.observe(seconds)
        if failed:
            with self._lock:
                self._errors[operation] = self._errors.get(operation, 0) + 1

    def latencies(self) -> dict[str, dict]:
        """Per operation called so far: a LatencyHistogram snapshot of its calls' seconds."""
        with self._lock:
            hists = dict(self._latency)
        return {op: h.snapshot() for op, h in sorted(hists.items())}

    def errors(self) -> dict[str, int]:
        """Per operation: calls that raised (a fenced commit, a missing stream, a timeout...)."""
        with self._lock:
            return dict(self._errors)

    # ---- the timed operations (TIMED_OPERATIONS), in the contract's order ------------------------

    def register_node(self, node_id: int, wal_path: str) -> NodeMeta:
        return self._timed("register_node", self.inner.register_node, node_id, wal_path)

    def get_node(self, node_id: int) -> NodeMeta:
        return self._timed("get_node", self.inner.get_node, node_id)

    def list_nodes(self) -> list[NodeMeta]:
        return self._timed("list_nodes", self.inner.list_nodes)

    def heartbeat(self, node_id: int, node_epoch: int, health: str | None = None) -> None:
        return self._timed("heartbeat", self.inner.heartbeat, node_id, node_epoch, health)

    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        return self._timed("fence_node", self.inner.fence_node, node_id, failover, if_unchanged)

    def create_stream(self, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self._timed("create_stream", self.inner.create_stream, node_id, node_epoch, reserve)

    def create_streams(self, count: int, node_id: int, node_epoch: int, reserve: int = 0) -> list[StreamMeta]:
        return self._timed("create_streams", self.inner.create_streams, count, node_id, node_epoch, reserve)

    def open_stream(self, stream_id: int, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self._timed("open_stream", self.inner.open_stream, stream_id, node_id, node_epoch, reserve)

    def reserve_offsets(self, stream_id: int, epoch: int, node_id: int, node_epoch: int,
                        reserved_end: int) -> StreamMeta:
        return self._timed("reserve_offsets", self.inner.reserve_offsets, stream_id, epoch, node_id, node_epoch,
                           reserved_end)

    def abandon_stream(self, stream_id: int, epoch: int, node_id: int) -> StreamMeta:
        return self._timed("abandon_stream", self.inner.abandon_stream, stream_id, epoch, node_id)

    def open_streams(self, stream_ids: Sequence[int], node_id: int, node_epoch: int,
                     reserve: int = 0) -> list[StreamMeta]:
        return self._timed("open_streams", self.inner.open_streams, stream_ids, node_id, node_epoch, reserve)

    def close_stream(self, stream_id: int, epoch: int, node_id: int, node_epoch: int | None = None) -> StreamMeta:
        return self._timed("close_stream", self.inner.close_stream, stream_id, epoch, node_id, node_epoch)

    def trim_stream(self, stream_id: int, epoch: int, new_start_offset: int) -> StreamMeta:
        return self._timed("trim_stream", self.inner.trim_stream, stream_id, epoch, new_start_offset)

    def delete_stream(self, stream_id: int, epoch: int) -> StreamMeta:
        return self._timed("delete_stream", self.inner.delete_stream, stream_id, epoch)

    def get_stream(self, stream_id: int) -> StreamMeta:
        return self._timed("get_stream", self.inner.get_stream, stream_id)

    def get_streams(self, stream_ids: Iterable[int]) -> dict[int, StreamMeta]:
        return self._timed("get_streams", self.inner.get_streams, stream_ids)

    def list_streams(self, include_deleted: bool = False, owner_node_id: int | None = None,
                     last_range: bool = False) -> list[StreamMeta]:
        return self._timed("list_streams", self.inner.list_streams, include_deleted, owner_node_id, last_range)

    def prepare_objects(self, count: int, ttl_ns: int) -> list[int]:
        return self._timed("prepare_objects", self.inner.prepare_objects, count, ttl_ns)

    def commit(self, request: CommitRequest) -> CommitResult:
        return self._timed("commit", self.inner.commit, request)

    def get_object(self, object_id: int) -> ObjectMeta:
        return self._timed("get_object", self.inner.get_object, object_id)

    def list_objects(self, state: ObjectState | None = None, type: ObjectType | None = None,
                     node_id: int | None = None) -> list[ObjectMeta]:
        return self._timed("list_objects", self.inner.list_objects, state, type, node_id)

    def get_object_refs_at(self, points: Sequence[tuple[int, int]]) -> dict[tuple[int, int], ObjectRef]:
        return self._timed("get_object_refs_at", self.inner.get_object_refs_at, points)

    def get_object_refs(self, stream_id: int, start_offset: int, end_offset: int,
                        limit: int = 64) -> list[ObjectRef]:
        return self._timed("get_object_refs", self.inner.get_object_refs, stream_id, start_offset, end_offset, limit)

    def node_stream_set_objects(self, node_id: int) -> list[ObjectMeta]:
        return self._timed("node_stream_set_objects", self.inner.node_stream_set_objects, node_id)

    def mark_destroyed(self, object_ids: Sequence[int]) -> None:
        return self._timed("mark_destroyed", self.inner.mark_destroyed, object_ids)

    def objects_to_delete(self, destroy_delay_ns: int, limit: int | None = None) -> list[ObjectMeta]:
        return self._timed("objects_to_delete", self.inner.objects_to_delete, destroy_delay_ns, limit)

    def remove_objects(self, object_ids: Sequence[int], unused_prepared: bool = False) -> list[int]:
        return self._timed("remove_objects", self.inner.remove_objects, object_ids, unused_prepared)

    def get_kv(self, key: str) -> bytes | None:
        return self._timed("get_kv", self.inner.get_kv, key)

    def get_kv_and_node(self, key: str, node_id: int) -> tuple[bytes | None, NodeMeta]:
        return self._timed("get_kv_and_node", self.inner.get_kv_and_node, key, node_id)

    def put_kv(self, key: str, value: bytes) -> None:
        return self._timed("put_kv", self.inner.put_kv, key, value)

    def get_kvs(self, keys: Sequence[str]) -> dict[str, bytes]:
        return self._timed("get_kvs", self.inner.get_kvs, keys)

    def put_kvs(self, items: Sequence[tuple[str, bytes]]) -> None:
        return self._timed("put_kvs", self.inner.put_kvs, items)

    def replace_kvs(self, items: Sequence[tuple[str, bytes | None, bytes]]) -> list[bool]:
        return self._timed("replace_kvs", self.inner.replace_kvs, items)

    def put_kv_if_absent(self, key: str, value: bytes) -> bytes:
        return self._timed("put_kv_if_absent", self.inner.put_kv_if_absent, key, value)

    def replace_kv(self, key: str, expected: bytes | None, value: bytes,
                   guard: tuple[str, bytes] | None = None) -> bool:
        return self._timed("replace_kv", self.inner.replace_kv, key, expected, value, guard)

    def delete_kv(self, key: str) -> None:
        return self._timed("delete_kv", self.inner.delete_kv, key)

    def list_kv(self, prefix: str) -> dict[str, bytes]:
        return self._timed("list_kv", self.inner.list_kv, prefix)

    # ---- not timed -------------------------------------------------------------------------------

    def _get_streams(self, stream_ids: list[int]) -> list:
        return list(self.inner.get_streams(stream_ids).values())

    def kv_changes(self, prefixes: Sequence[str]) -> ChangeFeed:
        """The wrapped store's feed (PostgreSQL pushes; the base feed polls)."""
        return self.inner.kv_changes(prefixes)

    def close(self) -> None:
        """Close the wrapped store."""
        self.inner.close()

    def __getattr__(self, name: str):
        # Only reached for attributes not defined here: the wrapped store's own (path, url...).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<InstrumentedMetadataStore of {self.inner!r}>"


__all__ = ["InstrumentedMetadataStore", "TIMED_OPERATIONS"]
