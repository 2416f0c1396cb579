"""A node is never judged silent while it starts (issue 50, item 12): registration bumps its
epoch and records a heartbeat, then it opens and replays its WAL, which on a WAL of objects took
2-6 s on a loaded host; peers counting its silence failed it over in the middle of its start.
It now heartbeats (saying it cannot serve yet) until the client is made."""
from __future__ import annotations

import pytest

import threading
import time

from s3stream import RecordBatch, StreamClient
from s3stream.cluster.detector import FailureDetector
from s3stream.metadata import open_metadata
from s3stream.objectstore import open_object_store
from conftest import small_config


class SlowListing:
    """An object store whose list() takes `delay` seconds once armed (a slow WAL open)."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        self._inner = inner
        self.delay = delay

    def list(self, prefix: str = ""):
        if self.delay:
            time.sleep(self.delay)
        return self._inner.list(prefix)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.slow
def test_a_node_opening_a_slow_wal_of_objects_is_never_judged_silent(tmp_path, metadata_url):
    store_url = f"file://{tmp_path}/objects"
    wal_store = SlowListing(open_object_store(f"file://{tmp_path}/wal-objects"))
    client = StreamClient(1, wal_store, store_url, metadata_url, small_config(reclaim_interval=None))
    stream = client.create_stream()
    stream.append(RecordBatch(b"x")).result(10)
    client.close()
    meta = open_metadata(metadata_url)
    # A judge as a peer's agent runs it: every 0.1 s, a 1.5 s timeout.
    detector = FailureDetector(timeout=1.5, max_credit=1.0)
    suspected: list[float] = []
    reads = 0
    stop = threading.Event()

    def judge() -> None:
        nonlocal reads
        while not stop.wait(0.1):
            nodes = [n for n in meta.list_nodes() if not n.failover]
            if detector.observe(time.monotonic_ns(), [(n.node_id, (n.node_epoch, n.heartbeat_ns)) for n in nodes]):
                suspected.append(detector.silence(1))
            reads += 1

    wal_store.delay = 3.0                 # the open's listing: twice the judge's timeout
    judging = threading.Thread(target=judge)
    judging.start()
    try:
        client = StreamClient(1, wal_store, store_url, metadata_url, small_config(reclaim_interval=None))
    finally:
        stop.set()
        judging.join()
    try:
        assert reads >= 20, "the judge watched the whole start"
        assert suspected == [], f"node 1 was judged silent while it started (silence {suspected[0]:.1f} s)"
        assert client.open_stream(stream.stream_id).fetch(0).batches[0].payload == b"x"
    finally:
        client.close()
        meta.close()
        wal_store._inner.close()
