"""A real crash against the model (issue 10): hypothesis picks the operations (appends of several
sizes and counts, trims, close-and-reopen) and when to SIGKILL the node process running them
(tests/children/engine_ops_child.py); a fresh node then recovers, and every stream must read back as a
prefix of what was sent that holds everything acknowledged, byte for byte, from at least the
last acknowledged trim. The in-process model test (test_engine_model.py) crashes by draining the
ring; this one kills the process wherever it is."""
from __future__ import annotations

import pytest

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s3stream import StreamClient
from engine_ops_child import CONFIG, STREAMS, payload

HERE = Path(__file__).parent
CHILDREN = HERE.parent / "children"

OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(0, STREAMS - 1), st.sampled_from([1, 100, 3000, 20_000]),
              st.integers(1, 3), st.integers(1, 6)),
    st.tuples(st.just("trim"), st.integers(0, STREAMS - 1), st.integers(0, 10)),
    st.tuples(st.just("reopen"), st.integers(0, STREAMS - 1)),
), min_size=3, max_size=30)


def run_until_killed(tmp: Path, ops: list, kill_after: float) -> dict:
    (tmp / "ops.json").write_text(json.dumps(ops))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(CHILDREN / "engine_ops_child.py"), str(tmp), str(tmp / "ops.json")],
                            stdout=subprocess.PIPE, text=True, env=env)
    out = dict(ids={}, acks={}, trims={})
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            kind, *rest = line.split()
            if kind == "stream":
                out["ids"][int(rest[0])] = int(rest[1])
            elif kind == "ready":
                ready.set()
            elif kind == "ack":
                index, seq, base, count = map(int, rest)
                out["acks"][(index, seq)] = (base, count)
            elif kind == "trim":
                out["trims"][int(rest[0])] = int(rest[1])

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    assert ready.wait(60), "the node process did not start"
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t.join(10)
    return out


def sent_batches(ops: list, index: int, upto: int, seqs: int) -> list[tuple[int, int, bytes]]:
    """(base, count, payload) of the appends the child sends to stream `index`, in order (it runs
    `ops` over and over), until offset `upto` and `seqs` batches are both covered."""
    appends = [op for op in ops if op[0] == "append" and op[1] == index]
    out, seq, base = [], 0, 0
    while appends and (base <= upto or seq < seqs):
        for _, _, size, count, n in appends:
            for _ in range(n):
                out.append((base, count, payload(index, seq, size)))
                base += count
                seq += 1
    return out


@settings(max_examples=int(os.environ.get("KILL_MODEL_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
@given(ops=OPS, kill_after=st.floats(0.0, 0.4))
def test_sigkill_at_any_point_keeps_what_was_acknowledged(ops, kill_after):
    tmp = Path(tempfile.mkdtemp(prefix="s3s-kill-"))
    try:
        run = run_until_killed(tmp, [list(op) for op in ops], kill_after)
        client = StreamClient(1, tmp / "node1.wal", f"file://{tmp}/objects", f"sqlite:///{tmp}/meta.db", CONFIG)
        try:
            for index, sid in run["ids"].items():
                acked = {seq: v for (i, seq), v in run["acks"].items() if i == index}
                s = client.open_stream(sid)
                end = s.confirm_offset
                sent = sent_batches(ops, index, end, max(acked, default=-1) + 1)
                for seq, (base, count) in acked.items():
                    assert (sent[seq][0], sent[seq][1]) == (base, count)
                # Everything acknowledged is there; what is there is a prefix of what was sent.
                must = max((b + c for b, c in acked.values()), default=0)
                assert end >= must, f"stream {index}: acknowledged up to {must}, recovered only to {end}"
                assert end in {b + c for b, c, _ in sent} | {0}, f"stream {index}: end {end} splits a batch"
                assert s.start_offset >= run["trims"].get(index, 0)
                got, pos = [], s.start_offset
                while pos < end:
                    res = s.fetch(pos, max_bytes=1 << 20)
                    got += [(b.base_offset, b.count, bytes(b.payload)) for b in res.batches]
                    pos = res.end_offset
                first = next((i for i, (b, c, _) in enumerate(sent) if b + c > s.start_offset), len(sent))
                assert got == [x for x in sent[first:] if x[0] < end]
        finally:
            client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
