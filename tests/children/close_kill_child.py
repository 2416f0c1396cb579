"""Child of the scoped-close crash test: node 1 loads two streams, closes one, and is SIGKILLed.

Usage: close_kill_child.py TMPDIR MODE
MODE "close-put": the close's own PUT never returns (killed while the close uploads its tail);
MODE "close-done": the background PUTs never return, the close finishes (killed after the
close committed its tail while the blocks holding it are still uncommitted in the WAL).
Prints "ids A B", then "ack SID BASE HEXDIGEST" per acknowledged append, "closing" before the
close and "closed" after it, then waits to be killed.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import time
from pathlib import Path

from s3stream import RecordBatch, StreamClient
from s3stream.objectstore import LocalObjectStore

from conftest import KiB, small_config


class ThreadGatedStore:
    """A store whose PUTs hang (for good, or `delay` seconds) on the threads a test picks: the
    upload pool's ("s3stream-put...", the background) or any other (a close's own PUT runs on
    the closing thread). Everything else is the wrapped store's."""

    def __init__(self, inner, *, hang_background: float = 0.0, hang_others: float = 0.0) -> None:
        self.inner = inner
        self.hang_background = hang_background
        self.hang_others = hang_others
        self.puts: list[tuple[str, str, int]] = []       # (thread name, key, size)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data) -> None:
        name = threading.current_thread().name
        background = name.startswith("s3stream-put")
        delay = self.hang_background if background else self.hang_others
        if delay:
            time.sleep(delay)
        self.inner.put(key, data)
        size = data.size if hasattr(data, "size") else len(data)
        with self._lock:
            self.puts.append((name, key, size))


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def main() -> None:
    tmp, mode = Path(sys.argv[1]), sys.argv[2]
    forever = 3600.0
    store = ThreadGatedStore(LocalObjectStore(str(tmp / "objects")),
                             hang_others=forever if mode == "close-put" else 0.0,
                             hang_background=forever if mode == "close-done" else 0.0)
    client = StreamClient(1, tmp / "node1.wal", store, f"sqlite:///{tmp}/meta.db",
                          # the tails (~600 KB each) stay below the bound though no background PUT ends
                          small_config(reclaim_interval=None, upload_threshold=256 * KiB, split_size=64 * KiB,
                                       stream_tail_limit=1024 * KiB))
    a, b = client.create_stream(), client.create_stream()
    print(f"ids {a.stream_id} {b.stream_id}", flush=True)
    for i in range(120):
        for s in (a, b):
            payload = (f"{s.stream_id}/{i}/".encode() * 1000)[:3000 + 37 * i]
            base = s.append(RecordBatch(payload, 1)).result(30).base_offset
            print(f"ack {s.stream_id} {base} {digest(payload)}", flush=True)
    print("closing", flush=True)
    a.close(timeout=forever)
    print("closed", flush=True)
    time.sleep(forever)


if __name__ == "__main__":
    main()
