"""kill -9 of a compaction between its PUTs and its commit, and between its commit and the
deletion of what it replaced: nothing is lost, no committed object is missing, and the lifecycle
removes the leftovers."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from s3stream import StreamClient
from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import ObjectState, SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore
from conftest import small_config
from test_compaction import Node
from test_engine import read_all

HERE = Path(__file__).parent
CHILDREN = HERE.parent / "children"
HOUR = 3600 * 10 ** 9


def kill_at(tmp: Path, point: str) -> None:
    """Run the child until it reports reaching `point`, then SIGKILL it there."""
    env = dict(os.environ, S3STREAM_COMPACTION_HOOK=point,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(CHILDREN / "compaction_crash_child.py"), str(tmp)],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stderr:
            if line.strip() == f"compaction-hook {point}":
                break
        else:
            raise AssertionError(f"child ended before {point}: rc={proc.wait()}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check(tmp: Path, expected: dict) -> None:
    """Every committed object is in the store and every stream reads back as appended."""
    meta = SqliteMetadataStore(str(tmp / "meta.db"))
    store = LocalObjectStore(str(tmp / "objects"))
    keys = {info.key for info in store.list()}
    assert all(o.key in keys for o in meta.list_objects(state=ObjectState.COMMITTED))
    meta.close()
    reader = StreamClient(2, tmp / "node2.wal", f"file://{tmp}/objects", f"sqlite:///{tmp}/meta.db",
                          small_config(reclaim_interval=None))
    for stream_id, batches in expected.items():
        s = reader.open_stream(stream_id)
        assert read_all(s) == batches, stream_id
    reader.close()


def test_kill_between_put_and_commit_and_between_commit_and_delete(tmp_path):
    node = Node(tmp_path)
    rng = random.Random(11)
    streams = node.create(6)
    for _ in range(4):
        for i, s in enumerate(streams):
            node.append(s, [400 * (1 + i)] * 8, rng)
        node.upload()
    expected = {s: list(node.model[s]) for s in streams}
    node.close()
    meta = SqliteMetadataStore(str(tmp_path / "meta.db"))
    store = LocalObjectStore(str(tmp_path / "objects"))
    inputs = {o.object_id for o in meta.node_stream_set_objects(1)}
    assert len(inputs) >= 2

    # 1. Killed after its PUTs, before its commit: outputs are PREPARED orphans in the store.
    kill_at(tmp_path, "after_put")
    orphans = meta.list_objects(state=ObjectState.PREPARED)
    assert orphans and all(store.size(o.key) > 0 for o in orphans[:1])
    assert {o.object_id for o in meta.node_stream_set_objects(1)} == inputs   # nothing swapped
    check(tmp_path, expected)
    # The lifecycle deletes them once they expire (the metadata clock two hours on)
    later = SqliteMetadataStore(str(tmp_path / "meta.db"), clock=lambda: time.time_ns() + 2 * HOUR)
    ObjectReclaimer(store, later, destroy_delay=3600).run_once()
    later.close()
    assert not meta.list_objects(state=ObjectState.PREPARED)
    assert {i.key for i in store.list()} == {o.key for o in meta.list_objects()}

    # 2. Killed after its commit, before the replaced inputs were deleted.
    kill_at(tmp_path, "after_commit")
    destroyed = meta.list_objects(state=ObjectState.MARK_DESTROYED)
    assert {o.object_id for o in destroyed} >= inputs
    assert all(store.size(o.key) > 0 for o in destroyed)        # still readable by old readers
    assert not {o.object_id for o in meta.node_stream_set_objects(1)} & inputs
    check(tmp_path, expected)
    ObjectReclaimer(store, meta, destroy_delay=0).run_once()
    committed = {o.key for o in meta.list_objects(state=ObjectState.COMMITTED)}
    assert {i.key for i in store.list()} == committed
    assert not meta.list_objects(state=ObjectState.MARK_DESTROYED)
    check(tmp_path, expected)
    meta.close()
