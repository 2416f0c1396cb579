"""The engine against an in-memory model of streams (hypothesis state machine).

Two nodes share a local object store and SQLite. Steps: create, append, fetch at random ranges,
trim, close and reopen on the other node, clean client restarts and crashes (the client is torn
down without uploading or a clean WAL shutdown, as a kill -9 leaves it; the real kill -9 runs in
test_engine_faults). After every step the engine must agree with the model exactly.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import s3stream
from s3stream import RecordBatch, StreamClient
from conftest import KiB, small_config

CONFIG = small_config(upload_threshold=64 * KiB, split_size=16 * KiB, object_block_size=4 * KiB,
                      cache_size=256 * KiB, max_batch_bytes=16 * KiB, block_cache_size=64 * KiB,
                      readahead_bytes=8 * KiB, reclaim_interval=None)


def crash(client: StreamClient) -> None:
    """Tear a client down as a kill -9 would leave its files: nothing more is uploaded, the WAL
    gets no clean-shutdown header, the WAL lock is released."""
    client._closed = True
    client._uploader.abort()
    client._uploader.close()
    w = client._wal
    if w._filler is not None:       # a kill -9 stops every thread, the first fill's included
        w._filler.stop()
    if w._ring is not None:
        w._ring.stop()
        for t in w._writers:
            t.join()
        if w._dispatcher is not None:
            w._ring.stop_dispatcher()
            w._dispatcher.join()
    w._closed = True
    os.close(w._fd)
    client._meta.close()
    client._store.close()


class EngineModel(RuleBasedStateMachine):
    streams = Bundle("streams")

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="s3s-model-"))
        self.clients = {n: self._client(n) for n in (1, 2)}
        self.model: dict[int, list[tuple[int, int, bytes]]] = {}   # sid -> batches
        self.start: dict[int, int] = {}
        self.where: dict[int, int] = {}                             # sid -> node holding it open
        self.handles: dict[int, s3stream.Stream] = {}

    def _client(self, node: int) -> StreamClient:
        return StreamClient(node, self.dir / f"node{node}.wal", f"file://{self.dir}/objects",
                            f"sqlite:///{self.dir}/meta.db", CONFIG)

    def teardown(self):
        for c in self.clients.values():
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _end(self, sid: int) -> int:
        b = self.model[sid]
        return b[-1][0] + b[-1][1] if b else 0

    @rule(target=streams, node=st.sampled_from([1, 2]))
    def create(self, node):
        s = self.clients[node].create_stream()
        self.model[s.stream_id] = []
        self.start[s.stream_id] = 0
        self.where[s.stream_id] = node
        self.handles[s.stream_id] = s
        return s.stream_id

    @rule(sid=streams, size=st.sampled_from([0, 1, 100, 3000, 9000, 16 * KiB]), count=st.integers(1, 5),
          n=st.integers(1, 8))
    def append(self, sid, size, count, n):
        s = self.handles[sid]
        futures = []
        for i in range(n):
            payload = os.urandom(size)
            futures.append((s.append(RecordBatch(payload, count)), payload))
        for f, payload in futures:
            base = f.result(30).base_offset
            assert base == self._end(sid)
            self.model[sid].append((base, count, payload))

    @rule(sid=streams, data=st.data())
    def fetch(self, sid, data):
        s = self.handles[sid]
        start = data.draw(st.integers(self.start[sid], self._end(sid)))
        end = data.draw(st.integers(start, self._end(sid)))
        max_bytes = data.draw(st.sampled_from([1, 5000, 1 << 20]))
        got = [(b.base_offset, b.count, b.payload) for b in s.fetch(start, end, max_bytes).batches]
        want, size = [], 0
        for batch in self.model[sid] if start < end else []:
            if batch[0] + batch[1] <= start or batch[0] >= end:
                continue
            if want and size + len(batch[2]) > max_bytes:
                break
            want.append(batch)
            size += len(batch[2])
        assert got == want

    @rule(sid=streams, data=st.data())
    def trim(self, sid, data):
        offset = data.draw(st.integers(self.start[sid], self._end(sid)))
        self.handles[sid].trim(offset)
        self.start[sid] = offset

    @rule(sid=streams)
    def move(self, sid):
        """Close on the holder, reopen on the other node (epoch + 1)."""
        old = self.handles[sid]
        old.close()
        node = 3 - self.where[sid]
        s = self.clients[node].open_stream(sid)
        assert s.epoch == old.epoch + 1
        self.where[sid] = node
        self.handles[sid] = s

    def _reopen_all(self, node: int) -> None:
        for sid, holder in self.where.items():
            if holder == node:
                self.handles[sid] = self.clients[node].open_stream(sid)

    @rule(node=st.sampled_from([1, 2]))
    def restart(self, node):
        self.clients[node].close()
        self.clients[node] = self._client(node)
        self._reopen_all(node)

    @precondition(lambda self: self.model)
    @rule(node=st.sampled_from([1, 2]))
    def crash_and_recover(self, node):
        crash(self.clients[node])
        self.clients[node] = self._client(node)
        self._reopen_all(node)

    @invariant()
    def offsets_agree(self):
        for sid, s in self.handles.items():
            assert s.confirm_offset == self._end(sid) == s.next_offset
            assert s.start_offset == self.start[sid]


EngineModel.TestCase.settings = settings(max_examples=int(os.environ.get("MODEL_EXAMPLES", "12")),
                                         stateful_step_count=25, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_engine_matches_model = EngineModel.TestCase
test_engine_matches_model.pytestmark = [pytest.mark.slow]   # a stateful model run: over 2 s


def test_corrupt_object_raises_and_stays_intact(tmp_path):
    def node(n):
        return StreamClient(n, tmp_path / f"n{n}.wal", f"file://{tmp_path}/objects",
                            f"sqlite:///{tmp_path}/meta.db", small_config())
    c = node(1)
    s = c.create_stream()
    for i in range(20):
        s.append(RecordBatch(bytes([i]) * 4000, 1)).result(10)
    s.close()
    c.close()
    obj = next(p for p in (tmp_path / "objects").rglob("*.obj"))
    good = obj.read_bytes()

    def reader_after(corrupt_at):
        raw = bytearray(good)
        raw[corrupt_at] ^= 0xFF
        obj.write_bytes(bytes(raw))
        r = node(2)          # a fresh node: nothing cached, reads go to the object
        return r, r.open_stream(s.stream_id)

    r, s2 = reader_after(100)                             # inside the first data block
    with pytest.raises(s3stream.CorruptDataError, match="checksum"):
        s2.fetch(0, 1)
    r.close()
    r, s2 = reader_after(len(good) - 3)                   # the footer magic
    with pytest.raises(s3stream.CorruptDataError, match="footer"):
        s2.fetch(0, 1)
    r.close()
    obj.write_bytes(good)                                 # repaired: the same stream reads back whole
    r = node(2)
    s2 = r.open_stream(s.stream_id)
    assert [b.payload for b in s2.fetch(0, 20, 1 << 20).batches] == [bytes([i]) * 4000 for i in range(20)]
    r.close()
