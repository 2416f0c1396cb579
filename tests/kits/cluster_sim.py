"""A deterministic simulation of the cluster protocol (issue 32, item 5).

The real protocol code runs unchanged: NodeAgent (lease keeper, failure detection, failover
claims, reconciliation), Cluster (assign, migrate with its fallback, fail_over, forget, the
history) and the partitions (s3stream.cluster.partition: open, checkpoints, truthful close).
Around it everything is simulated, on one seeded scheduler:

- time: a simulated clock; every node's threads are greenlets that run one at a time, switching
  only where the real code waits (sleep, an event, a future, a metadata call), so a seed
  replays exactly;
- the metadata store: in memory, with the MetadataStore contract's fencing, ownership,
  contiguity and reservation checks; every call takes a seeded latency before and after it is
  applied (a node can be paused or crash with its call landed but unanswered) and fails while
  the store is down for everyone or for that node;
- the engine of each node (SimClient): a WAL (records durable after a seeded latency, kept
  across restarts, gone with a lost host), acknowledgments under the lease by the native
  rule (durable before the deadline, else held until a renewal, failed on the fence), offset
  reservations, uploads that commit to the metadata (failing while the object store is down),
  close that says only what happened, restart recovery and failover replay (Cluster's
  `recover`);
- faults, at any scheduling point: pauses of a node (its greenlets and timers freeze), crashes
  and restarts on the same WAL, a lost host followed by `forget`, metadata outages (global or
  one node's), object-store stalls, migrations from an admin (who, when a migration finds its
  source alive and holding on, fails that source over on purpose, as the error tells an operator to).

At the end the faults stop, the cluster settles, and the checker compares every acknowledged
record with what is readable: lost, overwritten, duplicated, offsets acknowledged twice, false
failovers (from the failover history: a node failed over while nothing was wrong with it),
nodes that never recovered. A failing seed prints its trace.

    python3 tests/kits/cluster_sim.py --seeds 0-9999 [--workers 2] [--mutant NAME]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import time as _time
import traceback
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import greenlet
from greenlet import getcurrent
from heapq import heappop, heappush

from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, partitions_on
from s3stream.cluster.partition import PartitionMovedError
from s3stream.errors import (
    LeaseExpiredError, MetadataBusyError, MetadataError, NodeAliveError, ObjectStoreError, OperationTimeoutError, S3StreamError,
    StreamClosedError, StreamFencedError, StreamNotClosedError, StreamNotFoundError, WALError,
)
from s3stream.engine.failover import FailoverReport
from s3stream.metadata import ChangeFeed, MetadataStore, NodeMeta, Range, StreamMeta, StreamState
from s3stream.batches import FetchedBatch, FetchResult

MS = 1_000_000
S = 1_000_000_000


class Killed(BaseException):
    """Thrown into the greenlets of a crashed node when the world shuts down."""


# ---- the scheduler -----------------------------------------------------------------------------

class Thread(greenlet.greenlet):
    """A simulated thread of one node (or of the admin, node None)."""

    def __init__(self, hub: "Hub", node: Any, name: str, target: Callable[[], None]) -> None:
        super().__init__(self._main, parent=hub.main)
        self.hub, self.node, self.name, self.target = hub, node, name, target
        self.finished = False
        self.joiners: list[Wait] = []

    def _main(self, *_args) -> None:
        try:
            self.target()
        except Killed:
            pass
        except BaseException as e:      # noqa: BLE001 - a thread dying of an error is a finding
            self.hub.errors.append(f"{self.name}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            self.finished = True
            for w in self.joiners:
                self.hub.wake(w, True)

    def join(self, timeout: float | None = None) -> None:
        if not self.finished:
            w = Wait(self.hub)
            self.joiners.append(w)
            w.block(timeout)


class Wait:
    """One blocking wait of the current thread: woken once (by `wake` or its timeout)."""

    __slots__ = ("hub", "thread", "done", "value")

    def __init__(self, hub: "Hub") -> None:
        self.hub = hub
        self.thread = getcurrent()
        self.done = False
        self.value: Any = None

    def block(self, timeout: float | None = None) -> Any:
        hub = self.hub
        if timeout is not None:
            delay = int(timeout * S)
            if delay > 0:
                hub._seq += 1
                heappush(hub._queue, (hub.now + delay, hub._seq, self.thread.node, _TIMEOUT, self, False))
            else:
                hub._ready.append((self.thread.node, _TIMEOUT, self, False))
        return hub.main.switch()


# What a scheduled step does (Hub.run dispatches on it rather than calling a closure per step):
_SWITCH = 0     # a: the thread to switch to, b: the value its wait returns
_SLEPT = 1      # a: the thread whose sleep ends: it is switched to at the same time, as a step of its own
_TIMEOUT = 2    # a: the Wait that times out (woken with b), unless it was woken before
_CALL = 3       # a: a function of no arguments


class Hub:
    """Runs the threads one at a time in simulated time, in an order set by the seed.

    Steps run in the order of (time, order of scheduling). Most steps are scheduled for the
    current time (a thread woken, spawned): those wait in a FIFO (`_ready`) rather than the heap.
    Anything in the heap at the current time was scheduled before them (the heap holds only
    steps that were in the future when scheduled), so the heap's steps at the current time run
    first, then the FIFO's, then time moves on: the same order as one heap of every step."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0
        self.main = getcurrent()
        self._queue: list[tuple[int, int, Any, int, Any, Any]] = []   # (when, seq, node, kind, a, b)
        self._ready: collections.deque[tuple[Any, int, Any, Any]] = collections.deque()   # (node, kind, a, b) at now
        self._seq = 0
        self.paused: dict[Any, int] = {}          # node -> simulated time it resumes at
        self.dead: set[Any] = set()               # incarnations whose threads never run again
        self.threads: list[Thread] = []
        self.errors: list[str] = []
        self.trace: list[str] = []
        self.steps = 0

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now / S:9.4f} {text}")

    def push(self, when: int, node: Any, kind: int, a: Any, b: Any = None) -> None:
        """Schedule a step of `kind` at simulated time `when` (deferred while `node` is paused;
        dropped if dead)."""
        if when == self.now:
            self._ready.append((node, kind, a, b))
        else:
            self._seq += 1
            heappush(self._queue, (when, self._seq, node, kind, a, b))

    def at(self, when: int, fn: Callable[[], None], node: Any = None) -> None:
        """Run `fn` at simulated time `when` (deferred while `node` is paused; dropped if dead)."""
        self.push(when, node, _CALL, fn)

    def spawn(self, node: Any, name: str, target: Callable[[], None]) -> Thread:
        thread = Thread(self, node, name, target)
        self.threads.append(thread)
        self.push(self.now, node, _SWITCH, thread)
        return thread

    def wake(self, wait: Wait, value: Any) -> None:
        if wait.done:
            return
        wait.done = True
        wait.value = value
        thread = wait.thread
        self._ready.append((thread.node, _SWITCH, thread, value))       # type: ignore[attr-defined]

    def suspend(self) -> Any:
        """Give the processor back to the scheduler until woken."""
        return self.main.switch()

    def sleep(self, seconds: float) -> None:
        thread = getcurrent()
        delay = int(seconds * S)
        if delay > 0:               # push(), inlined: the most frequent step
            self._seq += 1
            heappush(self._queue, (self.now + delay, self._seq, thread.node, _SLEPT, thread, None))  # type: ignore[attr-defined]
        else:
            self._ready.append((thread.node, _SLEPT, thread, None))                                   # type: ignore[attr-defined]
        self.main.switch()

    def run(self, until: int) -> None:
        queue, ready, dead, paused = self._queue, self._ready, self.dead, self.paused
        popleft = ready.popleft
        steps = self.steps
        now = self.now
        try:
            while True:
                if queue and queue[0][0] <= now:
                    when, _, node, kind, a, b = heappop(queue)
                elif ready:
                    node, kind, a, b = popleft()
                    when = now
                elif queue and queue[0][0] <= until:
                    when, _, node, kind, a, b = heappop(queue)
                else:
                    break
                if node in dead:
                    continue
                if paused:
                    resume = paused.get(node)
                    if resume is not None and resume > when:
                        self.push(resume, node, kind, a, b)
                        continue
                if when > now:
                    self.now = now = when
                steps += 1
                if kind == _SWITCH:
                    if not a.finished:
                        a.switch(b)
                elif kind == _SLEPT or kind == _TIMEOUT:
                    if kind == _TIMEOUT:
                        if a.done:
                            continue
                        a.done = True
                        a.value = b
                        a = a.thread
                    if ready or (queue and queue[0][0] <= now):
                        ready.append((node, _SWITCH, a, b))
                    else:
                        # The switch would be the very next step: take it now (a step of its own
                        # all the same, with its node neither dead nor paused, as just checked).
                        steps += 1
                        if not a.finished:
                            a.switch(b)
                else:
                    a()
        finally:
            self.steps = steps
        if until > now:
            self.now = until

    def shutdown(self) -> None:
        for thread in self.threads:
            if not thread.finished:
                try:
                    thread.throw(Killed())
                except Killed:
                    pass
                except BaseException:      # noqa: BLE001 - shutting down: anything goes
                    pass


class SimEvent:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.flag = False
        self.waiters: list[Wait] = []

    def set(self) -> None:
        self.flag = True
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            self.hub.wake(w, True)

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        if self.flag:
            return True
        w = Wait(self.hub)
        self.waiters.append(w)
        w.block(timeout)
        if w in self.waiters:
            self.waiters.remove(w)
        return self.flag


class SimExecutor:
    """At most `workers` tasks of one node at once, each a thread; the rest queue."""

    def __init__(self, hub: Hub, node: Any, workers: int, name: str) -> None:
        self.hub, self.node, self.workers, self.name = hub, node, workers, name
        self.running = 0
        self.queued: list[Callable[[], object]] = []
        self.closed = False

    def submit(self, fn: Callable[[], object]) -> None:
        if self.closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        self.queued.append(fn)
        self._start()

    def _start(self) -> None:
        while self.queued and self.running < self.workers:
            fn = self.queued.pop(0)
            self.running += 1

            def body(fn=fn) -> None:
                try:
                    fn()
                finally:
                    self.running -= 1
                    self._start()
            self.hub.spawn(self.node, self.name, body)

    def shutdown(self, wait: bool = True) -> None:
        self.closed = True
        self.queued.clear()


class SimRuntime:
    """s3stream.cluster.runtime.Runtime on the simulation, for one node's incarnation."""

    WALL_BASE = 1_700_000_000 * S

    def __init__(self, hub: Hub, node: Any) -> None:
        self.hub, self.node = hub, node

    def monotonic_ns(self) -> int:
        return self.hub.now

    def wall_ns(self) -> int:
        return self.WALL_BASE + self.hub.now

    def sleep(self, seconds: float) -> None:
        self.hub.sleep(seconds)

    def event(self) -> SimEvent:
        return SimEvent(self.hub)

    def spawn(self, name: str, target: Callable[[], None]) -> Thread:
        return self.hub.spawn(self.node, name, target)

    def executor(self, workers: int, name: str) -> SimExecutor:
        return SimExecutor(self.hub, self.node, workers, name)


# ---- the metadata store ------------------------------------------------------------------------

@dataclasses.dataclass
class _Stream:
    stream_id: int
    epoch: int = 0
    state: StreamState = StreamState.OPENED
    owner: int | None = None
    start: int = 0
    end: int = 0
    reserved: int = 0
    ranges: list = dataclasses.field(default_factory=list)     # [node, epoch, start, end, lost]
    data: dict = dataclasses.field(default_factory=dict)       # offset -> (count, payload)


class SimFeed(ChangeFeed):
    pushes = True

    def __init__(self, world: "World", prefixes: Sequence[str]) -> None:
        super().__init__(prefixes)
        self.world = world
        self.event = SimEvent(world.hub)
        world.feeds.append(self)

    def wait(self, timeout: float) -> bool:
        woken = self.event.wait(timeout)
        self.event.clear()
        return woken

    def wake(self) -> None:
        self.event.set()

    def close(self) -> None:
        self.wake()
        if self in self.world.feeds:
            self.world.feeds.remove(self)


class SimMetadata(MetadataStore):
    """The shared metadata, in memory. Calls are made by the current thread's node."""

    def __init__(self, world: "World") -> None:
        self.world = world

    # -- every call: latency, faults, then the change, then latency back ---------------------------

    def _call(self, op: str, fn: Callable[[], Any]) -> Any:
        world = self.world
        hub = world.hub
        draw = hub.rng.random        # rng.uniform(a, b) is a + (b - a) * random(): the same draws, a call less
        node = getattr(getcurrent(), "node", None)
        hub.sleep(0.0002 + (0.002 - 0.0002) * draw())
        if world.meta_down or node in world.meta_cut:
            hub.sleep(0.001 + (0.05 - 0.001) * draw())
            raise MetadataBusyError(f"sim: the metadata store is unreachable from node {node} ({op})")
        result = fn()
        world.ops += 1
        world.buggify(op, node)
        hub.sleep(0.0002 + (0.002 - 0.0002) * draw())
        return result

    def _node(self, node_id: int) -> dict:
        node = self.world.nodes.get(node_id)
        if node is None:
            raise MetadataError(f"node {node_id} is not registered")
        return node

    def _check_epoch(self, node_id: int, node_epoch: int) -> None:
        current = self._node(node_id)["epoch"]
        if current != node_epoch:
            raise StreamFencedError(f"node {node_id} epoch {node_epoch} is fenced (current {current})")

    def _stream(self, stream_id: int) -> _Stream:
        s = self.world.streams.get(stream_id)
        if s is None:
            raise StreamNotFoundError(f"stream {stream_id} does not exist")
        return s

    @staticmethod
    def _check_owner(s: _Stream, epoch: int, node_id: int) -> None:
        if s.state != StreamState.OPENED or s.epoch != epoch or s.owner != node_id:
            raise StreamFencedError(f"stream {s.stream_id} epoch {epoch} on node {node_id} is fenced "
                                    f"({s.state.value} at epoch {s.epoch} on node {s.owner})")

    @staticmethod
    def meta_of(s: _Stream) -> StreamMeta:
        return StreamMeta(s.stream_id, s.epoch, s.state, s.owner, s.start, s.end,
                          tuple(Range(i, *r) for i, r in enumerate(s.ranges)), s.reserved)

    def _node_meta(self, node_id: int) -> NodeMeta:
        n = self._node(node_id)
        meta = n["meta"]           # NodeMeta is frozen: one per state of the record (every write resets it)
        if meta is None:
            meta = n["meta"] = NodeMeta(node_id, n["epoch"], n["failover"], f"/sim/{node_id}", n["heartbeat"],
                                        n["health"])
        return meta

    # -- nodes -------------------------------------------------------------------------------------

    def register_node(self, node_id: int, wal_path: str) -> NodeMeta:
        def apply() -> NodeMeta:
            n = self.world.nodes.get(node_id)
            epoch = 0 if n is None else n["epoch"] + 1
            self.world.nodes[node_id] = dict(epoch=epoch, failover=False, heartbeat=self.world.wall(), health=None,
                                            meta=None)
            return self._node_meta(node_id)
        return self._call("register_node", apply)

    def get_node(self, node_id: int) -> NodeMeta:
        return self._call("get_node", lambda: self._node_meta(node_id))

    def list_nodes(self) -> list[NodeMeta]:
        return self._call("list_nodes", lambda: [self._node_meta(n) for n in sorted(self.world.nodes)])

    def heartbeat(self, node_id: int, node_epoch: int, health: str | None = None) -> None:
        def apply() -> None:
            self._check_epoch(node_id, node_epoch)
            self.world.nodes[node_id].update(heartbeat=self.world.wall(), health=health, meta=None)
        self._call("heartbeat", apply)

    def fence_node(self, node_id: int, failover: bool = True,
                   if_unchanged: tuple[int, int] | None = None) -> NodeMeta:
        def apply() -> NodeMeta:
            n = self._node(node_id)
            if if_unchanged is not None and (n["epoch"], n["heartbeat"]) != tuple(if_unchanged):
                raise NodeAliveError(f"sim: node {node_id} heartbeated since it was judged")
            n.update(epoch=n["epoch"] + 1, failover=failover, meta=None)
            self.world.hub.log(f"fence node {node_id} -> epoch {n['epoch']}")
            return self._node_meta(node_id)
        return self._call("fence_node", apply)

    # -- streams -----------------------------------------------------------------------------------

    def create_stream(self, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        def apply() -> StreamMeta:
            self._check_epoch(node_id, node_epoch)
            sid = self.world.next_stream_id
            self.world.next_stream_id += 1
            s = _Stream(sid, owner=node_id, reserved=reserve, ranges=[[node_id, 0, 0, 0, False]])
            self.world.streams[sid] = s
            return self.meta_of(s)
        return self._call("create_stream", apply)

    def create_streams(self, count: int, node_id: int, node_epoch: int, reserve: int = 0) -> list[StreamMeta]:
        def apply() -> list[StreamMeta]:
            self._check_epoch(node_id, node_epoch)
            made = []
            for _ in range(count):
                sid = self.world.next_stream_id
                self.world.next_stream_id += 1
                s = self.world.streams[sid] = _Stream(sid, owner=node_id, reserved=reserve,
                                                      ranges=[[node_id, 0, 0, 0, False]])
                made.append(self.meta_of(s))
            return made
        return self._call("create_streams", apply)

    def open_stream(self, stream_id: int, node_id: int, node_epoch: int, reserve: int = 0) -> StreamMeta:
        return self._open([stream_id], node_id, node_epoch, reserve, "open_stream")[0]

    def open_streams(self, stream_ids, node_id: int, node_epoch: int, reserve: int = 0) -> list[StreamMeta]:
        return self._open(list(stream_ids), node_id, node_epoch, reserve, "open_streams")

    def _open(self, stream_ids: list[int], node_id: int, node_epoch: int, reserve: int, op: str) -> list[StreamMeta]:
        def apply() -> list[StreamMeta]:
            self._check_epoch(node_id, node_epoch)
            for stream_id in stream_ids:             # all or none
                s = self._stream(stream_id)
                if s.state == StreamState.DELETED:
                    raise StreamNotFoundError(f"stream {stream_id} was deleted")
                if s.state == StreamState.OPENED and s.owner != node_id:
                    raise StreamNotClosedError(f"stream {stream_id} is open on node {s.owner}")
            out = []
            for stream_id in stream_ids:
                s = self._stream(stream_id)
                s.epoch += 1
                last = s.ranges[-1]
                if last[2] == last[3] and not last[4]:
                    s.ranges[-1] = [node_id, s.epoch, s.end, s.end, False]
                else:
                    s.ranges.append([node_id, s.epoch, s.end, s.end, False])
                s.state, s.owner, s.reserved = StreamState.OPENED, node_id, s.end + reserve
                out.append(self.meta_of(s))
            return out
        return self._call(op, apply)

    def reserve_offsets(self, stream_id: int, epoch: int, node_id: int, node_epoch: int,
                        reserved_end: int) -> StreamMeta:
        def apply() -> StreamMeta:
            self._check_epoch(node_id, node_epoch)
            s = self._stream(stream_id)
            self._check_owner(s, epoch, node_id)
            s.reserved = max(s.reserved, reserved_end)
            return self.meta_of(s)
        return self._call("reserve_offsets", apply)

    def abandon_stream(self, stream_id: int, epoch: int, node_id: int) -> StreamMeta:
        def apply() -> StreamMeta:
            s = self._stream(stream_id)
            if s.state == StreamState.CLOSED and s.epoch == epoch:
                return self.meta_of(s)
            self._check_owner(s, epoch, node_id)
            if s.reserved > s.end:
                s.ranges.append([node_id, epoch, s.end, s.reserved, True])
                s.end = s.reserved
            s.state, s.owner = StreamState.CLOSED, None
            return self.meta_of(s)
        return self._call("abandon_stream", apply)

    def close_stream(self, stream_id: int, epoch: int, node_id: int, node_epoch: int | None = None) -> StreamMeta:
        def apply() -> StreamMeta:
            if node_epoch is not None and self.world.mutant != "close-any-incarnation":
                self._check_epoch(node_id, node_epoch)
            s = self._stream(stream_id)
            if s.state == StreamState.CLOSED and s.epoch == epoch:
                return self.meta_of(s)
            self._check_owner(s, epoch, node_id)
            s.state, s.owner = StreamState.CLOSED, None
            return self.meta_of(s)
        return self._call("close_stream", apply)

    def trim_stream(self, stream_id: int, epoch: int, new_start_offset: int) -> StreamMeta:
        def apply() -> StreamMeta:
            s = self._stream(stream_id)
            if epoch != s.epoch:
                raise StreamFencedError(f"stream {stream_id} epoch {epoch} is fenced (current {s.epoch})")
            s.start = max(s.start, new_start_offset)
            return self.meta_of(s)
        return self._call("trim_stream", apply)

    def delete_stream(self, stream_id: int, epoch: int) -> StreamMeta:
        def apply() -> StreamMeta:
            s = self._stream(stream_id)
            if epoch != s.epoch:
                raise StreamFencedError(f"stream {stream_id} epoch {epoch} is fenced")
            s.state, s.owner = StreamState.DELETED, None
            return self.meta_of(s)
        return self._call("delete_stream", apply)

    def get_stream(self, stream_id: int) -> StreamMeta:
        return self._call("get_stream", lambda: self.meta_of(self._stream(stream_id)))

    def _get_streams(self, stream_ids: list[int]) -> list[StreamMeta]:
        return [self.meta_of(self.world.streams[i]) for i in stream_ids if i in self.world.streams]

    def list_streams(self, include_deleted: bool = False, owner_node_id: int | None = None,
                     last_range: bool = False) -> list[StreamMeta]:
        def apply() -> list[StreamMeta]:
            out = []
            for sid in sorted(self.world.streams):
                s = self.world.streams[sid]
                if owner_node_id is not None and (s.owner != owner_node_id or s.state != StreamState.OPENED):
                    continue
                if s.state == StreamState.DELETED and not include_deleted:
                    continue
                m = self.meta_of(s)
                out.append(dataclasses.replace(m, ranges=m.ranges[-1:]) if last_range else m)
            return out
        return self._call("list_streams", apply)

    def commit_records(self, node_id: int, node_epoch: int, writes: list[tuple[int, int, list]]) -> dict[int, int]:
        """The simulation's upload: per stream (id, epoch, [(base, count, payload), ...])
        contiguous from its end, committed atomically with the contract's fencing."""
        def apply() -> dict[int, int]:
            self._check_epoch(node_id, node_epoch)
            for sid, epoch, batches in writes:
                s = self._stream(sid)
                self._check_owner(s, epoch, node_id)
                if batches[0][0] != s.end:
                    raise MetadataError(f"stream {sid}: commit at {batches[0][0]} is not at its end {s.end}")
            ends = {}
            for sid, epoch, batches in writes:
                s = self._stream(sid)
                for base, count, payload in batches:
                    s.data[base] = (count, payload)
                    s.end = base + count
                s.ranges[-1][3] = s.end
                ends[sid] = s.end
            return ends
        return self._call("commit", apply)

    # -- KV ----------------------------------------------------------------------------------------

    def _changed(self, key: str) -> None:
        for feed in list(self.world.feeds):
            if key.startswith(feed.prefixes):
                feed.wake()

    def get_kv(self, key: str) -> bytes | None:
        return self._call("get_kv", lambda: self.world.kv.get(key))

    def put_kv(self, key: str, value: bytes) -> None:
        def apply() -> None:
            self.world.kv[key] = bytes(value)
            self._changed(key)
        self._call("put_kv", apply)

    def put_kv_if_absent(self, key: str, value: bytes) -> bytes:
        def apply() -> bytes:
            if key not in self.world.kv:
                self.world.kv[key] = bytes(value)
                self._changed(key)
            return self.world.kv[key]
        return self._call("put_kv_if_absent", apply)

    def replace_kv(self, key: str, expected: bytes | None, value: bytes,
                   guard: tuple[str, bytes] | None = None) -> bool:
        def apply() -> bool:
            if self.world.kv.get(key) != expected or (guard is not None and self.world.kv.get(guard[0]) != guard[1]):
                return False
            self.world.kv[key] = bytes(value)
            self._changed(key)
            return True
        return self._call("replace_kv", apply)

    def delete_kv(self, key: str) -> None:
        def apply() -> None:
            self.world.kv.pop(key, None)
            self._changed(key)
        self._call("delete_kv", apply)

    def list_kv(self, prefix: str) -> dict[str, bytes]:
        kv = self.world.kv
        return self._call("list_kv", lambda: {k: kv[k] for k in sorted(k for k in kv if k.startswith(prefix))})

    def kv_changes(self, prefixes: Sequence[str]) -> ChangeFeed:
        return SimFeed(self.world, prefixes)

    # -- not used by the protocol --------------------------------------------------------------------

    def _unused(self, *args, **kw):
        raise NotImplementedError("not simulated")

    prepare_objects = commit = get_object = list_objects = get_object_refs = _unused          # type: ignore[assignment]
    node_stream_set_objects = mark_destroyed = objects_to_delete = remove_objects = _unused   # type: ignore[assignment]


# ---- the engine of one node ----------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Rec:
    """An appended record: durable once `durable_at` is set, then acknowledged or failed."""
    node: int
    stream_id: int
    epoch: int
    base: int
    count: int
    payload: bytes
    durable_at: int | None = None
    acked_at: int | None = None
    error: BaseException | None = None


class SimResult:
    def __init__(self, base_offset: int) -> None:
        self.base_offset = base_offset


class SimFuture:
    def __init__(self, client: "SimClient", rec: Rec) -> None:
        self.client, self.rec = client, rec
        self.base_offset = rec.base

    def done(self) -> bool:
        return self.rec.acked_at is not None or self.rec.error is not None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        hub = self.client.world.hub
        deadline = None if timeout is None else hub.now + int(timeout * S)
        rec = self.rec
        while rec.acked_at is None and rec.error is None:        # not done()
            if deadline is not None and hub.now >= deadline:
                raise OperationTimeoutError(f"append at {self.rec.base} not acknowledged after {timeout} s")
            self.client.wait_change(None if deadline is None else (deadline - hub.now) / S)
        return self.rec.error

    def result(self, timeout: float | None = None) -> SimResult:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return SimResult(self.rec.base)

    @property
    def completed_ns(self) -> int | None:
        return self.rec.acked_at


class SimStream:
    """What the partitions use of a Stream handle."""

    def __init__(self, client: "SimClient", meta: StreamMeta) -> None:
        self.client = client
        self.stream_id, self.epoch = meta.stream_id, meta.epoch
        self.next_offset = meta.end_offset
        self.committed_offset = meta.end_offset
        self.start_offset = meta.start_offset
        self.reserved_end = max(meta.reserved_end, meta.end_offset)
        self.state = "open"
        self.records: list[Rec] = []        # appended here, not yet committed

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    @property
    def confirm_offset(self) -> int:
        confirmed = self.committed_offset
        for rec in self.records:
            if rec.acked_at is None:
                break
            confirmed = rec.base + rec.count
        return max(confirmed, self.committed_offset)

    def append(self, batch) -> SimFuture:
        return self.client.append(self, batch.payload, batch.count)

    def flush(self, timeout: float | None = None) -> None:
        for rec in list(self.records):
            SimFuture(self.client, rec).result(timeout)

    def destroy(self) -> None:
        """A partition's creation that lost the race to publish its meta stream deletes its own."""
        self.client._check(self)
        self.state = "closing"
        try:
            self.client.metadata.delete_stream(self.stream_id, self.epoch)
        finally:
            self.state = "closed"
            self.client.streams.pop(self.stream_id, None)

    def trim(self, offset: int) -> None:
        if offset > self.start_offset:
            self.client.metadata.trim_stream(self.stream_id, self.epoch, offset)
            self.start_offset = offset

    def metadata(self) -> StreamMeta:
        return self.client.metadata.get_stream(self.stream_id)

    def fetch(self, start: int, end: int | None = None, max_bytes: int = 1 << 20) -> FetchResult:
        from s3stream.errors import OffsetsLostError
        if self.state == "fenced":
            raise StreamFencedError(f"stream {self.stream_id} was fenced")
        end = self.confirm_offset if end is None else end
        world = self.client.world
        stored = world.streams[self.stream_id]
        out = []
        pos = start
        local = {r.base: r for r in self.records}
        while pos < end:
            if pos in stored.data:
                count, payload = stored.data[pos]
            elif pos in local:
                count, payload = local[pos].count, local[pos].payload
            else:
                for node, epoch, lo, hi, lost in stored.ranges:
                    if lost and lo <= pos < hi:
                        raise OffsetsLostError(self.stream_id, lo, hi, node)
                raise S3StreamError(f"sim: stream {self.stream_id} has nothing at {pos}")
            out.append(FetchedBatch(pos, count, memoryview(payload)))
            pos += count
        return FetchResult(out)


class _EngineConfig:
    offset_reservation = 64


class SimClient:
    """One incarnation of a node's engine (the surface of StreamClient the cluster layer uses)."""

    def __init__(self, world: "World", node_id: int, incarnation: Any) -> None:
        self.world = world
        self.node_id = node_id
        self.incarnation = incarnation
        self.metadata = world.meta
        self.config = _EngineConfig()
        self.node_epoch = -1
        self.streams: dict[int, SimStream] = {}
        self.addons: dict[str, Any] = {}
        self.lease_until: int | None = None
        self.fenced = False
        self.closed = False
        self.fence_reason = ""
        self.waiters: list[Wait] = []
        self.last_durable = 0
        self.upload_failing_since: int | None = None
        self.upload_failing = ""
        self.broken = False              # uploads stopped for good (a permanent error) until a restart
        self.force_upload = SimEvent(world.hub)

    # -- start: register and recover ----------------------------------------------------------------

    def start(self) -> None:
        self.node_epoch = self.metadata.register_node(self.node_id, f"/sim/{self.node_id}").node_epoch
        self.world.recover_wal(self.node_id, self.node_epoch, close=True)
        self.metadata.heartbeat(self.node_id, self.node_epoch)
        self.world.hub.spawn(self.incarnation, f"n{self.node_id}-upload", self._uploads)

    # -- the lease and the fence --------------------------------------------------------------------

    def renew_lease(self, renewed_ns: int, duration: float) -> None:
        until = renewed_ns + int(duration * S)
        if self.fenced or self.closed or (self.lease_until is not None and until <= self.lease_until):
            return
        self.lease_until = until
        self._advance_acks()

    def lease_renewal_failed(self, error) -> None:
        pass

    @property
    def lease_remaining(self) -> float | None:
        return None if self.lease_until is None else (self.lease_until - self.world.hub.now) / S

    def _lease_ok(self, now: int) -> bool:
        if self.world.mutant == "zombie-ack":
            return True
        return self.lease_until is None or now < self.lease_until

    def fence(self, reason: str) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.fence_reason = reason
        self.world.hub.log(f"node {self.node_id} fenced: {reason}")
        error = StreamFencedError(f"node {self.node_id} was fenced: {reason}")
        for stream in self.streams.values():
            stream.state = "fenced"
            for rec in stream.records:
                if rec.acked_at is None and rec.error is None:
                    rec.error = error
        self._notify()

    def health(self) -> dict:
        problems = []
        if self.closed:
            problems.append("closed")
        if self.fenced:
            problems.append(f"fenced: {self.fence_reason}")
        if self.broken:
            problems.append("uploads stopped: access denied (a permanent error)")
        out: dict = dict(serving=not problems, problems=problems)
        if self.upload_failing_since is not None:
            out.update(uploads_failing_seconds=(self.world.hub.now - self.upload_failing_since) / S,
                       uploads_failing=self.upload_failing)
        return out

    # -- acknowledgments ----------------------------------------------------------------------------

    def wait_change(self, timeout: float | None) -> None:
        w = Wait(self.world.hub)
        self.waiters.append(w)
        w.block(timeout)

    def _notify(self) -> None:
        waiters, self.waiters = self.waiters, []
        for w in waiters:
            self.world.hub.wake(w, True)

    def _durable(self, rec: Rec) -> None:
        rec.durable_at = self.world.hub.now
        self.world.wals[self.node_id].append(rec)
        self._advance_acks()

    def _advance_acks(self) -> None:
        now = self.world.hub.now
        if self.fenced or not self._lease_ok(now):
            return
        changed = False
        for stream in self.streams.values():
            for rec in stream.records:
                if rec.durable_at is None:
                    break
                if rec.acked_at is None and rec.error is None:
                    rec.acked_at = now
                    changed = True
        if changed:
            self._notify()

    # -- appends --------------------------------------------------------------------------------------

    def _check(self, stream: SimStream) -> None:
        if self.fenced or stream.state == "fenced":
            raise StreamFencedError(f"node {self.node_id} / stream {stream.stream_id} is fenced")
        if self.closed or stream.state != "open":
            raise StreamClosedError(f"stream {stream.stream_id} is {stream.state} on node {self.node_id}")

    def append(self, stream: SimStream, payload, count: int) -> SimFuture:
        hub = self.world.hub
        self._check(stream)
        if self.broken:
            raise S3StreamError("uploads stopped: access denied (a permanent error); appends are refused")
        if not self._lease_ok(hub.now):
            raise LeaseExpiredError(f"node {self.node_id}: lease ran out")
        while stream.next_offset + count > stream.reserved_end:
            meta = self.metadata.reserve_offsets(stream.stream_id, stream.epoch, self.node_id, self.node_epoch,
                                                 stream.next_offset + count + self.config.offset_reservation)
            stream.reserved_end = max(stream.reserved_end, meta.reserved_end)
            self._check(stream)
        rec = Rec(self.node_id, stream.stream_id, stream.epoch, stream.next_offset, count, bytes(payload))
        stream.next_offset += count
        stream.records.append(rec)
        self.last_durable = max(self.last_durable, hub.now + int(hub.rng.uniform(0.0002, 0.003) * S))
        hub.at(self.last_durable, lambda: self._durable(rec), self.incarnation)
        return SimFuture(self, rec)

    # -- uploads ------------------------------------------------------------------------------------

    def _uploads(self) -> None:
        hub = self.world.hub
        while not self.closed:
            self.force_upload.wait(hub.rng.uniform(0.2, 0.5))
            self.force_upload.clear()
            if self.fenced:
                return
            try:
                self.upload([s for s in self.streams.values() if s.state in ("open", "closing")])
            except S3StreamError:
                pass

    def upload(self, streams: Iterable[SimStream], carry: tuple = ()) -> None:
        """Commit what is durable of `streams` above their committed ends, and all of those in
        `carry` (a close's not_durable); raises if it fails."""
        hub = self.world.hub
        writes = []
        for stream in streams:
            carried = any(stream is c for c in carry)
            batch = [(r.base, r.count, r.payload) for r in stream.records if carried or r.durable_at is not None]
            durable = []
            for item in batch:
                if durable and item[0] != durable[-1][0] + durable[-1][1]:
                    break
                durable.append(item)
            if durable:
                writes.append((stream, durable))
        if not writes:
            self.upload_failing_since = None                  # nothing left that fails
            return
        if self.broken:
            raise ObjectStoreError("sim: uploads stopped for good")
        try:
            hub.sleep(hub.rng.uniform(0.001, 0.01))            # the PUT
            if self.world.store_down:
                hub.sleep(hub.rng.uniform(0.01, 0.2))
                raise ObjectStoreError("sim: the object store does not answer")
            ends = self.metadata.commit_records(self.node_id, self.node_epoch,
                                                [(s.stream_id, s.epoch, d) for s, d in writes])
        except StreamFencedError:
            node = self.metadata.get_node(self.node_id)
            if node.node_epoch != self.node_epoch:
                self.fence("its upload's commit was refused")
                raise
            for stream, _ in writes:                          # one moved away: drop it
                m = self.metadata.get_stream(stream.stream_id)
                if m.epoch != stream.epoch or m.owner_node_id != self.node_id:
                    stream.state = "fenced"
            raise
        except S3StreamError as e:
            if self.upload_failing_since is None:
                self.upload_failing_since = hub.now
            self.upload_failing = str(e)
            raise
        self.upload_failing_since = None
        for stream, _ in writes:
            end = ends[stream.stream_id]
            stream.committed_offset = max(stream.committed_offset, end)
            stream.records = [r for r in stream.records if r.base >= end]

    def unuploaded_bytes(self, stream: SimStream) -> int:
        return sum(len(r.payload) for r in stream.records)

    # -- streams ----------------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.fenced:
            raise StreamFencedError(f"node {self.node_id} is fenced")
        if self.closed:
            raise StreamClosedError(f"node {self.node_id} is closed")

    def create_stream(self) -> SimStream:
        self.check_usable()
        meta = self.metadata.create_stream(self.node_id, self.node_epoch, self.config.offset_reservation)
        stream = self.streams[meta.stream_id] = SimStream(self, meta)
        return stream

    def create_streams(self, count: int) -> list[SimStream]:
        self.check_usable()
        metas = self.metadata.create_streams(count, self.node_id, self.node_epoch, self.config.offset_reservation)
        made = []
        for meta in metas:
            made.append(SimStream(self, meta))
            self.streams[meta.stream_id] = made[-1]
        return made

    def open_stream(self, stream_id: int) -> SimStream:
        self.check_usable()
        if stream_id in self.streams:
            raise StreamNotClosedError(f"stream {stream_id} is already open here")
        meta = self.metadata.open_stream(stream_id, self.node_id, self.node_epoch, self.config.offset_reservation)
        stream = self.streams[stream_id] = SimStream(self, meta)
        return stream

    def open_streams(self, stream_ids: list[int]) -> list[SimStream]:
        self.check_usable()
        if any(sid in self.streams for sid in stream_ids):
            raise StreamNotClosedError(f"streams {stream_ids} are already open here")
        metas = self.metadata.open_streams(stream_ids, self.node_id, self.node_epoch, self.config.offset_reservation)
        for meta in metas:
            self.streams[meta.stream_id] = SimStream(self, meta)
        return [self.streams[meta.stream_id] for meta in metas]

    def fetch_committed_at(self, points) -> dict:
        """Nothing found together: each point is read alone (fetch_committed), from the world."""
        return {}

    def fetch_committed(self, stream_id: int, start: int, end: int | None = None,
                        max_bytes: int = 1 << 20, known: StreamMeta | None = None) -> FetchResult:
        """What is committed in the world's store (a reader that is not the owner); `known`
        (the caller's row of the stream) changes nothing here: the world is read directly."""
        stored = self.world.streams[stream_id]
        end = stored.end if end is None else end
        out, pos = [], start
        while pos < end and pos in stored.data:
            count, payload = stored.data[pos]
            out.append(FetchedBatch(pos, count, memoryview(payload)))
            pos += count
        return FetchResult(out)

    def opened(self, stream_id: int) -> SimStream | None:
        return self.streams.get(stream_id)

    def close_streams(self, streams: list, timeout: float | None = None, timing: dict | None = None,
                      kv: tuple = (), not_durable: tuple = ()) -> None:
        closing = [s for s in streams if s.state == "open"]
        for s in closing:
            s.state = "closing"
        closed = set()
        try:
            for s in closing:
                if not any(s is n for n in not_durable):
                    s.flush(timeout)
            hub = self.world.hub
            deadline = hub.now + int((timeout if timeout is not None else 5.0) * S)
            while any(s.records for s in closing):
                try:
                    self.upload(closing, carry=not_durable)
                except StreamFencedError:
                    raise
                except S3StreamError:
                    if hub.now >= deadline:
                        raise OperationTimeoutError("sim: the force upload did not commit in time")
                    hub.sleep(0.05)
            for s in closing:
                self.metadata.close_stream(s.stream_id, s.epoch, self.node_id)
                closed.add(s.stream_id)
            for key, value in kv if closing else ():      # the real store: in the closes' commit
                self.metadata.put_kv(key, value)
        finally:
            for s in closing:
                if s.stream_id in closed:
                    s.state = "closed"
                    self.streams.pop(s.stream_id, None)
                elif s.state == "closing":
                    s.state = "open"

    # -- partitions (the real table) ----------------------------------------------------------------

    def addon(self, key: str, make):
        if key not in self.addons:
            self.addons[key] = make(self)
        return self.addons[key]

    def find_addon(self, key: str):
        return self.addons.get(key)


# ---- the world: nodes, faults, workload, checker ----------------------------------------------------

LOST = "lost"     # a node's WAL gone with its host

CONFIG = ClusterConfig(agent_interval=0.02, push_fallback_interval=0.5, heartbeat_interval=0.2,
                       heartbeat_timeout=1.5, migration_timeout=3.0, max_parallel_moves=2, open_attempts=5,
                       unhealthy_grace=3.0, report_interval=60.0)


@dataclasses.dataclass
class Fault:
    kind: str
    target: Any
    start: int
    end: int


class Incarnation:
    """One run of a node: its engine, its agent and its producer."""

    def __init__(self, world: "World", node_id: int, number: int) -> None:
        self.world, self.node_id, self.number = world, node_id, number
        self.key = (node_id, number)
        self.client = SimClient(world, node_id, self.key)
        self.agent: NodeAgent | None = None

    def boot(self) -> None:
        world = self.world
        runtime = SimRuntime(world.hub, self.key)
        cluster = Cluster(world.meta, store=None, config=CONFIG, runtime=runtime, recover=world.recover)
        cluster.store = "sim"            # fail_over needs a store; the simulation's is implicit
        try:
            self.client.start()
            self.agent = NodeAgent(self.client, cluster)   # type: ignore[arg-type]
            world.agents.append(self.agent)
        except S3StreamError as e:
            world.hub.log(f"node {self.node_id} #{self.number} could not start: {e}")
            world.hub.at(world.hub.now + S, lambda: world.restart(self.node_id), None)
            return
        world.hub.spawn(self.key, f"n{self.node_id}-producer", self.produce)

    def produce(self) -> None:
        world, hub = self.world, self.world.hub
        seq = 0
        # A few partitions: one append at a time (the schedules the known seeds were found
        # with). Many (issue 53): an append to each, then their acknowledgments, so that every
        # partition takes one per round however many the node holds.
        together = len(world.partition_names) > PRODUCE_TOGETHER
        while True:
            pending = []
            for partition in sorted(partitions_on(self.client), key=lambda p: p.name):
                payload = f"{partition.name}|n{self.node_id}.{self.number}|{seq}".encode()
                seq += 1
                try:
                    future = partition.append(_Batch(payload))
                    if together:
                        pending.append((partition, payload, future))
                        continue
                    offset = future.result(1.0).base_offset
                except (PartitionMovedError, S3StreamError, OperationTimeoutError):
                    continue
                world.acks.append((partition.log.stream_id, offset, payload, hub.now))
                world.partition_acks[partition.name] = hub.now
            for partition, payload, future in pending:
                try:
                    offset = future.result(1.0).base_offset
                except (PartitionMovedError, S3StreamError, OperationTimeoutError):
                    continue
                world.acks.append((partition.log.stream_id, offset, payload, hub.now))
                world.partition_acks[partition.name] = hub.now
            hub.sleep(hub.rng.uniform(0.04, 0.12))


#: Partitions in a world above which its producers append to all of a node's partitions before
#: waiting for their acknowledgments (SimClient.produce).
PRODUCE_TOGETHER = 12


class _Batch:
    count = 1

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


class World:
    def __init__(self, seed: int, nodes: int = 3, partitions: int = 4, seconds: float = 10.0,
                 mutant: str | None = None) -> None:
        self.seed = seed
        self.hub = Hub(seed)
        self.mutant = mutant
        self.meta = SimMetadata(self)
        self.nodes: dict[int, dict] = {}
        self.streams: dict[int, _Stream] = {}
        self.next_stream_id = 1
        self.kv: dict[str, bytes] = {}
        self.feeds: list[SimFeed] = []
        self.wals: dict[int, Any] = {}
        self.meta_down = False
        self.meta_cut: set[Any] = set()
        self.store_down = False
        self.ops = 0
        self.acks: list[tuple[int, int, bytes, int]] = []
        self.faults: list[Fault] = []
        self.incarnations: dict[int, Incarnation] = {}
        self.numbers: dict[int, int] = defaultdict(int)
        self.node_ids = list(range(1, nodes + 1))
        self.partition_names = [f"p{i}" for i in range(partitions)]
        self.seconds = seconds
        self.signature: list[str] = []
        self.forgotten: set[int] = set()
        self.violations: list[str] = []
        self.migrated = 0                          # migrations that reported success
        self.fault_end = int(seconds * S)
        self.buggify_rate = self.hub.rng.choice([0.0, 0.0005, 0.002])
        self.partition_acks: dict[str, int] = {}       # partition -> time of its latest acknowledgment
        self.agents: list[NodeAgent] = []              # every incarnation's, the crashed ones too

    def wall(self) -> int:
        return SimRuntime.WALL_BASE + self.hub.now

    # -- nodes ---------------------------------------------------------------------------------------

    def start(self, node_id: int) -> None:
        self.numbers[node_id] += 1
        self.wals.setdefault(node_id, [])
        inc = self.incarnations[node_id] = Incarnation(self, node_id, self.numbers[node_id])
        self.hub.spawn(inc.key, f"n{node_id}-boot", inc.boot)

    def crash(self, node_id: int) -> None:
        inc = self.incarnations.get(node_id)
        if inc is None:
            return
        self.hub.dead.add(inc.key)
        self.hub.paused.pop(inc.key, None)
        # What was not durable yet is gone: only the WAL's durable records survive.
        self.hub.log(f"crash node {node_id} #{inc.number}")

    def restart(self, node_id: int) -> None:
        if node_id in self.forgotten:
            return
        self.crash(node_id)
        self.start(node_id)

    def current(self, node_id: int) -> Any:
        inc = self.incarnations.get(node_id)
        return None if inc is None else inc.key

    # -- WAL recovery: a restart of the node itself, or a failover on its behalf ------------------------

    def recover_wal(self, node_id: int, node_epoch: int, close: bool) -> tuple[int, int]:
        """Commit the node's durable WAL records above each stream's committed end (under
        `node_epoch`), then close the streams it holds. Returns (records, replayed)."""
        wal = self.wals.get(node_id)
        if wal == LOST:
            raise WALError(f"sim: node {node_id}'s WAL is lost with its host")
        records = list(wal or ())
        replayed = 0
        by_stream: dict[int, list[Rec]] = defaultdict(list)
        for rec in records:
            by_stream[rec.stream_id].append(rec)
        for sid, recs in sorted(by_stream.items()):
            m = self.meta.get_stream(sid)
            if m.state != StreamState.OPENED or m.owner_node_id != node_id:
                continue
            batch, expect = [], m.end_offset
            for rec in sorted(recs, key=lambda r: r.base):
                if rec.epoch != m.epoch or rec.base + rec.count <= expect:
                    continue
                if rec.base != expect:
                    break
                batch.append((rec.base, rec.count, rec.payload))
                expect = rec.base + rec.count
            if batch:
                self.meta.commit_records(node_id, node_epoch, [(sid, m.epoch, batch)])
                replayed += len(batch)
        if close:
            for m in self.meta.list_streams(owner_node_id=node_id):
                self.meta.close_stream(m.stream_id, m.epoch, node_id, node_epoch)
        return len(records), replayed

    def recover(self, node_id: int, *, store, metadata, config, settle: float = 0.0, sleep=None,
                if_unchanged=None) -> FailoverReport:
        """Cluster.fail_over's replay, on the simulation: open the WAL (before fencing: a lost
        one leaves the node as it is), fence the node, wait `settle`, replay, close its streams."""
        if self.wals.get(node_id) == LOST:
            raise WALError(f"sim: failover of node {node_id}: its WAL is lost")
        t0 = self.hub.now
        fenced = self.meta.fence_node(node_id, if_unchanged=None if self.mutant == "stale-fence" else if_unchanged)
        if settle and self.mutant != "no-settle":
            self.hub.sleep(settle)
        records, replayed = self.recover_wal(node_id, fenced.node_epoch, close=True)
        closed = 0
        return FailoverReport(node_id, fenced.node_epoch, records, replayed, closed, (self.hub.now - t0) / S)

    # -- faults ------------------------------------------------------------------------------------

    def _active(self) -> list[Fault]:
        return [f for f in self.faults if f.end > self.hub.now]

    def _note(self, kind: str, target: Any) -> None:
        """The fault and what the target was doing: a step of the interleaving signature."""
        doing = "-"
        if isinstance(target, int):
            inc = self.incarnations.get(target)
            if inc is not None and inc.agent is not None:
                doing = "up" if not inc.client.fenced else "fenced"
        self.signature.append(f"{kind}:{doing}")

    def inject(self) -> None:
        hub, rng = self.hub, self.hub.rng
        if len(self._active()) >= 2:
            return
        kind = rng.choice(["pause", "pause", "long-pause", "crash", "meta-outage", "meta-cut", "store-stall",
                           "migrate", "migrate", "lost-host", "broken"])
        node = rng.choice(self.node_ids)
        now = hub.now
        if kind in ("pause", "long-pause"):
            key = self.current(node)
            seconds = rng.uniform(0.1, 1.0) if kind == "pause" else rng.uniform(2.0, 5.0)
            if key is None or key in hub.dead:
                return
            hub.paused[key] = now + int(seconds * S)
            self.faults.append(Fault(kind, node, now, now + int(seconds * S)))
        elif kind == "crash":
            down = rng.uniform(0.2, 3.0)
            self.crash(node)
            hub.at(now + int(down * S), lambda n=node: self.restart(n), None)
            self.faults.append(Fault(kind, node, now, now + int(down * S)))
        elif kind == "meta-outage":
            seconds = rng.uniform(0.5, 5.0)
            self.meta_down = True
            hub.at(now + int(seconds * S), self._meta_up, None)
            self.faults.append(Fault(kind, None, now, now + int(seconds * S)))
        elif kind == "meta-cut":
            key = self.current(node)
            seconds = rng.uniform(0.5, 4.0)
            self.meta_cut.add(key)
            hub.at(now + int(seconds * S), lambda k=key: self.meta_cut.discard(k), None)
            self.faults.append(Fault(kind, node, now, now + int(seconds * S)))
        elif kind == "store-stall":
            seconds = rng.uniform(0.5, 5.0)
            self.store_down = True
            hub.at(now + int(seconds * S), self._store_up, None)
            self.faults.append(Fault(kind, None, now, now + int(seconds * S)))
        elif kind == "migrate":
            name = rng.choice(self.partition_names)
            self.faults.append(Fault(kind, name, now, now))
            hub.spawn(None, f"migrate-{name}", lambda: self._migrate(name, node))
        elif kind == "broken":
            inc = self.incarnations.get(node)
            if inc is None or inc.key in hub.dead:
                return
            inc.client.broken = True        # until this incarnation ends (a restart repairs it)
            fault = Fault(kind, node, now, 10**18)
            self.faults.append(fault)
            hub.at(now, lambda k=inc.key: self._until_gone(k, fault), None)
        elif kind == "lost-host":
            if self.forgotten or len(self.node_ids) - len(self.forgotten) < 3:
                return
            self.crash(node)
            self.wals[node] = LOST
            self.forgotten.add(node)
            after = rng.uniform(0.5, 2.0)
            self.faults.append(Fault(kind, node, now, now + 10**18))
            hub.at(now + int(after * S), lambda n=node: hub.spawn(None, f"forget-{n}", lambda: self._forget(n)), None)
        self._note(kind, node)
        hub.log(f"fault {kind} {node}")

    def _until_gone(self, key: Any, fault: Fault) -> None:
        """A 'broken' fault lasts as long as the incarnation it hit."""
        if key in self.hub.dead:
            fault.end = self.hub.now
            return
        self.hub.at(self.hub.now + S // 10, lambda: self._until_gone(key, fault), None)

    def buggify(self, op: str, key: Any) -> None:
        """Now and then, right after a metadata call of a node landed and before its answer
        reaches the node, crash or pause it (FoundationDB's buggify): the interleavings that a
        fault every second or two would almost never hit (a judge dying holding a claim, a node
        paused between its commit and its acknowledgment, a node restarted mid-failover)."""
        if (not self.buggify_rate or key is None or not isinstance(key, tuple) or key in self.hub.dead
                or self.hub.now > self.fault_end):
            return
        heavy = ("put_kv_if_absent", "create_streams", "replace_kvs", "fence_node", "commit", "register_node")
        rate = self.buggify_rate * (5 if op in heavy else 1)
        if rate == 0 or self.hub.rng.random() >= rate:
            return
        node = key[0]
        if node in self.forgotten or self.current(node) != key:
            return
        if self.hub.rng.random() < 0.5:
            seconds = self.hub.rng.uniform(0.2, 3.0)
            self.hub.paused[key] = self.hub.now + int(seconds * S)
            self.faults.append(Fault("buggify-pause", node, self.hub.now, self.hub.now + int(seconds * S)))
        else:
            down = self.hub.rng.uniform(0.1, 1.5)
            self.faults.append(Fault("buggify-crash", node, self.hub.now, self.hub.now + int(down * S)))
            self.crash(node)
            self.hub.at(self.hub.now + int(down * S), lambda: self.restart(node), None)
        self.signature.append(f"buggify-{op}")
        self.hub.log(f"buggify {op}: {self.faults[-1].kind} node {node}")

    def _meta_up(self) -> None:
        if not any(f.kind == "meta-outage" and f.end > self.hub.now for f in self.faults):
            self.meta_down = False

    def _store_up(self) -> None:
        if not any(f.kind == "store-stall" and f.end > self.hub.now for f in self.faults):
            self.store_down = False

    def admin(self) -> Cluster:
        return Cluster(self.meta, store=None, config=CONFIG, runtime=SimRuntime(self.hub, None), recover=self.recover)

    def _migrate(self, name: str, node: int) -> None:
        cluster = self.admin()
        cluster.store = "sim"
        assigned = self.kv.get(f"assignment/{name}")
        source = json.loads(assigned)["node"] if assigned is not None else None
        try:
            report = cluster.migrate(name, node, timeout=2.0)
        except NodeAliveError as e:
            # The source holds on and is alive: an operator does what the error says and fails
            # it over on purpose (`s3stream node fail-over --force`), its lease waited out.
            self.hub.log(f"migrate {name} -> {node}: {type(e).__name__}; forced failover of node {source}")
            try:
                cluster.fail_over_node(source, force=True, reason="sim: an operator after migrate's advice")
            except S3StreamError as e2:
                self.hub.log(f"forced failover of node {source}: {type(e2).__name__}")
            return
        except S3StreamError as e:
            self.hub.log(f"migrate {name} -> {node}: {type(e).__name__}")
            return
        # Said only once true: the target itself opened the partition at the version assigned.
        self.migrated += 1
        opened = json.loads(self.kv.get(f"opened/{name}", b"{}"))
        if opened.get("node") != node or opened.get("version", 0) < report.version:
            self.violations.append(f"migrate {name} -> {node} reported success at {self.hub.now / S:.3f} s, but "
                                   f"the partition is opened as {opened} (version {report.version} assigned)")

    def _forget(self, node: int) -> None:
        replacement = max(self.node_ids) + 1
        while True:
            try:
                self.admin().forget(node, wal_lost=True)
                break
            except S3StreamError as e:
                self.hub.log(f"forget {node}: {e}")
                self.hub.sleep(0.5)
        self.node_ids.append(replacement)
        self.start(replacement)

    def supervise(self) -> None:
        """Restart a node whose incarnation was fenced (its process would exit and be started again)."""
        while True:
            self.hub.sleep(0.5)
            for node_id in list(self.node_ids):
                inc = self.incarnations.get(node_id)
                if (inc is not None and inc.key not in self.hub.dead and inc.agent is not None
                        and inc.agent.fenced and node_id not in self.forgotten):
                    self.restart(node_id)

    # -- the run -----------------------------------------------------------------------------------

    def setup(self) -> None:
        for node_id in self.node_ids:
            self.start(node_id)
        cluster = self.admin()

        def assign() -> None:
            self.hub.sleep(0.3)
            if len(self.partition_names) <= PRODUCE_TOGETHER:
                for i, name in enumerate(self.partition_names):
                    cluster.assign(name, self.node_ids[i % len(self.node_ids)])
                return
            # Many: in a few writes, retried through the faults (which start at 1.5 s) until
            # every partition is assigned.
            wanted = {name: self.node_ids[i % len(self.node_ids)] for i, name in enumerate(self.partition_names)}
            while wanted:
                try:
                    for name in cluster.assign_many(wanted):
                        wanted.pop(name)
                except S3StreamError:
                    self.hub.sleep(0.1)
        self.hub.spawn(None, "assign", assign)
        self.hub.spawn(None, "supervisor", self.supervise)

    def run(self) -> dict:
        hub = self.hub
        self.setup()
        fault_end = int(self.seconds * S)
        hub.run(int(1.5 * S))
        while hub.now < fault_end:
            self.inject()
            hub.run(hub.now + int(hub.rng.uniform(0.3, 1.5) * S))
        for f in self.faults:
            if f.kind not in ("lost-host", "broken"):     # those last as long as the host / incarnation
                f.end = min(f.end, hub.now)
        self.meta_down = self.store_down = False
        self.meta_cut.clear()
        hub.paused.clear()
        hub.run(hub.now + int(8 * S))                  # settle: detection, failovers, moves, uploads
        result = self.check()
        hub.shutdown()
        return result

    # -- the checker ----------------------------------------------------------------------------------

    def readable(self, sid: int) -> dict[int, bytes]:
        """What a reader finds at each offset once everything durable is committed: the objects,
        and what its current owner's WAL holds above them at the current epoch."""
        stream = self.streams[sid]
        out = {off: payload for off, (count, payload) in stream.data.items()}
        if stream.state == StreamState.OPENED and stream.owner is not None:
            wal = self.wals.get(stream.owner)
            for rec in (wal if isinstance(wal, list) else ()):
                if rec.stream_id == sid and rec.epoch == stream.epoch and rec.base >= stream.end:
                    out.setdefault(rec.base, rec.payload)
        return out

    def lost_at(self, sid: int, offset: int) -> bool:
        return any(lost and lo <= offset < hi for _, _, lo, hi, lost in self.streams[sid].ranges)

    def check(self) -> dict:
        counts = dict(acknowledged=len(self.acks), lost=0, given_up=0, overwritten=0, duplicated=0,
                      acked_twice=0, false_failovers=0, failovers=0, not_live=0, migrated=self.migrated)
        problems: list[str] = []
        by_offset: dict[tuple[int, int], bytes] = {}
        readable = {sid: self.readable(sid) for sid in self.streams}
        for sid, offset, payload, at in self.acks:
            other = by_offset.setdefault((sid, offset), payload)
            if other != payload:
                counts["acked_twice"] += 1
                problems.append(f"stream {sid} offset {offset} acknowledged twice: {other!r} and {payload!r}")
            found = readable[sid].get(offset)
            if found is None:
                if self.lost_at(sid, offset):
                    counts["given_up"] += 1
                else:
                    counts["lost"] += 1
                    problems.append(f"stream {sid} offset {offset}: acknowledged {payload!r} is lost")
            elif found != payload:
                counts["overwritten"] += 1
                problems.append(f"stream {sid} offset {offset}: acknowledged {payload!r}, holds {found!r}")
        seen: dict[bytes, tuple[int, int]] = {}
        for sid, data in readable.items():
            for offset, payload in data.items():
                if payload in seen and payload.count(b"|") == 2:
                    counts["duplicated"] += 1
                    problems.append(f"{payload!r} at {seen[payload]} and {(sid, offset)}")
                seen[payload] = (sid, offset)
        history = [json.loads(v) for k, v in sorted(self.kv.items()) if k.startswith("history/")]
        window = int((CONFIG.heartbeat_timeout + CONFIG.lease + 1.0) * S)
        for entry in history:
            if entry["kind"] != "failover" or not entry.get("ok"):
                continue
            counts["failovers"] += 1
            # Judged when it was decided: a judge paused mid-failover records it long after.
            at = entry.get("decided_ns", entry["at_ns"]) - SimRuntime.WALL_BASE
            touched = [f for f in self.faults if f.target == entry["node"] and f.start <= at and f.end >= at - window]
            if not touched:
                counts["false_failovers"] += 1
                problems.append(f"false failover of node {entry['node']} by node {entry['judge']} at "
                                f"{at / S:.3f} s: {entry['reason']}")
        claims = {k: json.loads(v) for k, v in self.kv.items() if k.startswith("failover/")}
        for entry in history:
            if entry["kind"] != "failover" or entry.get("judge") is None:
                continue
            prefix = f"failover/{entry['node']}/{entry['node_epoch']}/"
            mine = [c for k, c in claims.items() if k.startswith(prefix) and c["node"] == entry["judge"]
                    and c.get("node_epoch") == entry["judge_epoch"]]
            if not mine:
                counts["unclaimed_failovers"] = counts.get("unclaimed_failovers", 0) + 1
                problems.append(f"failover of node {entry['node']} epoch {entry['node_epoch']} by node "
                                f"{entry['judge']} (epoch {entry['judge_epoch']}) without a claim of its own")
        for node_id in self.node_ids:
            if node_id in self.forgotten:
                continue
            inc = self.incarnations.get(node_id)
            node = self.nodes.get(node_id)
            if (inc is None or inc.key in self.hub.dead or inc.agent is None or inc.client.fenced
                    or node is None or node["failover"]):
                counts["not_live"] += 1
                problems.append(f"node {node_id} is not live at the end")
        for name in self.partition_names:
            last = self.partition_acks.get(name, -1)
            if self.hub.now - last > 3 * S:
                counts["unavailable"] = counts.get("unavailable", 0) + 1
                problems.append(f"partition {name} acknowledged nothing in the last 3 s of the settling "
                                f"(its last acknowledgment at {last / S:.3f} s)")
        for agent in self.agents:
            # A move that failed of an error no step raises on purpose (a TypeError, say) is
            # retried, and the partition serves at its source meanwhile: nothing else sees it.
            if agent.stats["unexpected_errors"]:
                problems.append(f"node {agent.node_id}'s agent failed unexpectedly "
                                f"{agent.stats['unexpected_errors']} times, last: {list(agent.errors)[-1:]}")
        problems += self.violations
        problems += self.hub.errors
        return dict(seed=self.seed, mutant=self.mutant, ok=not problems, counts=counts, problems=problems[:20],
                    steps=self.hub.steps, metadata_ops=self.ops, faults=[f.kind for f in self.faults],
                    signature="/".join(self.signature), sim_seconds=self.hub.now / S)


def run_seed(seed: int, mutant: str | None = None, seconds: float = 10.0, partitions: int = 4) -> dict:
    with MUTANTS[mutant]() if mutant else _nothing():
        world = World(seed, partitions=partitions, seconds=seconds, mutant=mutant)
        try:
            return world.run()
        except BaseException as e:       # noqa: BLE001 - the simulation itself failing is a finding
            return dict(seed=seed, mutant=mutant, ok=False, counts={}, problems=[f"{type(e).__name__}: {e}",
                        traceback.format_exc()], trace=world.hub.trace[-200:], steps=world.hub.steps,
                        signature="/".join(world.signature))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- known bugs, reintroduced one at a time (the simulation must catch each) -------------------------

import contextlib
import json as _json

from s3stream.cluster import agent as _agent, cluster as _cluster, detector as _detector, partition as _partition


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any):
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


@contextlib.contextmanager
def _flag():
    """A mutant of the simulated engine itself (World.mutant is read where it applies)."""
    yield


def _old_close(self, timeout=None, record=None):
    """Partition.close before issue 32: a failed close leaves it half closed, and the next call
    says it closed (CloseReport(0, 0.0)) without doing anything."""
    if self._closing:
        return _partition.CloseReport(0, 0.0)
    try:
        return _ORIGINAL_CLOSE(self, timeout, record)
    except BaseException:
        self._closing = True             # half closed: refusing appends, never finished
        raise


_ORIGINAL_CLOSE = _partition.Partition.close


@contextlib.contextmanager
def _naive():
    """Silence counted over whatever gap the judge had, outages of its own included: after an
    outage of the store every heartbeat looks stale at once."""
    with _patched(_detector.FailureDetector, "unreachable", lambda self: None), \
            _patched(_detector.FailureDetector, "__init__",
                     lambda self, timeout, max_credit: _ORIGINAL_DETECTOR_INIT(self, timeout, 1e9)):
        yield


_ORIGINAL_DETECTOR_INIT = _detector.FailureDetector.__init__


def _lax_opened(self, opened, version, node_id, node=None):
    return bool(opened) and opened["version"] >= version


_ORIGINAL_WAIT_OPENED = _cluster.Cluster._wait_opened


def _any_node_wait_opened(self, name, version, timeout, node=None, feed=None, watch=None):
    return _ORIGINAL_WAIT_OPENED(self, name, version, timeout, None, feed, watch)


@contextlib.contextmanager
def _any_opened():
    """Cluster.migrate before issue 32: the first "opened" record of a recent enough version,
    from any node, is success."""
    with _patched(_cluster.Cluster, "_opened_by_current", _lax_opened), \
            _patched(_cluster.Cluster, "_wait_opened", _any_node_wait_opened):
        yield


def _always_serving(self):
    health = self.client.health()
    return dict(health, serving=True, stuck=False, problems=[])


def _old_claim(self, node_id, node_epoch, claimant, claimant_epoch=None):
    """claim_failover before issue 32: a claim is its claimant's whatever its incarnation."""
    prefix = f"failover/{node_id}/{node_epoch}/"
    claims = {int(k.rsplit("/", 1)[1]): _json.loads(v) for k, v in self.meta.list_kv(prefix).items()}
    if claims and claims[max(claims)]["node"] == claimant:
        return True
    return _ORIGINAL_CLAIM(self, node_id, node_epoch, claimant, claimant_epoch)


_ORIGINAL_CLAIM = _cluster.Cluster.claim_failover

MUTANTS: dict[str, Callable[[], Any]] = {
    # issue 26: a paused node acknowledges after its fence (no lease in the engine)
    "zombie-ack": _flag,
    # issue 26 / 32 bug 5: after a metadata outage every heartbeat looks stale
    "naive-detector": _naive,
    # issue 32 bug 1: a failed close is later reported as a successful one
    "false-close": lambda: _patched(_partition.Partition, "close", _old_close),
    # issue 32 bug 2: a migration accepts an "opened" record from any node
    "any-opened": _any_opened,
    # issue 32 bug 3: a node that cannot serve counts as live (takes partitions, judges peers)
    "sick-serves": lambda: _patched(_agent.NodeAgent, "health", _always_serving),
    # issue 32 bug 4: a restarted node inherits its old failover claims
    "reused-claim": lambda: _patched(_cluster.Cluster, "claim_failover", _old_claim),
    # found by this simulation (seeds 21, 247, 404 before the fixes of f0d7b99); since issue 50 a
    # migration falls back only on a silent source, and the WAL read under a lease is the forced
    # failover's (an admin's, after a migration found its source alive)
    "no-settle": _flag,
    "stale-fence": _flag,
    "close-any-incarnation": _flag,
}


# ---- running many seeds ----------------------------------------------------------------------------

def _seed_range(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _worker(args: tuple[list[int], str | None, float, int]) -> list[dict]:
    import logging
    logging.disable(logging.CRITICAL)
    seeds, mutant, seconds, partitions = args
    return [{k: v for k, v in run_seed(s, mutant, seconds, partitions).items() if k != "trace"} for s in seeds]


def run_many(seeds: list[int], mutant: str | None = None, seconds: float = 10.0, workers: int = 2,
             stop_at_first: bool = False, partitions: int = 4) -> dict:
    """Run `seeds` in `workers` processes; a summary with every failing seed's result. The
    workers are spawned, not forked: a fork of a process with other threads (pytest's, after
    tests that leave pools and feeds behind) can copy a lock held by one of them, and the child
    then waits on it for good (a CI run hung so, both workers blocked on a futex)."""
    import multiprocessing
    t0 = _time.perf_counter()
    chunks = [seeds[i::workers] for i in range(workers)] if not stop_at_first else [[s] for s in seeds]
    results: list[dict] = []
    if workers == 1:
        for chunk in chunks:
            results += _worker((chunk, mutant, seconds, partitions))
            if stop_at_first and not results[-1]["ok"]:
                break
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for part in pool.imap_unordered(_worker, [(c, mutant, seconds, partitions) for c in chunks]):
                results += part
                if stop_at_first and any(not r["ok"] for r in part):
                    pool.terminate()
                    break
    elapsed = _time.perf_counter() - t0
    failed = sorted((r for r in results if not r["ok"]), key=lambda r: r["seed"])
    totals: dict[str, int] = defaultdict(int)
    for r in results:
        for k, v in r.get("counts", {}).items():
            totals[k] += v
    return dict(seeds=len(results), failed=len(failed), failures=failed[:10], seconds=round(elapsed, 2),
                seeds_per_second=round(len(results) / elapsed, 1), mutant=mutant,
                distinct_interleavings=len({r.get("signature") for r in results}),
                totals=dict(totals), first_failing_seed=failed[0]["seed"] if failed else None,
                sim_seconds_per_seed=seconds, partitions=partitions)


def replay(seed: int, mutant: str | None = None, seconds: float = 10.0) -> dict:
    """Run one seed again and print its trace (a failing seed replays exactly)."""
    world = World(seed, seconds=seconds, mutant=mutant)
    with MUTANTS[mutant]() if mutant else _nothing():
        result = world.run()
    for line in world.hub.trace:
        print(line)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-999", help="seeds: 0-9999 or 1,5,7")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="simulated seconds of faults per seed")
    p.add_argument("--partitions", type=int, default=4, help="partitions of the cluster (three nodes)")
    p.add_argument("--mutant", choices=sorted(MUTANTS), default=None, help="run with one known bug reintroduced")
    p.add_argument("--replay", type=int, default=None, help="run this seed and print its trace")
    p.add_argument("--json", default=None, help="write the summary here")
    args = p.parse_args(argv)
    if args.replay is not None:
        import logging
        logging.disable(logging.CRITICAL)
        result = replay(args.replay, args.mutant, args.seconds)
        print(json.dumps({k: v for k, v in result.items() if k != "trace"}, indent=2, default=str))
        return 0 if result["ok"] else 1
    summary = run_many(_seed_range(args.seeds), args.mutant, args.seconds, args.workers, partitions=args.partitions)
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
