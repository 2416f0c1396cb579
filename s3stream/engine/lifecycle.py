"""Object lifecycle: delete what metadata no longer needs.

PREPARED objects past their expiry (an upload that crashed or failed before its commit) and
MARK_DESTROYED objects older than the destroy delay (replaced by compaction, trimmed away, or of a
deleted stream: the delay lets in-flight readers finish) are deleted from the store, then their
rows from metadata. Metadata refuses to commit an expired PREPARED object, so an object is never
deleted under a commit. Deleting is idempotent, so every node may run this.
"""
from __future__ import annotations

import logging
import threading

from ..metadata import MetadataStore
from ..objectstore import ObjectStore

log = logging.getLogger("s3stream.lifecycle")


class ObjectReclaimer:
    #: Objects listed, deleted from the store and removed from metadata per step.
    batch = 1000

    def __init__(self, store: ObjectStore, metadata: MetadataStore, destroy_delay: float) -> None:
        self._store = store
        self._meta = metadata
        self._delay_ns = int(destroy_delay * 1e9)
        self.deleted = 0

    def run_once(self) -> int:
        """Delete every reclaimable object now, `batch` at a time (memory and each metadata
        transaction stay bounded however long the delete list has grown); returns how many
        rows were removed."""
        total = 0
        while True:
            objects = self._meta.objects_to_delete(self._delay_ns, limit=self.batch)
            if not objects:
                return total
            self._store.delete([o.key for o in objects])
            removed = self._meta.remove_objects([o.object_id for o in objects])
            self.deleted += len(removed)
            total += len(removed)
            if len(objects) < self.batch or not removed:
                return total


class ReclaimerThread:
    """Runs an ObjectReclaimer every `interval` seconds until stopped."""

    def __init__(self, reclaimer: ObjectReclaimer, interval: float) -> None:
        self._reclaimer = reclaimer
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="s3stream-reclaim", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._reclaimer.run_once()
            except Exception:   # noqa: BLE001 - the next round retries; nothing is lost by waiting
                log.exception("object reclaim failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
