"""Child of the first-fill crash test: appends while a slow background fill runs, until SIGKILLed.

Usage: wal_fill_child.py PATH ROUND CAPACITY
Prints "ready N" after recovering N records and "ack THREAD SEQ OFFSET END" after each record's
append was acknowledged as durable. The filler writes 64 KiB chunks with a pause before each, so
the appenders catch up with it and wait at the fill mark.
"""
import sys
import threading
import time
from collections import deque

import wal
from wal.fill import ZeroFiller

from wal_payload import make_payload

THREADS = 2


def main() -> None:
    path, rnd, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ZeroFiller.chunk_bytes = 64 * 1024
    ZeroFiller.before_chunk = lambda offset: time.sleep(0.01)
    w = wal.WriteAheadLog.open(path, node_id=1, config=wal.WALConfig(
        capacity=capacity, batch_bytes=64 * 1024, full_timeout=60, preallocate="background"))
    recovered = list(w.recover())
    out = sys.stdout
    lock = threading.Lock()
    print(f"ready {len(recovered)}", file=out, flush=True)

    def worker(t: int) -> None:
        pending: deque = deque()
        seq = 0
        while True:
            pending.append((w.append(make_payload(rnd, t, seq)), seq))
            seq += 1
            if len(pending) >= 8:
                h, s = pending.popleft()
                h.result()
                with lock:
                    out.write(f"ack {t} {s} {h.offset} {h.end}\n")
                    out.flush()

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


if __name__ == "__main__":
    main()
