"""Child of tests/engine/test_two_instances.py: one instance of node 1 on a WAL of objects.

Usage: two_instances_child.py ROLE WAL_URL STORE_URL META_URL DIR SECONDS
ROLE "first" creates a stream (its id in DIR/stream_id), appends until it is refused for good,
DIR/stop appears or SECONDS pass; ROLE "second" waits for DIR/stream_id, starts (fencing the
first: each role runs with its own TMPDIR, as on another host), opens the stream and appends
for SECONDS. Both append with 4 appends in flight. Prints "ready", then "ack BASE PAYLOAD" per acknowledged append,
"refused ERROR-TYPE" once, and at the end "result JSON" (health, close's result).
"""
import json
import sys
import time
from pathlib import Path

from s3stream import RecordBatch, S3StreamError, StreamClient

from conftest import small_config


def main() -> None:
    role, wal_url, store_url, meta_url, workdir, seconds = sys.argv[1:7]
    workdir, seconds_f = Path(workdir), float(seconds)
    sid_file = workdir / "stream_id"
    if role == "second":
        while not sid_file.exists():
            time.sleep(0.01)
    client = StreamClient(1, wal_url, store_url, meta_url, small_config(reclaim_interval=None))
    if role == "first":
        stream = client.create_stream()
        sid_file.write_text(str(stream.stream_id))
    else:
        stream = client.open_stream(int(sid_file.read_text()))
    print("ready", flush=True)
    end = time.monotonic() + seconds_f
    pending: list = []
    seq = 0
    refused = None
    stop_file = workdir / "stop"
    while time.monotonic() < end and refused is None and not (role == "first" and stop_file.exists()):
        payload = f"{role}-{seq}".encode()
        try:
            pending.append((payload, stream.append(RecordBatch(payload))))
        except S3StreamError as e:
            refused = e
            break
        seq += 1
        while len(pending) >= 4 or (pending and pending[0][1].done()):
            payload, fut = pending.pop(0)
            try:
                print(f"ack {fut.result(30).base_offset} {payload.decode()}", flush=True)
            except S3StreamError as e:
                refused = refused or e
        time.sleep(0.002)
    for payload, fut in pending:
        try:
            print(f"ack {fut.result(30).base_offset} {payload.decode()}", flush=True)
        except S3StreamError as e:
            refused = refused or e
    if refused is not None:
        print(f"refused {type(refused).__name__}", flush=True)
    health = client.health()
    closed = client.close(timeout=60)
    print("result " + json.dumps(dict(health=health, close=closed)), flush=True)


if __name__ == "__main__":
    main()
