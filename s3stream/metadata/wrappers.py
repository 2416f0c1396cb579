"""Metadata store wrappers: InstrumentedMetadataStore times every operation of the store it wraps.
It keeps the MetadataStore contract of what it wraps (every call is delegated unchanged)."""
from __future__ import annotations

import abc
import functools
import threading
import time
from typing import Sequence

from ..latency import LatencyHistogram
from .base import ChangeFeed, MetadataStore

#: The operations timed: every state change and lookup of the MetadataStore contract. The
#: method name is the operation's name in latencies() and in the metrics' `operation` label.
TIMED_OPERATIONS = (
    "register_node", "get_node", "list_nodes", "heartbeat", "fence_node",
    "create_stream", "open_stream", "close_stream", "trim_stream", "delete_stream", "get_stream",
    "get_streams", "list_streams",
    "prepare_objects", "commit", "get_object", "list_objects", "get_object_refs", "node_stream_set_objects",
    "mark_destroyed", "objects_to_delete", "remove_objects",
    "get_kv", "put_kv", "put_kv_if_absent", "replace_kv", "delete_kv", "list_kv",
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


def _timed(operation: str):
    method = getattr(MetadataStore, operation)

    @functools.wraps(method)
    def call(self: InstrumentedMetadataStore, *args, **kwargs):
        t0 = time.perf_counter()
        failed = True
        try:
            result = getattr(self.inner, operation)(*args, **kwargs)
            failed = False
            return result
        finally:
            self._observe(operation, time.perf_counter() - t0, failed)
    call.__isabstractmethod__ = False
    return call


for _operation in TIMED_OPERATIONS:
    setattr(InstrumentedMetadataStore, _operation, _timed(_operation))
abc.update_abstractmethods(InstrumentedMetadataStore)
del _operation

__all__ = ["InstrumentedMetadataStore", "TIMED_OPERATIONS"]
