"""Child of the kill -9 model test: runs a list of operations on node 1 until SIGKILLed.

Usage: engine_ops_child.py TMPDIR OPS_JSON
OPS_JSON is a list of ["append", stream_index, size, count, n] | ["trim", stream_index, records_back]
| ["reopen", stream_index], run over and over (so the kill always lands in the middle of work).
Prints "stream INDEX ID" per stream, "ready", then, as each step is acknowledged:
"ack INDEX SEQ BASE COUNT", "trim INDEX OFFSET", "reopen INDEX".
Payloads are payload(index, seq, size): the parent regenerates them to check byte for byte.
"""
import hashlib
import json
import sys
from pathlib import Path

from s3stream import RecordBatch, StreamClient

from conftest import KiB, small_config

CONFIG = small_config(upload_threshold=256 * KiB, split_size=64 * KiB, cache_size=1024 * KiB, reclaim_interval=None)
STREAMS = 3


def payload(index: int, seq: int, size: int) -> bytes:
    seed = hashlib.sha256(b"%d/%d" % (index, seq)).digest()
    return (seed * (size // len(seed) + 1))[:size]


def main() -> None:
    tmp, ops = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    client = StreamClient(1, tmp / "node1.wal", f"file://{tmp}/objects", f"sqlite:///{tmp}/meta.db", CONFIG)
    streams = [client.create_stream() for _ in range(STREAMS)]
    for i, s in enumerate(streams):
        print(f"stream {i} {s.stream_id}", flush=True)
    print("ready", flush=True)
    seqs = [0] * STREAMS
    while True:
        for op in ops:
            run(op, client, streams, seqs)


def run(op: list, client: StreamClient, streams: list, seqs: list) -> None:
    kind, index = op[0], op[1]
    s = streams[index]
    if kind == "append":
        _, _, size, count, n = op
        futs = []
        for _ in range(n):
            futs.append((seqs[index], s.append(RecordBatch(payload(index, seqs[index], size), count))))
            seqs[index] += 1
        for seq, f in futs:
            print(f"ack {index} {seq} {f.result().base_offset} {count}", flush=True)
    elif kind == "trim":
        target = max(s.start_offset, s.next_offset - op[2])
        s.trim(target)
        print(f"trim {index} {target}", flush=True)
    elif kind == "reopen":
        s.close()
        streams[index] = client.open_stream(s.stream_id)
        print(f"reopen {index}", flush=True)


if __name__ == "__main__":
    main()
