"""A node's start never leaves it registered but silent for long: the slow part of a new WAL
(zero-filling it) comes before the registration, and the node heartbeats once its WAL is
replayed, so peers do not fail over a node that is only starting."""
import os

import wal
from s3stream import StreamClient
from s3stream.metadata import SqliteMetadataStore
from conftest import MiB, small_config


class Recording(SqliteMetadataStore):
    """Records, at each registration and heartbeat, whether the node's WAL file was complete."""

    def __init__(self, path, wal_path, capacity):
        super().__init__(path)
        self.wal_path, self.capacity, self.calls = wal_path, capacity, []

    def _wal_size(self):
        return os.path.getsize(self.wal_path) if os.path.exists(self.wal_path) else None

    def register_node(self, node_id, wal_path):
        self.calls.append(("register", self._wal_size()))
        return super().register_node(node_id, wal_path)

    def heartbeat(self, node_id, node_epoch):
        self.calls.append(("heartbeat", self._wal_size()))
        return super().heartbeat(node_id, node_epoch)


def test_wal_is_preallocated_before_the_node_registers(tmp_path):
    config = small_config(wal=wal.WALConfig(capacity=32 * MiB, full_timeout=5))
    wal_path = str(tmp_path / "n1.wal")
    meta = Recording(str(tmp_path / "meta.db"), wal_path, config.wal.capacity)
    client = StreamClient(1, wal_path, f"file://{tmp_path}/objects", meta, config)
    try:
        assert meta.calls[0] == ("register", config.wal.capacity)
        assert ("heartbeat", config.wal.capacity) in meta.calls[1:]
    finally:
        client.close()
        meta.close()


def test_preallocate_creates_once(tmp_path):
    path = str(tmp_path / "w.wal")
    config = wal.WALConfig(capacity=8 * MiB)
    assert wal.WriteAheadLog.preallocate(path, config) is True
    assert os.path.getsize(path) == 8 * MiB
    assert wal.WriteAheadLog.preallocate(path, config) is False      # an existing file is left as it is
    w = wal.WriteAheadLog.open(path, node_id=1, config=config)
    w.close()
