"""Child of the crash test: appends from several threads until SIGKILLed.

Usage: wal_crash_child.py PATH ROUND THREADS CAPACITY
PATH is a WAL file, or objects+URL for a WAL kept as objects (s3stream.engine.walopen).
Prints "ready N" after recovering N records, "trim OFFSET" before each trim, and
"ack THREAD SEQ OFFSET" after each record's append was acknowledged as durable.
"""
import sys
import threading
from collections import deque

import wal

from wal_payload import make_payload


def main() -> None:
    path, rnd, nthreads, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = wal.WALConfig(capacity=capacity, batch_bytes=256 * 1024, object_bytes=256 * 1024, full_timeout=60)
    if path.startswith("objects+"):
        from s3stream.engine.walopen import open_node_wal
        w = open_node_wal(path, node_id=1, config=config)
    else:
        w = wal.WriteAheadLog.open(path, node_id=1, config=config)
    recovered = list(w.recover())
    if recovered:
        print(f"trim {recovered[-1].end}", flush=True)
        w.trim(recovered[-1].end)     # the parent verified them; as an engine would after upload
    out = sys.stdout
    lock = threading.Lock()
    print(f"ready {len(recovered)}", file=out, flush=True)
    last_acked = [0]

    def worker(t: int) -> None:
        pending: deque = deque()
        seq = 0
        while True:
            pending.append((w.append(make_payload(rnd, t, seq)), seq))
            seq += 1
            if len(pending) >= 32:
                h, s = pending.popleft()
                h.result()
                with lock:
                    out.write(f"ack {t} {s} {h.offset}\n")
                    out.flush()
                    last_acked[0] = max(last_acked[0], h.offset)
                    if w.durable_end - w.trim_offset > capacity // 2:
                        out.write(f"trim {last_acked[0]}\n")
                        out.flush()
                        w.trim(last_acked[0])

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


if __name__ == "__main__":
    main()
