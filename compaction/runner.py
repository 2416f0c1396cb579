"""Background compaction: a thread running a Compactor's rounds on their intervals, and
`attach(client)` to run one inside a StreamClient's process."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from s3stream.errors import StreamFencedError
from s3stream.latency import DURATION_BUCKETS, LatencyHistogram
from s3stream.engine.lifecycle import ObjectReclaimer

from .compactor import Compactor
from .config import CompactionConfig
from .limits import CompactionStopped
from .metrics import object_stats

if TYPE_CHECKING:
    from s3stream import StreamClient

log = logging.getLogger("compaction")


class CompactionRunner:
    """Runs `compactor` in a thread: SSO compaction every `sso_interval`, StreamObject merges
    every `so_interval` (the first of each one interval after start), and, if `reclaimer` is
    given, the object lifecycle every `reclaim_interval` seconds.

    pause() holds compaction at its next chunk boundary (between GETs and PUTs) until resume();
    stop() ends it there too (what was written but not committed expires, see the lifecycle). A
    fenced node (StreamFencedError) stops the runner: a newer instance of the node took over.
    `uploaded_bytes` (optional) gives the bytes the node uploaded, for write amplification.
    """

    def __init__(self, compactor: Compactor, *, reclaimer: ObjectReclaimer | None = None,
                 reclaim_interval: float = 60.0,
                 uploaded_bytes: Callable[[], int] | None = None) -> None:
        self.compactor = compactor
        self.reclaimer = reclaimer
        self._reclaim_interval = reclaim_interval
        self._uploaded_bytes = uploaded_bytes
        self.gate = compactor.gate
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.errors = 0
        self.last_error: BaseException | None = None
        self.fenced = False
        # Seconds of each round that ran to its end, by kind (metrics(): "round_seconds").
        self.round_seconds = {"stream_set": LatencyHistogram(DURATION_BUCKETS),
                              "stream_object": LatencyHistogram(DURATION_BUCKETS)}

    def start(self) -> "CompactionRunner":
        if self._thread is not None:
            raise RuntimeError("the compaction runner was started already")
        self._thread = threading.Thread(target=self._run, name=f"compaction-{self.compactor.node_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()

    @property
    def paused(self) -> bool:
        return self.gate.paused

    def stop(self, timeout: float | None = None) -> None:
        self.gate.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        config = self.compactor.config
        now = time.monotonic()
        due = {"sso": now + config.sso_interval, "so": now + config.so_interval}
        actions: dict[str, Callable[[], object]] = {"sso": self.compactor.compact_stream_sets,
                                                    "so": self.compactor.compact_stream_objects}
        intervals = {"sso": config.sso_interval, "so": config.so_interval}
        if self.reclaimer is not None:
            due["reclaim"] = now + self._reclaim_interval
            actions["reclaim"] = self.reclaimer.run_once
            intervals["reclaim"] = self._reclaim_interval
        while True:
            name = min(due, key=due.__getitem__)
            if self.gate.wait(max(0.0, due[name] - time.monotonic())):
                return
            try:
                self.gate.checkpoint()
                t0 = time.perf_counter()
                actions[name]()
                if name != "reclaim":
                    self.rounds += 1
                    self.round_seconds["stream_set" if name == "sso" else "stream_object"].observe(
                        time.perf_counter() - t0)
            except CompactionStopped:
                return
            except StreamFencedError as e:
                log.error("node %d was fenced; compaction stops: %s", self.compactor.node_id, e)
                self.fenced, self.last_error = True, e
                return
            except Exception as e:   # noqa: BLE001 - the next round retries from fresh metadata
                log.exception("compaction %s round of node %d failed", name, self.compactor.node_id)
                self.errors += 1
                self.last_error = e
            due[name] = time.monotonic() + intervals[name]

    def metrics(self, uploaded_bytes: int | None = None) -> dict:
        """Cumulative compaction figures, the store's objects by kind, and when the uploaded bytes
        are known the write amplification ((uploaded + compaction written) / uploaded) and the
        part compaction adds (compaction written / uploaded)."""
        totals = self.compactor.totals.as_dict()
        if uploaded_bytes is None and self._uploaded_bytes is not None:
            uploaded_bytes = self._uploaded_bytes()
        amplification = compaction_ratio = None
        if uploaded_bytes:
            amplification = (uploaded_bytes + totals["bytes_written"]) / uploaded_bytes
            compaction_ratio = totals["bytes_written"] / uploaded_bytes
        return dict(node_id=self.compactor.node_id, rounds=self.rounds, errors=self.errors,
                    paused=self.paused, fenced=self.fenced, peak_memory=self.compactor.memory.peak,
                    memory_budget=self.compactor.config.memory_budget, totals=totals,
                    uploaded_bytes=uploaded_bytes, write_amplification=amplification,
                    compaction_write_ratio=compaction_ratio,
                    objects_deleted=self.reclaimer.deleted if self.reclaimer else None,
                    objects=object_stats(self.compactor._meta),
                    round_seconds={kind: h.snapshot() for kind, h in self.round_seconds.items()})


def attach(client: "StreamClient", config: CompactionConfig | None = None, *,
           start: bool = True) -> CompactionRunner:
    """Compact the objects of `client`'s node in a background thread of this process, with the
    client's store, metadata, node id and epoch. Its metrics appear in `client.stats()` under
    "compaction". The client's own reclaimer (Config.reclaim_interval) deletes what compaction
    replaced; if the client runs none, the runner runs one with the client's destroy delay.
    Stop the runner before closing the client."""
    config = config or CompactionConfig()
    config.check_engine(client.config.max_batch_bytes)
    compactor = Compactor(client.object_store, client.metadata, client.node_id, client.node_epoch, config)
    reclaimer = None
    if client.config.reclaim_interval is None:
        reclaimer = ObjectReclaimer(client.object_store, client.metadata, client.config.destroy_delay)
    runner = CompactionRunner(compactor, reclaimer=reclaimer,
                              uploaded_bytes=lambda: client.stats()["upload"]["bytes"])
    client.add_stats_source(
        "compaction", lambda engine: dict(
            runner.metrics(uploaded_bytes=engine["upload"]["bytes"]),
            objects_deleted=(client.reclaimer.deleted if reclaimer is None else reclaimer.deleted)))
    if start:
        runner.start()
    return runner
