"""A lease in metadata: at most one leader acts at a time, fenced by epoch. The balancer's leader
(`balancer/lease`) and the mirror's workers (one per flow and target partition, and the flow's
leader) hold these.

One KV record per lease: {"holder": node id, "epoch": n, "expires_ns": t}. A candidate
takes the lease when it is absent or expired (epoch + 1), and the holder renews it (same epoch)
before it expires; every change is a compare-and-set (`MetadataStore.replace_kv`), so two
candidates never both win one epoch.

Expiry is judged by the candidates' clocks, so clocks decide only when a new leader may take
over, never whether two act at once: every write a leader makes (an assignment) is guarded by the
lease record it holds, byte for byte. A leader that was deposed while it paused (GC, a slow
disk) and does not know it yet has its next write refused (FencedLeaderError), because its
successor's takeover changed the record.
"""
from __future__ import annotations

import json
import time
from typing import Callable, TypeGuard

from ..metadata import MetadataStore

def read_lease(raw: bytes | None) -> dict | None:
    """A lease record ({"holder", "epoch", "expires_ns"}), or None if absent or not one."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("expires_ns"), int):
        return None
    return record


def is_held(record: dict | None, now_ns: int) -> TypeGuard[dict]:
    """True if the record's lease has not expired at `now_ns` (released ones have expired)."""
    return record is not None and now_ns < record["expires_ns"]


def expire(meta: MetadataStore, key: str, raw: bytes) -> bool:
    """Expire the lease at `key` now, if it still holds exactly `raw` (compare-and-set): its
    successor need not wait for the expiry. True if expired here."""
    record = read_lease(raw)
    if record is None:
        return False
    record["expires_ns"] = 0
    return meta.replace_kv(key, raw, json.dumps(record, sort_keys=True).encode())


class Lease:
    """A candidate for the lease `key`. `token` is the guard for the holder's writes (None while
    not holding it)."""

    def __init__(self, meta: MetadataStore, holder: int, ttl_s: float, *, key: str,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.meta = meta
        self.holder = holder
        self.ttl_ns = int(ttl_s * 1e9)
        self.key = key
        self.clock = clock
        self.epoch = 0
        self._raw: bytes | None = None      # the record as we last wrote it, while we hold it

    @property
    def token(self) -> tuple[str, bytes] | None:
        """(key, value) to guard a leader's writes with, or None if not the holder."""
        return None if self._raw is None else (self.key, self._raw)

    def acquire(self) -> bool:
        """Take or renew the lease; True if this candidate holds it now (until the expiry it set)."""
        raw = self.meta.get_kv(self.key)
        now = self.clock()
        current = read_lease(raw)
        if current is not None and current["holder"] == self.holder and raw == self._raw:
            epoch = current["epoch"]                              # ours: renew
        elif not is_held(current, now):
            epoch = (current["epoch"] if current else 0) + 1      # free or expired: take over
        else:
            self._raw = None                                      # someone else's, still valid
            return False
        value = json.dumps({"holder": self.holder, "epoch": epoch, "expires_ns": now + self.ttl_ns},
                           sort_keys=True).encode()
        if self.meta.replace_kv(self.key, raw, value):
            self._raw, self.epoch = value, epoch
            return True
        self._raw = None
        return False

    def release(self) -> None:
        """Give the lease up (expire it now) if still held, so a successor need not wait."""
        if self._raw is not None:
            expire(self.meta, self.key, self._raw)
            self._raw = None

    def holder_now(self) -> dict | None:
        return read_lease(self.meta.get_kv(self.key))
