"""Two live instances of one node id on a WAL of objects (issue 50, item 1): the second fences
the first, the first learns it and refuses appends, and nothing either acknowledged is lost.
On one host the second is refused before it touches anything (NodeConflictError)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import s3stream
from s3stream import RecordBatch, StreamClient
from s3stream.metadata import open_metadata
from conftest import small_config
from test_engine import read_all

HERE = Path(__file__).parent
CHILDREN = HERE.parent / "children"


def wal_url_for(store_url: str, tmp_path: Path) -> str:
    if store_url.startswith("file://"):
        return f"objects+file://{tmp_path}/wal-objects"
    return store_url.replace("/data?", "/wal?")


class Instance:
    """One child process (tests/children/two_instances_child.py) and what it printed."""

    def __init__(self, role: str, wal_url: str, store_url: str, meta_url: str, workdir: Path, seconds: float,
                 host_tmp: Path) -> None:
        host_tmp.mkdir(exist_ok=True)
        env = dict(os.environ, TMPDIR=str(host_tmp),      # its own temporary directory: another host
                   PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(CHILDREN / "two_instances_child.py"), role, wal_url, store_url,
                                      meta_url, str(workdir), str(seconds)],
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.acks: list[tuple[int, bytes]] = []
        self.refused: str | None = None
        self.result: dict | None = None
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "ready":
                self.ready.set()
            elif kind == "ack":
                base, payload = rest.split(" ", 1)
                self.acks.append((int(base), payload.encode()))
            elif kind == "refused":
                self.refused = rest
            elif kind == "result":
                self.result = json.loads(rest)

    def wait(self, timeout: float = 120) -> None:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join()
        assert code == 0, f"child exited with {code}"


@pytest.mark.slow
@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_two_live_instances_lose_nothing_and_the_first_stops(tmp_path, store_url):
    """Instance A appends; instance B of the same node starts on another host (its own TMPDIR)
    while A keeps appending, opens A's stream and appends too. A's appends fail from the fence
    on (StreamFencedError), its health says it cannot serve and its close does not wait for
    uploads that can never be committed. A third start of the node reads back every record
    either acknowledged, each at the offset it was acknowledged at."""
    meta_url = f"sqlite:///{tmp_path}/meta.db"
    wal_url = wal_url_for(store_url, tmp_path)
    a = Instance("first", wal_url, store_url, meta_url, tmp_path, 120.0, tmp_path / "host-a")
    assert a.ready.wait(60)
    time.sleep(0.5)
    b = Instance("second", wal_url, store_url, meta_url, tmp_path, 1.5, tmp_path / "host-b")
    b.wait()
    (tmp_path / "stop").touch()            # A stops by itself once fenced; this is a bound
    a.wait()
    assert a.acks and b.acks
    assert a.refused == "StreamFencedError", a.refused
    assert a.result is not None and b.result is not None
    assert a.result["health"]["serving"] is False
    assert any("fenced" in p for p in a.result["health"]["problems"])
    assert not any("not committed within" in e or "timeout" in e for e in a.result["close"]["errors"])
    sid = int((tmp_path / "stream_id").read_text())
    assert a.result["close"]["closed"] == [] and a.result["close"]["fenced"] == [sid]
    assert b.result["health"]["serving"] is True and b.result["close"]["errors"] == []
    offsets = [base for base, _ in a.acks + b.acks]
    assert len(offsets) == len(set(offsets)), "no offset was acknowledged twice"
    sid = int((tmp_path / "stream_id").read_text())
    c = StreamClient(1, wal_url, store_url, meta_url, small_config(reclaim_interval=None))
    try:
        stored = {base: bytes(payload) for base, _, payload in read_all(c.open_stream(sid))}
    finally:
        c.close()
    lost = [(base, p) for base, p in a.acks + b.acks if stored.get(base) != p]
    assert lost == [], f"acknowledged records lost or changed: {lost[:5]}"


def test_a_second_instance_on_this_host_is_refused_without_fencing_the_first(tmp_path):
    store, meta_url = f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"
    wal_url = f"objects+file://{tmp_path}/wal-objects"
    a = StreamClient(1, wal_url, store, meta_url, small_config(reclaim_interval=None))
    try:
        s = a.create_stream()
        s.append(RecordBatch(b"before")).result(10)
        with pytest.raises(s3stream.NodeConflictError, match="node 1 is already running on this host"):
            StreamClient(1, wal_url, store, meta_url, small_config(reclaim_interval=None))
        meta = open_metadata(meta_url)
        assert meta.get_node(1).node_epoch == a.node_epoch
        meta.close()
        assert s.append(RecordBatch(b"after")).result(10).base_offset == 1      # not fenced
        assert a.health()["serving"]
    finally:
        a.close()
    # Once it is closed, the node starts again here.
    StreamClient(1, wal_url, store, meta_url, small_config(reclaim_interval=None)).close()


def test_an_idle_instance_learns_of_a_takeover_from_its_health(tmp_path):
    """An instance that appends nothing learns of a newer one at its next health() (a node
    without an agent reads its row), and refuses appends from then on."""
    store, meta_url = f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"
    wal_url = f"objects+file://{tmp_path}/wal-objects"
    a = StreamClient(1, wal_url, store, meta_url, small_config(reclaim_interval=None))
    s = a.create_stream()
    s.append(RecordBatch(b"x")).result(10)
    assert a.health()["serving"]
    meta = open_metadata(meta_url)
    meta.register_node(1, wal_url)            # what another instance's start does first
    meta.close()
    health = a.health()
    assert health["serving"] is False and "fenced" in health["problems"][0]
    with pytest.raises(s3stream.StreamFencedError):
        s.append(RecordBatch(b"late")).result(10)
    a.close()
