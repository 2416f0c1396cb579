"""Object store wrappers: counting and timing (InstrumentedObjectStore) and, for tests, failing
on demand (FaultInjectingObjectStore). Both keep the ObjectStore contract of what they wrap."""
from __future__ import annotations

import random
import threading
import time
from typing import Callable, Iterable, Iterator

from ..errors import ObjectStoreError
from ..latency import LatencyHistogram
from .base import BytesLike, Gathered, ObjectInfo, ObjectStore, PutData, cpu_bound_puts, data_size, write_requests

KeyPredicate = Callable[[str], bool]


def _part_size(inner: ObjectStore) -> int | None:
    # part_size is not part of the Protocol; a store without it never splits a put.
    return getattr(inner, "part_size", None)


class _Wrapper:
    """Forwards url, part_size, multipart_threshold, cpu_bound_puts and close() to the wrapped
    store."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def part_size(self) -> int | None:
        return _part_size(self.inner)

    @property
    def multipart_threshold(self) -> int | None:
        return getattr(self.inner, "multipart_threshold", None)

    @property
    def cpu_bound_puts(self) -> bool:   # noqa: F811 - the property forwards the function's answer
        return cpu_bound_puts(self.inner)

    def close(self) -> None:
        """Close the wrapped store."""
        self.inner.close()


class InstrumentedObjectStore(_Wrapper):
    """Counts calls, the requests a real S3 would see, and bytes moved, for the wrapped store.

    A put counts the write requests of base.write_requests: 1 up to the multipart threshold, else create + ceil(size / part_size) parts +
    complete. A get of an empty range is no request. Counts are taken when a call is made,
    bytes when it succeeds; failures are also counted under "errors".

    A put_if_absent counts as a put of one request ("put", "put_requests"; "bytes_written" if it
    created the object) and under "put_if_absent", with "put_if_absent_refused" when the key was
    taken.

    It also times every put, put_if_absent, get and delete (successful or not) in a
    LatencyHistogram per operation (`latencies()`; a put_if_absent under its own name, not
    "put") and counts the calls in progress (`inflight()`): what the Prometheus metrics read at
    scrape time (s3stream.metrics).
    """

    _KEYS = ("put", "put_requests", "bytes_written", "put_if_absent", "put_if_absent_refused",
             "get", "get_requests", "bytes_read", "size", "delete", "deleted_keys", "list", "errors")
    _TIMED = ("put", "put_if_absent", "get", "delete")

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._KEYS, 0)
        self._latency = {op: LatencyHistogram() for op in self._TIMED}
        self._inflight = dict.fromkeys(self._TIMED, 0)

    def _add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def put(self, key: str, data: PutData) -> None:
        """Delegate, counting the write requests the put implies."""
        size = data_size(data)
        requests = write_requests(size, _part_size(self.inner), getattr(self.inner, "multipart_threshold", None))
        self._add(put=1, put_requests=requests)
        t0 = self._begin("put")
        try:
            self.inner.put(key, data)
        except Exception:
            self._add(errors=1)
            raise
        finally:
            self._end("put", t0)
        self._add(bytes_written=size)

    def put_if_absent(self, key: str, data: BytesLike) -> bool:
        """Delegate, counting a one-request put and whether it was refused."""
        size = data_size(data)
        self._add(put=1, put_requests=1, put_if_absent=1)
        t0 = self._begin("put_if_absent")
        try:
            created = self.inner.put_if_absent(key, data)
        except Exception:
            self._add(errors=1)
            raise
        finally:
            self._end("put_if_absent", t0)
        if created:
            self._add(bytes_written=size)
        else:
            self._add(put_if_absent_refused=1)
        return created

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Delegate, counting the request and bytes returned."""
        self._add(get=1, get_requests=0 if end is not None and start == end else 1)
        t0 = self._begin("get")
        try:
            data = self.inner.get(key, start, end)
        except Exception:
            self._add(errors=1)
            raise
        finally:
            self._end("get", t0)
        self._add(bytes_read=len(data))
        return data

    def size(self, key: str) -> int:
        """Delegate, counting the call."""
        self._add(size=1)
        try:
            return self.inner.size(key)
        except Exception:
            self._add(errors=1)
            raise

    def delete(self, keys: Iterable[str]) -> None:
        """Delegate, counting the call and the keys."""
        keys = list(keys)
        self._add(delete=1, deleted_keys=len(keys))
        t0 = self._begin("delete")
        try:
            self.inner.delete(keys)
        except Exception:
            self._add(errors=1)
            raise
        finally:
            self._end("delete", t0)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Delegate, counting the call."""
        self._add(list=1)
        try:
            yield from self.inner.list(prefix)
        except Exception:
            self._add(errors=1)
            raise

    def _begin(self, op: str) -> float:
        with self._lock:
            self._inflight[op] += 1
        return time.perf_counter()

    def _end(self, op: str, t0: float) -> None:
        self._latency[op].observe(time.perf_counter() - t0)
        with self._lock:
            self._inflight[op] -= 1

    def stats(self) -> dict[str, int]:
        """A snapshot of the counters."""
        with self._lock:
            return dict(self._counts)

    def latencies(self) -> dict[str, dict]:
        """Per operation ("put", "put_if_absent", "get", "delete"): a LatencyHistogram snapshot of
        its calls' seconds."""
        return {op: h.snapshot() for op, h in self._latency.items()}

    def inflight(self) -> dict[str, int]:
        """Per operation ("put", "put_if_absent", "get", "delete"): calls in progress now."""
        with self._lock:
            return dict(self._inflight)

    def reset(self) -> None:
        """Zero every counter and histogram."""
        with self._lock:
            self._counts = dict.fromkeys(self._KEYS, 0)
            self._latency = {op: LatencyHistogram() for op in self._TIMED}


class FaultInjectingObjectStore(_Wrapper):
    """Fails, delays or corrupts operations of the wrapped store when armed; for tests.

    Every operation is logged in `events` as (op, key, outcome), outcome being "ok",
    "injected_failure", "timeout_after_landing", "kept_view", "corrupted" or the name of an
    exception the inner store raised; a put_if_absent's also "refused", "answer_lost" and
    "condition_ignored". A delete logs one event per key; a list logs its prefix. `seed` makes
    the corrupted byte positions reproducible; `sleep` is injectable for hang_puts and
    hang_puts_if_absent.

    The put faults (fail_next_puts, fail_puts_matching, put_timeout_after_landing,
    put_keeps_view, hang_puts) arm plain puts only; put_if_absent has its own
    (fail_next_puts_if_absent, put_if_absent_answer_lost, hang_puts_if_absent,
    ignore_put_if_absent_condition), so a test can fail one kind of write and not the other.
    """

    # The armed faults: set by clear(), changed by the arming methods (under _lock).
    _put_exc: BaseException | type[BaseException] | None
    _cput_exc: BaseException | type[BaseException] | None
    _put_fail_predicates: list[KeyPredicate]
    _corrupt_predicates: list[KeyPredicate]

    def __init__(self, inner: ObjectStore, *, seed: int = 0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._sleep = sleep
        self.events: list[tuple[str, str, str]] = []
        self.kept_views: list[memoryview] = []
        self.clear()

    # -- arming --------------------------------------------------------------------------------

    def fail_next_puts(self, n: int,
                       exc: BaseException | type[BaseException] | None = None) -> None:
        """The next `n` puts raise `exc` (default ObjectStoreError) without writing anything."""
        with self._lock:
            self._put_failures = n
            self._put_exc = exc

    def fail_puts_matching(self, predicate: KeyPredicate) -> None:
        """Every put whose key satisfies `predicate` raises ObjectStoreError without writing."""
        with self._lock:
            self._put_fail_predicates.append(predicate)

    def put_timeout_after_landing(self, n: int) -> None:
        """The next `n` puts store the object, then raise ObjectStoreError as if the response
        was lost: the caller cannot tell whether the write happened."""
        with self._lock:
            self._put_timeouts = n

    def put_keeps_view(self, n: int) -> None:
        """The next `n` puts raise ObjectStoreError without writing, and keep a view of their
        data afterwards (in `kept_views`), as a timed-out request still holding its body would:
        the caller's buffer stays exported (a bytearray cannot be resized) until
        `release_kept_views()`."""
        with self._lock:
            self._put_keep_views = n

    def release_kept_views(self) -> None:
        """Let go of the views kept by put_keeps_view."""
        with self._lock:
            views, self.kept_views = self.kept_views, []
        for view in views:
            view.release()

    def hang_puts(self, seconds: float) -> None:
        """Every put sleeps `seconds` before delegating (0 disarms)."""
        with self._lock:
            self._put_delay = seconds

    def fail_next_puts_if_absent(self, n: int,
                                 exc: BaseException | type[BaseException] | None = None) -> None:
        """The next `n` put_if_absent calls raise `exc` (default ObjectStoreError) without
        writing anything."""
        with self._lock:
            self._cput_failures = n
            self._cput_exc = exc

    def put_if_absent_answer_lost(self, n: int) -> None:
        """The next `n` put_if_absent calls go to the store (creating the object if the key is
        free), then raise ObjectStoreError as if the answer was lost: the caller cannot tell
        whether it created the object, nor whether the key was taken."""
        with self._lock:
            self._cput_answers_lost = n

    def hang_puts_if_absent(self, seconds: float) -> None:
        """Every put_if_absent sleeps `seconds` before delegating (0 disarms)."""
        with self._lock:
            self._cput_delay = seconds

    def ignore_put_if_absent_condition(self, ignore: bool = True) -> None:
        """put_if_absent becomes a plain put that reports True, as on a server that ignores
        If-None-Match (probe_conditional_put then returns False)."""
        with self._lock:
            self._cput_ignore_condition = ignore

    def fail_next_gets(self, n: int) -> None:
        """The next `n` gets raise ObjectStoreError."""
        with self._lock:
            self._get_failures = n

    def corrupt_gets(self, predicate: KeyPredicate) -> None:
        """Gets of keys satisfying `predicate` return their data with one byte flipped."""
        with self._lock:
            self._corrupt_predicates.append(predicate)

    def clear(self) -> None:
        """Disarm every fault (the event log is kept)."""
        with self._lock:
            self._put_failures = 0
            self._put_exc = None
            self._put_fail_predicates = []
            self._put_timeouts = 0
            self._put_keep_views = 0
            self._put_delay = 0.0
            self._cput_failures = 0
            self._cput_exc = None
            self._cput_answers_lost = 0
            self._cput_delay = 0.0
            self._cput_ignore_condition = False
            self._get_failures = 0
            self._corrupt_predicates = []

    def _log(self, op: str, key: str, outcome: str) -> None:
        with self._lock:
            self.events.append((op, key, outcome))

    def _delegate(self, op: str, key: str, call: Callable[[], object]) -> object:
        try:
            result = call()
        except Exception as e:
            self._log(op, key, type(e).__name__)
            raise
        return result

    # -- ObjectStore ---------------------------------------------------------------------------

    def put(self, key: str, data: PutData) -> None:
        """Delegate unless a put fault is armed."""
        with self._lock:
            delay = self._put_delay
        if delay:
            self._sleep(delay)
        with self._lock:
            exc: BaseException | type[BaseException] | None = None
            outcome = "injected_failure"
            if self._put_failures > 0:
                self._put_failures -= 1
                exc = self._put_exc or ObjectStoreError(f"injected failure of put {key!r}")
            elif any(p(key) for p in self._put_fail_predicates):
                exc = ObjectStoreError(f"injected failure of put {key!r}")
            elif self._put_keep_views > 0 and not isinstance(data, Gathered):
                self._put_keep_views -= 1
                self.kept_views.append(memoryview(data))
                exc = ObjectStoreError(f"injected timeout of put {key!r} (its request still holds the data)")
                outcome = "kept_view"
        if exc is not None:
            self._log("put", key, outcome)
            raise exc
        self._delegate("put", key, lambda: self.inner.put(key, data))
        with self._lock:
            timed_out = self._put_timeouts > 0
            if timed_out:
                self._put_timeouts -= 1
        if timed_out:
            self._log("put", key, "timeout_after_landing")
            raise ObjectStoreError(f"put {key!r} timed out (injected: the object was stored)")
        self._log("put", key, "ok")

    def put_if_absent(self, key: str, data: BytesLike) -> bool:
        """Delegate unless a put_if_absent fault is armed."""
        with self._lock:
            delay = self._cput_delay
        if delay:
            self._sleep(delay)
        with self._lock:
            exc: BaseException | type[BaseException] | None = None
            if self._cput_failures > 0:
                self._cput_failures -= 1
                exc = self._cput_exc or ObjectStoreError(f"injected failure of put_if_absent {key!r}")
            ignore_condition = self._cput_ignore_condition
        if exc is not None:
            self._log("put_if_absent", key, "injected_failure")
            raise exc
        if ignore_condition:
            self._delegate("put_if_absent", key, lambda: self.inner.put(key, data))
            created = True
        else:
            created = bool(self._delegate("put_if_absent", key, lambda: self.inner.put_if_absent(key, data)))
        with self._lock:
            lost = self._cput_answers_lost > 0
            if lost:
                self._cput_answers_lost -= 1
        if lost:
            self._log("put_if_absent", key, "answer_lost")
            raise ObjectStoreError(f"put_if_absent {key!r} timed out (injected: the request reached the store)")
        self._log("put_if_absent", key,
                  "condition_ignored" if ignore_condition else "ok" if created else "refused")
        return created

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Delegate unless a get fault is armed; corrupt the result if asked to."""
        with self._lock:
            fail = self._get_failures > 0
            if fail:
                self._get_failures -= 1
        if fail:
            self._log("get", key, "injected_failure")
            raise ObjectStoreError(f"injected failure of get {key!r}")
        data = self._delegate("get", key, lambda: self.inner.get(key, start, end))
        assert isinstance(data, bytes)
        with self._lock:
            corrupt = bool(data) and any(p(key) for p in self._corrupt_predicates)
            position = self._random.randrange(len(data)) if corrupt else 0
        if corrupt:
            damaged = bytearray(data)
            damaged[position] ^= 0xFF
            self._log("get", key, "corrupted")
            return bytes(damaged)
        self._log("get", key, "ok")
        return data

    def size(self, key: str) -> int:
        """Delegate."""
        result = self._delegate("size", key, lambda: self.inner.size(key))
        self._log("size", key, "ok")
        return result  # type: ignore[return-value]

    def delete(self, keys: Iterable[str]) -> None:
        """Delegate."""
        keys = list(keys)
        try:
            self.inner.delete(keys)
        except Exception as e:
            for key in keys:
                self._log("delete", key, type(e).__name__)
            raise
        for key in keys:
            self._log("delete", key, "ok")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Delegate."""
        try:
            yield from self.inner.list(prefix)
        except Exception as e:
            self._log("list", prefix, type(e).__name__)
            raise
        self._log("list", prefix, "ok")


__all__ = ["FaultInjectingObjectStore", "InstrumentedObjectStore"]
