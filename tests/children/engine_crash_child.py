"""Child of the engine crash test: node 1 appends to its streams until SIGKILLed.

Usage: engine_crash_child.py TMPDIR ROUND NSTREAMS [STORE_URL [METADATA_URL [WAL]]]
(defaults file://TMPDIR/objects, sqlite:///TMPDIR/meta.db and TMPDIR/node1.wal; WAL may be a URL
such as objects+file:///dir for a WAL kept as objects)
Prints "stream INDEX ID" for each stream, "ready", then "ack ID SEQ BASE COUNT" per acknowledged
append. Round 0 creates the streams; later rounds reopen them (recovery closed them).
"""
import sys
import threading
from pathlib import Path

from s3stream import RecordBatch, StreamClient

from conftest import small_config
from wal_payload import make_payload


def main() -> None:
    tmp, rnd, nstreams = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = sys.argv[4] if len(sys.argv) > 4 else f"file://{tmp}/objects"
    meta = sys.argv[5] if len(sys.argv) > 5 else f"sqlite:///{tmp}/meta.db"
    wal_location = sys.argv[6] if len(sys.argv) > 6 else tmp / "node1.wal"
    client = StreamClient(1, wal_location, store, meta, small_config(reclaim_interval=None))
    ids_file = tmp / "stream_ids"
    if rnd == 0:
        streams = [client.create_stream() for _ in range(nstreams)]
        ids_file.write_text(" ".join(str(s.stream_id) for s in streams))
    else:
        streams = [client.open_stream(int(i)) for i in ids_file.read_text().split()]
    out_lock = threading.Lock()
    print("ready", flush=True)

    def writer(index: int) -> None:
        s = streams[index]
        seq = 0
        pending = []
        while True:
            payload = make_payload(rnd, index, seq)
            count = 1 + seq % 7
            pending.append((seq, count, s.append(RecordBatch(payload, count))))
            seq += 1
            if len(pending) >= 8:
                sq, cnt, fut = pending.pop(0)
                base = fut.result().base_offset
                with out_lock:
                    sys.stdout.write(f"ack {s.stream_id} {sq} {base} {cnt}\n")
                    sys.stdout.flush()

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(nstreams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
