"""kill -9 a process appending from several threads, many times: nothing acknowledged is lost."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

from testpaths import CHILDREN

import pytest

import wal
from conftest import MiB, detach, loop_device
from wal_payload import parse_payload

CHILD = CHILDREN / "wal_crash_child.py"
ROUNDS = int(os.environ.get("WAL_CRASH_ROUNDS", "12"))


def run_round(path: str, rnd: int, capacity: int, rng: random.Random) -> tuple[dict, list[int]]:
    """Start the child, kill it at a random moment; return its acks {(thread, seq): offset}
    and the trim offsets it announced."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(CHILD), path, str(rnd), "4", str(capacity)],
                            stdout=subprocess.PIPE, text=True, env=env)
    acks: dict = {}
    trims: list[int] = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            kind, *rest = line.split()
            if kind == "ready":
                ready.set()
            elif kind == "ack":
                t, s, off = map(int, rest)
                acks[(t, s)] = off
            elif kind == "trim":
                trims.append(int(rest[0]))

    th = threading.Thread(target=reader)
    th.start()
    assert ready.wait(60), "child did not start"
    time.sleep(rng.uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    th.join()
    return acks, trims


def open_for_recovery(path: str):
    if path.startswith("objects+"):
        from s3stream.engine.walopen import open_node_wal
        return open_node_wal(path, node_id=1, recovery=True)
    return wal.WriteAheadLog.open(path, node_id=1, recovery=True)


def verify(path: str, rnd: int, acks: dict, trims: list[int], previous_trim: int) -> int:
    """Check the WAL after a kill; returns its trim offset."""
    with open_for_recovery(path) as w:
        trim = w.trim_offset
        recs = list(w.recover())
    # the durable trim offset is one the child asked for (or the one it started from)
    assert trim == previous_trim or trim in trims
    offsets = [r.offset for r in recs]
    assert offsets == sorted(offsets)
    by_key = {}
    for r in recs:
        r_rnd, t, s = parse_payload(r.data)            # byte-exact and really appended
        assert r_rnd == rnd, "the child trimmed earlier rounds' records before starting"
        by_key[(r_rnd, t, s)] = r.offset
    # every acknowledged record after the durable trim offset is there, at its offset
    for (t, s), off in acks.items():
        if off >= trim:
            assert by_key.get((rnd, t, s)) == off, f"acknowledged record thread {t} seq {s} lost"
    # per thread, this round's records form a gap-free run: nothing unacknowledged out of order
    for t in range(4):
        seqs = [s for (r_rnd, tt, s) in by_key if r_rnd == rnd and tt == t]
        if seqs:
            assert sorted(seqs) == list(range(min(seqs), max(seqs) + 1)), f"gap in thread {t}"
    return trim


def crash_rounds(path: str, capacity: int, rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    total_acked = 0
    trim = 0
    for rnd in range(rounds):
        acks, trims = run_round(path, rnd, capacity, rng)
        trim = verify(path, rnd, acks, trims, trim)
        total_acked += len(acks)
    return total_acked


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "blockdev", "objects"])
def test_sigkill_during_appends_loses_nothing_acknowledged(tmp_path, kind):
    """Over a WAL of objects (a local directory store) the kill lands mid-PUT as often as not."""
    capacity = 8 * MiB
    dev = None
    if kind == "file":
        path = str(tmp_path / "crash.wal")
    elif kind == "objects":
        path = f"objects+file://{tmp_path}/walobjects"
    else:
        dev = path = loop_device(str(tmp_path / "crash.img"), capacity)
    try:
        acked = crash_rounds(path, capacity, ROUNDS, seed={"file": 42, "blockdev": 43}.get(kind, 44))
    finally:
        if dev:
            detach(dev)
    assert acked > ROUNDS * 50, "the child should acknowledge many records per round"
