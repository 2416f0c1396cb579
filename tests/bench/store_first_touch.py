"""How fast the local object store takes new bytes, GiB after GiB: what bounds the main job's
steady state when its stand-in for S3 is a directory on a RAM disk. A standalone script (not
collected by pytest):

    python tests/bench/store_first_touch.py [--dir /dev/shm/probe] [--gib 10] [--object 16M] [--keep GIB]

It PUTs `--gib` GiB of `--object`-sized objects through LocalObjectStore (the main job's store
and block size), printing MB/s for each GiB, then deletes them and does it again at once.

On a VM whose host takes back memory the guest has freed (free page reporting, ballooning),
the first pass runs fast only as far as memory the guest touched recently reaches; past it,
every new RAM-disk page is first faulted in by the host, several times slower. The second
pass reuses the pages the first one freed a moment before. With `--keep`, one pass deletes
the oldest objects beyond that many GiB as it goes: the footprint stays bounded and the pages
are reused before the host takes them back (the main job's retention does the same). On the 2-core development VM
(2026-11-23, `--gib 12`): 3,627-3,923 MB/s for the first 4 GiB, then 386-673 MB/s; the
second pass 3,837-4,034 MB/s (two GiB near 2,100). A node of the main job run alone
acknowledged 1,022-1,491 MB/s for 3 s, then 562-587 MB/s, the step falling where the store's
bytes left that memory (5 s later when 11 GiB had been touched and freed just before the run).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from s3stream.objectstore.local import LocalObjectStore  # noqa: E402
from benchmarks.kit import parse_size  # noqa: E402

GiB = 1 << 30


def one_pass(store: LocalObjectStore, total: int, size: int, tag: str, keep: int | None = None) -> list[float]:
    """PUT `total` bytes in objects of `size`; MB/s of each GiB. With `keep`, the oldest objects
    beyond `keep` bytes are deleted as it goes (a store with retention)."""
    data = os.urandom(size)
    speeds, written, mark, key = [], 0, time.perf_counter(), 0
    next_gib = GiB
    while written < total:
        store.put(f"{tag}/{key:08d}", data)
        key += 1
        written += size
        if keep is not None and written > keep:
            store.delete([f"{tag}/{key - 1 - keep // size:08d}"])
        if written >= next_gib or written >= total:
            now = time.perf_counter()
            span = written - (next_gib - GiB)
            speeds.append(span / (now - mark) / 1e6)
            mark, next_gib = now, next_gib + GiB
    return speeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm/s3stream-first-touch" if os.path.isdir("/dev/shm") else
                    os.path.join(os.getcwd(), "first-touch"))
    ap.add_argument("--gib", type=float, default=10.0, help="GiB written in each pass")
    ap.add_argument("--object", type=parse_size, default=16 << 20, help="object size (the main job's block)")
    ap.add_argument("--keep", type=float, default=None, metavar="GIB",
                    help="delete the oldest objects beyond this many GiB as the pass goes (retention); "
                         "one pass only")
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    store = LocalObjectStore(args.dir)
    total = int(args.gib * GiB)
    keep = None if args.keep is None else int(args.keep * GiB)
    try:
        for tag in ("first", "again") if keep is None else (f"keep {args.keep:g} GiB",):
            speeds = one_pass(store, total, args.object, tag.replace(" ", "-"), keep)
            print(f"{tag:>5} pass, MB/s per GiB: " + " ".join(f"{s:,.0f}" for s in speeds), flush=True)
            shutil.rmtree(os.path.join(args.dir, tag.replace(" ", "-")), ignore_errors=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
