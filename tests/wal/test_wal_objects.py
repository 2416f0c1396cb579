"""The WAL kept as objects (wal.objectlog.ObjectWAL) over an in-memory store with faults:
recovery, fencing of paused writers (a zombie's PUT racing the fence), lost answers, transient
failures, stores that ignore conditional writes, corruption, trim. The kill -9 rounds over a
directory store are in test_wal_crash.py; the engine's round trips over S3 servers in
test_engine_object_wal.py."""
from __future__ import annotations

import random
import threading
import time
from collections import namedtuple

import pytest

import wal
from wal.objectlog import (
    DATA_GAP, HEADER_BYTES, KIND_DATA, KIND_FENCE, KIND_HOLE, ObjectHeader, ObjectWAL, node_prefix, object_key,
)

Info = namedtuple("Info", "key size")
MiB = 1 << 20


class MemStore:
    """A WALStore in memory. `gate(fn)`: fn(key) -> threading.Event or None; a put waits for
    the event before it lands (a PUT in flight). `fail_puts`: puts raise while > 0.
    `lose_answers`: that many puts land, then raise as if the answer was lost.
    `honour_conditions=False`: put_if_absent overwrites (a store that ignores If-None-Match)."""

    url = "mem://wal"

    def __init__(self, honour_conditions: bool = True) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.honour = honour_conditions
        self.gate = None
        self.fail_puts = 0
        self.lose_answers = 0
        self.puts = 0

    def put_if_absent(self, key, data) -> bool:
        gate = self.gate(key) if self.gate else None
        if gate is not None:
            gate.wait(10)
        with self.lock:
            if self.fail_puts > 0:
                self.fail_puts -= 1
                raise ConnectionError("injected: the store is unreachable")
            self.puts += 1
            if key in self.objects and self.honour:
                return False
            self.objects[key] = bytes(data)
            if self.lose_answers > 0:
                self.lose_answers -= 1
                raise TimeoutError("injected: the PUT landed but its answer was lost")
            return True

    def get(self, key, start=0, end=None):
        with self.lock:
            return self.objects[key][start:end]

    def list(self, prefix=""):
        with self.lock:
            return [Info(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def delete(self, keys):
        with self.lock:
            for k in keys:
                self.objects.pop(k, None)

    def headers(self, node_id=1) -> list[ObjectHeader]:
        with self.lock:
            items = [(k, v) for k, v in sorted(self.objects.items()) if k.startswith(node_prefix(node_id))
                     and "probe" not in k]
        return [ObjectHeader.decode(v[:HEADER_BYTES], k) for k, v in items]


def cfg(**kw) -> wal.WALConfig:
    base = dict(capacity=64 * MiB, object_bytes=64 * 1024, put_interval=0.001, full_timeout=5,
                put_retry_seconds=5)
    base.update(kw)
    return wal.WALConfig(**base)


def payload(i: int, n: int = 300) -> bytes:
    return (b"%08d" % i) * (n // 8)


def recover_all(store, **kw) -> list[bytes]:
    with ObjectWAL.open(store, node_id=1, recovery=True, config=cfg(), **kw) as w:
        return [r.data for r in w.recover()]


def test_round_trip_across_sessions():
    store = MemStore()
    w = ObjectWAL.open(store, node_id=1, config=cfg())
    assert list(w.recover()) == []
    hs = [w.append(payload(i)) for i in range(3000)]
    offsets = [h.result(5) for h in hs]
    assert offsets == sorted(offsets)
    st = w.stats()
    assert st["puts"] >= 2 and st["fences"] >= 1 and st["kind"] == "objects"
    w.close()
    w2 = ObjectWAL.open(store, node_id=1, config=cfg())
    recs = list(w2.recover())
    assert [r.data for r in recs] == [payload(i) for i in range(3000)]
    assert [r.offset for r in recs] == offsets
    assert w2.generation > w.generation
    for h in [w2.append(payload(i)) for i in range(3000, 3500)]:
        h.result(5)
    w2.close()
    assert recover_all(store) == [payload(i) for i in range(3500)]
    kinds = {h.kind for h in store.headers()}
    assert kinds <= {KIND_DATA, KIND_FENCE, KIND_HOLE}


def test_puts_coalesce_at_low_load():
    """Appends arriving while a PUT is in flight, or within put_interval of the last one, share
    one object: the PUT count is bounded by time, not by appends."""
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg(put_interval=0.02)) as w:
        list(w.recover())
        t0 = time.monotonic()
        hs = []
        for i in range(400):
            hs.append(w.append(payload(i, 64)))
            time.sleep(0.0005)
        for h in hs:
            h.result(5)
        elapsed = time.monotonic() - t0
        puts = w.stats()["puts"]
    assert puts <= elapsed / 0.02 + 2, (puts, elapsed)
    assert puts < 400


def test_new_instance_fences_the_old_one():
    store = MemStore()
    a = ObjectWAL.open(store, node_id=1, config=cfg())
    list(a.recover())
    acked = [a.append(payload(i)) for i in range(100)]
    for h in acked:
        h.result(5)
    b = ObjectWAL.open(store, node_id=1, config=cfg())      # the restarted node
    late = a.append(payload(999))
    with pytest.raises(wal.WALFencedError):
        late.result(5)
    with pytest.raises(wal.WALError):
        a.append(payload(1000)).result(5)
    assert [r.data for r in b.recover()] == [payload(i) for i in range(100)]
    a.close()
    b.close()


def test_stale_epoch_is_refused():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, node_epoch=3, config=cfg()) as w:
        list(w.recover())
        w.append(payload(0)).result(5)
    with pytest.raises(wal.WALFencedError, match="epoch 2 is stale"):
        ObjectWAL.open(store, node_id=1, node_epoch=2, config=cfg())


def test_recovery_open_takes_no_appends_and_fences():
    store = MemStore()
    a = ObjectWAL.open(store, node_id=1, config=cfg())
    list(a.recover())
    a.append(payload(0)).result(5)
    peer = ObjectWAL.open(store, node_id=1, recovery=True, config=cfg())
    assert [r.data for r in peer.recover()] == [payload(0)]
    with pytest.raises(wal.WALClosedError):
        peer.append(b"x")
    with pytest.raises(wal.WALFencedError):
        a.append(payload(1)).result(5)
    peer.close()
    a.close()


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("WAL_ZOMBIE_SEEDS", "12"))))
def test_zombie_puts_racing_the_fence(seed):
    """A writer whose PUTs are in flight (held at the store) when a peer fences its log: every
    record it acknowledged is replayed by the peer; every record it did not has never been and
    never is acknowledged, whichever PUTs land first."""
    rng = random.Random(seed)
    store = MemStore()
    zombie = ObjectWAL.open(store, node_id=1, config=cfg(puts_in_flight=rng.choice([1, 2, 4, 8]),
                                                         object_bytes=8192, buffers=16))
    list(zombie.recover())
    for h in [zombie.append(payload(i)) for i in range(50)]:
        h.result(5)
    held: list[threading.Event] = []
    hold = threading.Lock()

    def gate(key):
        if threading.current_thread().name.startswith("wal-put") and zombie.generation and key.startswith("node-1/"):
            ev = threading.Event()
            with hold:
                held.append(ev)
            return ev
        return None

    store.gate = gate
    handles = [zombie.append(payload(i)) for i in range(50, 50 + rng.randint(5, 120))]
    time.sleep(0.05)
    # Release some of the PUTs in flight before the fence, in random order.
    with hold:
        early = rng.sample(held, rng.randint(0, len(held)))
    for ev in early:
        ev.set()
    time.sleep(0.02)
    peer_result: list = []
    fenced = threading.Event()

    def run_peer():
        w = ObjectWAL.open(store, node_id=1, recovery=True, config=cfg())
        fenced.set()
        peer_result.extend(r.data for r in w.recover())
        w.close()

    store_gate = store.gate
    store.gate = lambda key: None if threading.current_thread().name == "peer" else store_gate(key)
    t = threading.Thread(target=run_peer, name="peer")
    t.start()
    # The rest land in random order, some before and some after the fence.
    while not fenced.wait(0.001):
        with hold:
            pending = [e for e in held if not e.is_set()]
        if pending:
            rng.choice(pending).set()
    t.join(10)
    with hold:
        for ev in held:
            ev.set()
    store.gate = None
    outcomes = []
    for h in handles:
        try:
            h.result(5)
            outcomes.append(True)
        except wal.WALError:
            outcomes.append(False)
    acked = [payload(i) for i in range(50)] + [payload(50 + i) for i, ok in enumerate(outcomes) if ok]
    assert outcomes == sorted(outcomes, reverse=True), "acknowledgments are in order"
    assert peer_result[:len(acked)] == acked, "everything acknowledged is replayed, in order"
    # Records replayed beyond the acknowledged ones were durable but never acknowledged: the
    # writer must never acknowledge them now.
    time.sleep(0.05)
    for h, ok in zip(handles, outcomes):
        assert h.done() and (h.exception() is None) == ok
    zombie.close()
    # A later session replays the same log plus nothing of the zombie's stray PUTs.
    assert recover_all(store)[:len(peer_result)] == peer_result


def test_lost_answer_is_not_a_fence():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg()) as w:
        list(w.recover())
        for round_ in range(3):
            store.lose_answers = 1
            for h in [w.append(payload(i)) for i in range(round_ * 100, round_ * 100 + 100)]:
                h.result(5)
        assert w.stats()["put_retries"] >= 3
    assert recover_all(store) == [payload(i) for i in range(300)]


def test_transient_put_failures_end_by_themselves():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg()) as w:
        list(w.recover())
        store.fail_puts = 8           # about 1.3 s of backoff at 0.01 doubling to 0.5
        hs = [w.append(payload(i)) for i in range(100)]
        for h in hs:
            assert h.result(10) >= 0
        assert w.stats()["put_retries"] >= 8
    assert recover_all(store) == [payload(i) for i in range(100)]


def test_store_ignoring_conditional_writes_is_refused():
    store = MemStore(honour_conditions=False)
    with pytest.raises(wal.WALConfigError, match="ignores conditional writes"):
        ObjectWAL.open(store, node_id=1, config=cfg())
    with pytest.raises(wal.WALConfigError, match="ack_check"):
        ObjectWAL.open(store, node_id=1, config=cfg(), conditional_writes=False)
    fenced = threading.Event()

    def check():
        if fenced.is_set():
            raise wal.WALFencedError("fenced (test)")

    with ObjectWAL.open(store, node_id=1, config=cfg(), conditional_writes=False, ack_check=check) as w:
        list(w.recover())
        w.append(payload(0)).result(5)
        fenced.set()
        with pytest.raises(wal.WALFencedError):
            w.append(payload(1)).result(5)
    assert recover_all(store, conditional_writes=False)[:1] == [payload(0)]


def test_corrupt_objects_are_reported():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg()) as w:
        list(w.recover())
        for h in [w.append(payload(i)) for i in range(500)]:
            h.result(5)
    data_keys = [object_key(1, h.seq) for h in store.headers() if h.kind == KIND_DATA]
    key = data_keys[len(data_keys) // 2]
    body = bytearray(store.objects[key])
    body[HEADER_BYTES + 100] ^= 0xFF
    store.objects[key] = bytes(body)
    with pytest.raises(wal.WALCorruptError, match="damaged"):
        recover_all(store)
    body[HEADER_BYTES + 100] ^= 0xFF
    body[10] ^= 0xFF                 # the object header
    store.objects[key] = bytes(body)
    with pytest.raises(wal.WALCorruptError, match="header checksum"):
        recover_all(store)


def test_trim_deletes_objects_and_recovery_starts_there():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg(capacity=4 * MiB)) as w:
        list(w.recover())
        offsets = []
        for i in range(40_000):             # ~12 MB through a 4 MiB log: laps, trims, deletes
            offsets.append(w.append(payload(i)))
            if i % 2000 == 1999:
                w.sync(5)
                w.trim(offsets[i - 500].offset)
        for h in offsets:
            h.result(5)
        w.trim(offsets[-100].offset)
        w.append(payload(40_000)).result(5)       # carries the last trim
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and w.stats()["deletes"] < w.stats()["puts"] - 10:
            time.sleep(0.01)
        st = w.stats()
    assert st["deletes"] > 100 and st["delete_requests"] >= 1
    assert len(store.objects) < 20, "objects wholly below the trim are deleted"
    assert recover_all(store) == [payload(i) for i in range(39_900, 40_001)]


def test_capacity_bounds_untrimmed_bytes():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg(capacity=1 * MiB, full_timeout=0.3)) as w:
        list(w.recover())
        with pytest.raises(wal.WALFullError):
            for i in range(10_000):
                w.append(payload(i, 1000))
        assert w.stats()["full_waits"] >= 1


def test_ack_deadline_holds_acknowledgments():
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg()) as w:
        list(w.recover())
        w.set_ack_deadline(time.monotonic_ns() - 1)      # the lease ran out
        h = w.append(payload(0))
        assert w.sync(5)                                  # durable
        assert not h.done()                               # but not acknowledged
        w.set_ack_deadline(time.monotonic_ns() + 10**9)   # renewed
        assert h.result(5) >= 0


def test_data_starts_past_the_gap():
    """A session's data objects start DATA_GAP sequences after its fence: an older writer's
    stray PUTs land in between without taking the new session's keys."""
    store = MemStore()
    with ObjectWAL.open(store, node_id=1, config=cfg()) as w:
        list(w.recover())
        w.append(payload(0)).result(5)
        fence = w.fence_seq
    seqs = [h.seq for h in store.headers() if h.kind == KIND_DATA]
    assert seqs == [fence + DATA_GAP + 1]


def test_a_stuck_put_is_hedged():
    """After 20 quick PUTs, one PUT hangs (its attempt blocks until the test lets it go): a twin
    PUT of the same object races it and the records are acknowledged while the first attempt
    still hangs; when it lands later it is refused and reads back our bytes. Nothing is lost."""
    store = MemStore()
    release = threading.Event()
    stuck: list[str] = []

    def gate(key):
        if "probe" in key or len(stuck) or store.puts < 25:
            return None
        stuck.append(key)
        return release

    with ObjectWAL.open(store, node_id=1, config=cfg(put_interval=0)) as w:
        list(w.recover())
        for i in range(25):
            w.append(payload(i)).result(5)
        store.gate = gate
        h = w.append(payload(25))
        assert h.result(5) >= 0, "acknowledged through the hedge while the first PUT hangs"
        assert stuck and not release.is_set()
        assert w.stats()["put_hedges"] >= 1
        release.set()
        for i in range(26, 40):
            w.append(payload(i)).result(5)
    assert recover_all(store) == [payload(i) for i in range(40)]


class HoldingStore(MemStore):
    """A MemStore that holds the DATA PUTs of one writer generation (`held_generation`) until
    `release()`: a writer paused, or its requests stuck in the network, for as long as the
    test likes."""

    def __init__(self) -> None:
        super().__init__()
        self.held_generation: int | None = None
        self.held: list[threading.Event] = []
        self.released = threading.Event()

    def put_if_absent(self, key, data) -> bool:
        if self.held_generation is not None and "probe" not in key:
            header = ObjectHeader.decode(bytes(data[:HEADER_BYTES]), key)
            if header.kind == KIND_DATA and header.generation == self.held_generation:
                ev = threading.Event()
                with self.lock:
                    self.held.append(ev)
                ev.wait(30)
        return super().put_if_absent(key, data)

    def release(self) -> None:
        with self.lock:
            held = list(self.held)
        for ev in held:
            ev.set()


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("WAL_TRIM_FENCE_SEEDS", "16"))))
def test_a_fence_holds_against_any_trim_schedule(seed):
    """Issue 50, item 1: a writer whose PUTs are held (paused) while one to three later
    sessions open its log, append, trim at random points and close (their trimmers delete what
    they may) must still be refused when its PUTs land at last, however late: nothing it
    acknowledges after its fence is missing from the log. Before the fix a session's trimmer
    deleted the HOLE that fenced the writer, and the writer's late PUT there was acknowledged
    and lost. Every record a session acknowledged is replayed by the next, and the last
    recovery replays a suffix of all of them holding every record above the last trim."""
    rng = random.Random(seed)
    store = HoldingStore()
    zombie = ObjectWAL.open(store, node_id=1, config=cfg(puts_in_flight=rng.choice([1, 2, 4, 8]), object_bytes=8192,
                                                         buffers=16))
    list(zombie.recover())
    acked: list[tuple[int, bytes]] = []          # (offset, data) acknowledged, in log order
    for i, h in [(i, zombie.append(payload(i))) for i in range(50)]:
        acked.append((h.result(5), payload(i)))
    store.held_generation = zombie.generation
    late = [(payload(1000 + i), zombie.append(payload(1000 + i))) for i in range(rng.randint(1, 60))]
    deadline = time.monotonic() + 5
    while not store.held and time.monotonic() < deadline:
        time.sleep(0.001)
    # Some held PUTs land before the first session opens, in random order.
    with store.lock:
        early = rng.sample(store.held, rng.randint(0, len(store.held) - 1))
    for ev in early:
        ev.set()
    time.sleep(0.02)
    first_replay: list[bytes] | None = None
    last_trim = 0
    n = 2000
    for _ in range(rng.randint(1, 3)):
        w = ObjectWAL.open(store, node_id=1, config=cfg(capacity=rng.choice([1, 4]) * MiB))
        replayed = [r.data for r in w.recover()]
        if first_replay is None:
            first_replay = replayed
        handles = []
        for _ in range(rng.randint(0, 400)):
            handles.append((payload(n), w.append(payload(n))))
            n += 1
            if rng.random() < 0.02:
                # Trims fall on record starts, as the engine's do: at a record acknowledged lately.
                done = [h.result(5) for _, h in handles[-rng.randint(1, len(handles)):][:1]]
                last_trim = max(last_trim, done[0], w.trim_offset)
                w.trim(last_trim)
        for data, h in handles:
            acked.append((h.result(5), data))
        w.close()                         # its trimmer has deleted all it would
    store.release()
    store.held_generation = None
    late_acked = []
    for data, h in late:
        try:
            h.result(10)
            late_acked.append(data)
        except wal.WALError:
            pass
    zombie.close()
    assert first_replay is not None
    missing = [d for d in late_acked if d not in first_replay]
    assert missing == [], f"the fenced writer acknowledged {len(missing)} records no later session replays"
    final = recover_all(store)
    datas = [d for _, d in acked]
    # The zombie's early-landed (acknowledged) records belong to the log too, right after its 50.
    expected = datas[:50] + [d for d in late_acked] + datas[50:]
    start = len(expected) - len(final)
    assert start >= 0 and final == expected[start:], "the last recovery replays a suffix of everything acknowledged"
    above = [d for off, d in acked if off >= last_trim]
    assert set(above) <= set(final), "every record above the last trim is replayed"


def test_holes_are_kept_and_old_markers_not_read_at_open():
    """Each open that fences a writer mid-session leaves a HOLE that no later session deletes;
    an open reads the headers of the newest objects only, not of every marker ever left."""
    store = MemStore()
    for i in range(30):
        w = ObjectWAL.open(store, node_id=1, config=cfg())
        list(w.recover())
        w.append(payload(i)).result(5)
        w.trim(w.append(payload(100 + i)).result(5))     # everything before this record
        w.append(payload(200 + i)).result(5)     # stamps the trim
        # Not closed: the next open fences this session while it lives, and its walk puts a HOLE.
    w.close()
    kinds = [h.kind for h in store.headers()]
    assert kinds.count(KIND_HOLE) == 29, kinds   # every open but the first walked a session
    counting = MemStore()
    counting.objects = store.objects
    reads: list[str] = []
    orig_get = counting.get

    def get(key, start=0, end=None):
        reads.append(key)
        return orig_get(key, start, end)

    counting.get = get
    hole_keys = {object_key(1, h.seq) for h in store.headers() if h.kind == KIND_HOLE}
    with ObjectWAL.open(counting, node_id=1, recovery=True, config=cfg(recovery_threads=4)) as peer:
        assert [r.data for r in peer.recover()] == [payload(129), payload(229)]
    # Headers are read newest first, recovery_threads at a time, until the newest FENCE: old
    # HOLEs are read only when they fall in that last batch.
    assert len(hole_keys & set(reads)) <= 4, "old HOLEs are not read at open"
