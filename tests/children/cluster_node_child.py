"""A cluster node in its own process, producing to the partitions assigned to it.

Usage: cluster_node_child.py TMPDIR NODE_ID P1,P2,... [METADATA_URL]  (default sqlite:///TMPDIR/meta.db)
Prints "ready" once its partitions are open and "ack PARTITION OFFSET PAYLOAD" per acknowledged
append, until killed.
"""
import sys
import threading
import time
from pathlib import Path

from s3stream import RecordBatch, StreamClient
from s3stream.cluster import Cluster, NodeAgent, partition_on, partitions_on
from s3stream.metadata import open_metadata
from s3stream.objectstore import LocalObjectStore

from conftest import small_config
from test_cluster import FAST


def main() -> None:
    tmp, node_id, names = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    meta_url = sys.argv[4] if len(sys.argv) > 4 else f"sqlite:///{tmp}/meta.db"
    client = StreamClient(node_id, tmp / f"node{node_id}.wal", f"file://{tmp}/objects", meta_url,
                          small_config(upload_interval=0.2))
    meta = open_metadata(meta_url)
    agent = NodeAgent(client, Cluster(meta, LocalObjectStore(str(tmp / "objects")), FAST))
    while sorted(p.name for p in partitions_on(client)) != sorted(names):
        time.sleep(0.01)
    print("ready", flush=True)
    lock = threading.Lock()

    def produce(name: str) -> None:
        i = 0
        while not agent.fenced:
            p = partition_on(client, name)
            if p is None:
                return
            payload = b"%s-%d" % (name.encode(), i)
            try:
                base = p.append(RecordBatch(payload, 1)).result().base_offset
            except Exception:   # noqa: BLE001 - fenced or moved: this node stops writing
                return
            with lock:
                sys.stdout.write(f"ack {name} {base} {payload.decode()}\n")
                sys.stdout.flush()
            i += 1

    threads = [threading.Thread(target=produce, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(3600)


if __name__ == "__main__":
    main()
