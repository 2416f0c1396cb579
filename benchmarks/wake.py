"""How late a node agent's thread runs when it wakes (issue 28's tail): one node under paced
appends, and a probe thread at the agent's priority (ClusterConfig.agent_priority above the
process) that sleeps 1 ms again and again and records how late it got back to Python: the
kernel's wake-up, then the GIL. A move is a chain of such wake-ups (every metadata round trip
ends in one, in the driver's, the source's and the target's processes), so their tail is the
moves' tail.

    python3 -m s3stream bench --kind wake [-- --rounds 3 --seconds 3 --busy 2 --rate 100]

Five cases, alternating within one run: quiet (the probe alone), busy (`--busy` processes spin
on the cores), appends (producers append to the node, nothing else on the box), appends+busy
(both), and appends+busy with the probe in a process of its own (no GIL shared with the node).

On 2 cores on 2026-11-27 (a VM, kernel 6.18, PREEMPT_NONE, HZ=250), 3 rounds of 3 s: the probe
was late p99 0.1-0.4 ms (per round) in quiet, busy and appends, 2.9-5.4 ms in appends+busy, and
0.13-0.24 ms in appends+busy with the probe apart. So the wait is the node process's, not the
kernel's alone: the likeliest cause is the GIL's hand-over, the probe woken by the thread that
let the GIL go and waiting behind it for a core while both are busy. What did not shorten it,
each tried in 2-3 rounds in runs next to the default's (appends+busy stayed at p99 3.6-5.3 ms):
`--switch-interval 0.0005`; every thread of the process at nice -10 (so the spinning processes
cannot preempt a GIL holder); upload threads at nice 0 or 10 without SCHED_IDLE; the probe given
a 0.1 ms EEVDF slice (sched_setattr, at the process's nice). A move is some 10-20 such wake-ups
in a row (round trips and hand-offs), so cutting their number is the lever left.

Writes report.json and wake.png under `--out`. No target: the figures explain the moves' tail.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import wal
from benchmarks.kit import percentiles, publish, pyplot, save_figure

from s3stream.client import StreamClient
from s3stream.config import Config, GiB, MiB
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore
from s3stream.batches import RecordBatch
from s3stream.threads import thread_nice

CASES = ("quiet", "busy", "appends", "appends+busy", "appends+busy, probe apart")
#: The probe's sleep: a short wait ended by the kernel, as a metadata round trip's is.
PROBE_SLEEP_S = 0.001
#: CPython's default switch interval, the reference the figures are read against.
DEFAULT_SWITCH_INTERVAL_S = 0.005


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind wake", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of the cases")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per case and round")
    p.add_argument("--busy", type=int, default=2, help="spinning processes in the busy cases (one per core)")
    p.add_argument("--rate", type=float, default=100.0, help="MB/s the producers append in all, paced")
    p.add_argument("--producers", type=int, default=3, help="producer threads, one stream each")
    p.add_argument("--batch", type=int, default=64 * 1024, help="bytes per append")
    p.add_argument("--priority", type=int, default=10, help="the probe's nice steps above the process "
                   "(ClusterConfig.agent_priority)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run")
    p.add_argument("--workdir", default=None, help="where the WAL and the objects go (default: a temporary "
                   "directory)")
    p.add_argument("--out", default="reports/wake", help="report directory")
    p.add_argument("--quick", action="store_true", help="1 round of 0.3 s cases, 20 MB/s")
    return p


class _Producers:
    """`n` threads appending `batch`-byte records to their own stream at `rate` bytes/s in all,
    at most 32 appends pending each; paced in 5 ms ticks like spark_bench's nodes."""

    def __init__(self, streams: list, batch: int, rate: float) -> None:
        self.stop = threading.Event()
        self.appended = [0] * len(streams)
        record = RecordBatch(os.urandom(batch), 1)
        interval = batch / (rate / len(streams))

        def body(i: int) -> None:
            window: collections.deque = collections.deque()
            due = time.monotonic()
            while not self.stop.is_set():
                due += interval
                ahead = due - time.monotonic()
                if ahead > 0.005:
                    self.stop.wait(ahead)
                window.append(streams[i].append(record))
                if len(window) > 32:
                    window.popleft().result()
                self.appended[i] += 1
            while window:
                window.popleft().result()

        self.threads = [threading.Thread(target=body, args=(i,), name=f"wake-producer-{i}", daemon=True)
                        for i in range(len(streams))]
        for t in self.threads:
            t.start()

    def close(self) -> int:
        self.stop.set()
        for t in self.threads:
            t.join()
        return sum(self.appended)


def sleep_loop(seconds: float, priority: int) -> list[int]:
    """On the calling thread, raised `priority` nice steps above the process (kept at the
    process's if that is refused): oversleeps in ns of PROBE_SLEEP_S sleeps for `seconds`."""
    thread_nice(-priority)
    asleep = int(PROBE_SLEEP_S * 1e9)
    late: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        time.sleep(PROBE_SLEEP_S)
        late.append(time.perf_counter_ns() - t0 - asleep)
    return late


def probe(seconds: float, priority: int) -> list[int]:
    """`sleep_loop` on a thread of this process."""
    late: list[int] = []
    t = threading.Thread(target=lambda: late.extend(sleep_loop(seconds, priority)), name="wake-probe")
    t.start()
    t.join()
    return late


def probe_apart(seconds: float, priority: int) -> list[int]:
    """`sleep_loop` in a process of its own (sharing no GIL with this one)."""
    code = ("import json, sys; from benchmarks.wake import sleep_loop; "
            "print(json.dumps(sleep_loop(float(sys.argv[1]), int(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, str(seconds), str(priority)], capture_output=True,
                          text=True, check=True, timeout=seconds + 60)
    return json.loads(done.stdout)


def summary(late_ns: list[int]) -> dict:
    return dict(percentiles(late_ns), over_2ms=sum(x > 2_000_000 for x in late_ns))


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.rate = 1, 0.3, 20.0
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    work = tempfile.mkdtemp(prefix="s3stream-wake-", dir=args.workdir)
    config = Config(upload_threshold=16 * MiB, split_size=8 * MiB, cache_size=256 * MiB, max_batch_bytes=MiB,
                    wal=wal.WALConfig(capacity=GiB, full_timeout=60.0))
    client = StreamClient(1, os.path.join(work, "node1.wal"), LocalObjectStore(os.path.join(work, "objects")),
                          SqliteMetadataStore(os.path.join(work, "metadata.db")), config)
    samples: dict[str, list[int]] = {case: [] for case in CASES}
    rounds = []
    try:
        streams = [client.create_stream() for _ in range(args.producers)]
        for r in range(args.rounds):
            for case in CASES:
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(args.busy if "busy" in case else 0)]
                producers = _Producers(streams, args.batch, args.rate * 1e6) if "appends" in case else None
                try:
                    time.sleep(0.2 if args.quick else 1.0)       # the producers reach their pace
                    late = (probe_apart if "apart" in case else probe)(args.seconds, args.priority)
                finally:
                    appended = producers.close() if producers else 0
                    for p in busy:
                        p.kill()
                        p.wait()
                samples[case] += late
                rounds.append(dict(round=r, case=case, appended=appended, **summary(late)))
                print(f"  round {r + 1}/{args.rounds} {case:>26}: p99 {rounds[-1]['p99_ms']:.2f} ms late, "
                      f"max {rounds[-1]['max_ms']:.1f} ms", flush=True)
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)
    report = dict(kind="wake", cpus=os.cpu_count(), busy=args.busy, rate_mb_s=args.rate, producers=args.producers,
                  batch=args.batch, priority=args.priority, switch_interval_s=sys.getswitchinterval(),
                  default_switch_interval_s=DEFAULT_SWITCH_INTERVAL_S, probe_sleep_s=PROBE_SLEEP_S,
                  cases={case: summary(samples[case]) for case in CASES}, rounds=rounds)
    return publish(report, args.out, plot, format_report)


def format_report(report: dict) -> str:
    lines = [f"Wake-ups of a thread {report['priority']} nice steps above the process, {report['cpus']} cores, "
             f"sleeping {report['probe_sleep_s'] * 1e3:g} ms (producers: {report['producers']} at "
             f"{report['rate_mb_s']:g} MB/s; busy: {report['busy']} spinning processes; switch interval "
             f"{report['switch_interval_s'] * 1e3:g} ms, CPython's default "
             f"{report['default_switch_interval_s'] * 1e3:g} ms). How late, ms:",
             f"  {'case':>26}   samples    p50    p99  p99.9    max  > 2 ms"]
    for case, s in report["cases"].items():
        if s["samples"]:
            lines.append(f"  {case:>26}  {s['samples']:8d}  {s['p50_ms']:5.2f}  {s['p99_ms']:5.2f}  {s['p999_ms']:5.2f}"
                         f"  {s['max_ms']:5.1f}  {s['over_2ms']:6d}")
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.wake")
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    cases = [c for c, s in report["cases"].items() if s["samples"]]
    for i, (key, label) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))):
        ax.bar([x + i * 0.27 for x in range(len(cases))], [report["cases"][c][key] for c in cases], width=0.27,
               label=label)
    ax.set_xticks([x + 0.27 for x in range(len(cases))], [c.replace(", ", "\n") for c in cases], fontsize=8)
    ax.set_ylabel("ms late")
    ax.set_title("A high-priority thread's wake-ups in a node process")
    ax.legend()
    return [save_figure(plt, fig, out, "wake.png")]


if __name__ == "__main__":
    run()
