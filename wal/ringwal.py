"""What both WALs (the ring on a file, wal.log; objects on a store, wal.objectlog) do the same
way through their native Ring: appends, waits, the acknowledgment deadline, watermarks."""
from __future__ import annotations

from typing import Callable

from _native.walring import AppendHandle, Ring

#: set_ack_deadline(None): the ring's "no deadline" (INT64_MAX).
NO_DEADLINE = (1 << 63) - 1


class RingWAL:
    """Base of WriteAheadLog and ObjectWAL: `_ring` is the session's Ring once started,
    `_start()` starts it, `_check_open()` refuses a closed WAL, `durable_end` and `close()` are
    each implementation's."""

    _ring: Ring | None

    def _start(self) -> Ring:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    @property
    def durable_end(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def start(self) -> Ring:
        """Begin the writer session (after `recover()`, if it is called at all) and return its
        native Ring, for native appenders that place records without a Python call (the
        engine's append path cimports it). `append` and the Ring share the one session."""
        return self._ring or self._start()

    def append(self, data, callback: Callable[[AppendHandle], object] | None = None,
               prefix: bytes | None = None) -> AppendHandle:
        """Append one record; returns its handle at once (see the module contract).

        The record's body is `prefix + data` when a prefix is given (no copy of `data` is made
        to join them).

        `callback(handle)`, if given, runs on the WAL's callback thread once the record is durable
        or failed; callbacks given here run in offset order.
        """
        ring = self._ring or self._start()
        return ring.append(data, callback, prefix)

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every record appended so far is durable; False on timeout."""
        ring = self._ring
        if ring is None:
            return True
        return ring.wait_durable(ring.appended_end, timeout)

    def set_ack_deadline(self, deadline_ns: int | None) -> None:
        """Acknowledge records (complete their handles and callbacks) only while
        time.monotonic_ns() is before `deadline_ns`: the end of a lease the caller holds (None:
        no deadline, the default). A record made durable after the deadline stays unacknowledged
        until a later deadline is set (then it is acknowledged at once) or `revoke_acks`. Every
        acknowledged record was durable before the deadline in force when it became durable."""
        self._check_open()
        self.start().set_ack_deadline(NO_DEADLINE if deadline_ns is None else deadline_ns)

    def on_fenced(self, fn: Callable[[BaseException], object]) -> None:
        """Call `fn(error)`, on a thread of its own, if another writer fences this one. A WAL
        on a file never is (its lock admits one writer); a WAL of objects can be
        (wal.objectlog.ObjectWAL.on_fenced)."""

    def revoke_acks(self, error: BaseException) -> None:
        """Acknowledge nothing from now on: records not yet acknowledged fail with `error` (the
        lease is gone for good: the owner was fenced). The records stay in the log."""
        ring = self._ring
        if ring is not None:
            ring.revoke_acks(error)

    @property
    def acked_end(self) -> int:
        """Every record ending at or before this logical offset is acknowledged (`durable_end`
        without a deadline)."""
        ring = self._ring
        return ring.acked_end if ring is not None else self.durable_end

    def completion_time(self, end: int) -> int | None:
        """time.monotonic_ns() at which the records ending at or before logical offset `end`
        became durable, from the ring's log of its last durable advances; None if they are not
        durable yet, or became so too long ago to be in that log. For samplers of the write
        latency that must cost the appenders nothing (s3stream.metrics)."""
        ring = self._ring
        return None if ring is None else ring._completion_time(end)

    @property
    def appended_end(self) -> int:
        """End of the last record placed (durable once `durable_end` reaches it); before the
        writer session starts, `durable_end`."""
        ring = self._ring
        return ring.appended_end if ring is not None else self.durable_end

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
