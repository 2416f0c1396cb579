"""Records benchmark (issue 29): Kafka record batches encoded and decoded per second on one core,
and what append_records costs against appending the same bytes.

    python3 -m s3stream bench --kind records [--quick] [-- --records 100 --seconds 0.5 --rounds 3]

Everything is measured in one run, each figure next to what it is compared with:
- The codecs: s3stream.records (the native core), s3stream.records.reference (its pure-Python
  twin) and kafka-python (DefaultRecordBatchBuilder to encode, DefaultRecordBatch to decode, its
  CRC checked as its consumer does by default) on batches of --records records with 100 B and
  1 KiB values (a 10-byte key and a 16-byte header each; text-like values, so that zstd pays),
  uncompressed and zstd. Records/s and MB/s of keys and values per case, and the ratios
  native/reference and native/kafka-python side by side. The implementations take turns within
  each of --rounds rounds (the medians are reported), so drift of the machine hits them alike.
  Every implementation decodes the same bytes (the native encoder's).
- append_records against append: one StreamClient (WAL in a temporary directory, local object
  store, SQLite metadata) appends N batches of --records 100 B (and 1 KiB) records per round with
  Stream.append_records(records), and N with Stream.append(RecordBatch(the same batch
  pre-encoded, n)), --inflight pending, in alternating pairs of rounds after uncounted ones (until
  the WAL has gone round once); N batches make --append-round bytes, and everything is uploaded
  between rounds (untimed), so that no round pays for another's upload. A round does pay for
  its own stream's tail uploads: with the engine's default stream_tail_limit (twice split_size
  of bytes no PUT carried yet) a stream's appends wait for PUTs when uploads fall behind, which
  both sides pay alike;
  --stream-tail-limit 0 takes them out of the rounds (the append path alone, no upload). The
  median of the pairs' ratios is judged against the issue's target: append_records/append >= 0.9.
- Idempotent appends against plain ones: the same rounds, on two partitions of that client,
  Partition.append_records(records, producer=p) against Partition.append_records(records);
  target (issue 29): idempotent/plain >= 0.95.

Report: report.json and records.png in --out (default reports/records-bench).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import wal
from benchmarks.kit import fmt_size, log_line, parse_size, progress, publish, pyplot, save_figure

from s3stream import records as native_records
from s3stream.records import reference as records_reference
from benchmarks.engine import lean_producers
from s3stream.client import StreamClient
from s3stream.config import Config, GiB, MiB
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore
from s3stream.batches import RecordBatch
from s3stream.records import COMPRESSION_CODECS, Record
from s3stream.cluster import open_partition

#: The issue's target: appending Records costs at most 10% against appending their bytes.
TARGET_APPEND_RATIO = 0.9
TARGET_IDEMPOTENT_RATIO = 0.95
VALUE_SIZES = (100, 1024)
CODECS: tuple[str | None, ...] = (None, "zstd")
IMPLEMENTATIONS = ("native", "reference", "kafka-python")
_WORDS = (b"user", b"session", b"click", b"page", b"view", b"checkout", b"cart", b"item", b"price", b"region",
          b"eu-west", b"us-east", b"mobile", b"desktop", b"referrer", b"search", b"campaign", b"2024", b"ok")


def _progress(msg: str) -> None:
    log_line(f"[benchmarks.records {time.strftime('%H:%M:%S')}] {msg}")


def make_records(count: int, value_size: int, seed: int = 0) -> list[Record]:
    """`count` records with a 10-byte key, a `value_size`-byte text-like value (compressible, as
    JSON or log lines are), consecutive timestamps and one 16-byte header."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        value = bytearray()
        while len(value) < value_size:
            value += rng.choice(_WORDS) + b" %d " % rng.randrange(1000)
        out.append(Record(b"key-%06d" % i, bytes(value[:value_size]), 1_700_000_000_000 + i,
                          (("trace-id", rng.randbytes(16)),)))
    return out


class Codec:
    """One implementation: encode(records, compression) -> bytes, decode(batch) -> records read."""

    def __init__(self, name: str, encode: Callable[[list[Record], str | None], bytes],
                 decode: Callable[[bytes], int]) -> None:
        self.name, self.encode, self.decode = name, encode, decode


def _ours(name: str, module: ModuleType) -> Codec:
    def encode(records: list[Record], compression: str | None) -> bytes:
        return module.encode_batch(records, compression=compression)

    def decode(batch: bytes) -> int:
        return len(module.decode_batch(batch).records)

    return Codec(name, encode, decode)


def _kafka_python() -> tuple[Codec | None, str]:
    """kafka-python's codec, and a note: which CRC-32C it uses, or why it is missing."""
    try:
        with warnings.catch_warnings():  # kafka-python loads its protocol schemas with deprecated calls
            warnings.simplefilter("ignore", DeprecationWarning)
            from kafka.record import util as kafka_util  # type: ignore[import-untyped]
            from kafka.record.default_records import (  # type: ignore[import-untyped]
                DefaultRecordBatch, DefaultRecordBatchBuilder,
            )
    except ImportError as e:
        return None, f"kafka-python is not installed ({e}): pip install kafka-python zstandard"
    crc = "pure-Python CRC-32C" if kafka_util.crc32c_c is None else "CRC-32C of the crc32c package"

    def encode(records: list[Record], compression: str | None) -> bytes:
        builder = DefaultRecordBatchBuilder(2, COMPRESSION_CODECS.index(compression), False, -1, -1, -1, 1 << 30)
        for offset, r in enumerate(records):
            builder.append(offset, r.timestamp, r.key, r.value, list(r.headers))
        return bytes(builder.build())

    def decode(batch: bytes) -> int:
        read = DefaultRecordBatch(batch)
        if not read.validate_crc():
            raise AssertionError("kafka-python finds a bad CRC")
        count = 0
        for r in read:
            (r.offset, r.timestamp, r.key, r.value, r.headers)
            count += 1
        return count

    return Codec("kafka-python", encode, decode), f"kafka-python with its {crc}"


def _calls_per_second(fn: Callable[[], Any], seconds: float) -> float:
    fn()                                             # warm: caches, lazy imports
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        fn()
        calls += 1
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


def bench_codecs(codecs: list[Codec], records_per_batch: int, seconds: float, rounds: int) -> list[dict]:
    """Each case (value size x compression): records/s and MB/s of every codec, medians of rounds."""
    cases = []
    bar = progress(total=len(VALUE_SIZES) * len(CODECS) * rounds, desc="codecs", unit="round")
    for value_size in VALUE_SIZES:
        records = make_records(records_per_batch, value_size)
        record_bytes = sum(len(r.key or b"") + len(r.value or b"") for r in records)
        for compression in CODECS:
            batch = native_records.encode_batch(records, compression=compression)
            rates: dict[str, dict[str, list[float]]] = {c.name: {"encode": [], "decode": []} for c in codecs}
            for round_ in range(rounds):
                for codec in codecs[round_ % len(codecs):] + codecs[:round_ % len(codecs)]:
                    if codec.decode(batch) != records_per_batch:
                        raise AssertionError(f"{codec.name} decoded another number of records")
                    rates[codec.name]["encode"].append(
                        records_per_batch * _calls_per_second(lambda: codec.encode(records, compression), seconds))
                    rates[codec.name]["decode"].append(
                        records_per_batch * _calls_per_second(lambda: codec.decode(batch), seconds))
                bar.update()
            impls: dict[str, dict[str, float]] = {}
            for name, ops in rates.items():
                impls[name] = {}
                for op, samples in ops.items():
                    records_s = statistics.median(samples)
                    impls[name][f"{op}_records_s"] = records_s
                    impls[name][f"{op}_mb_s"] = records_s * record_bytes / records_per_batch / 1e6
            ratios = {}
            for op in ("encode", "decode"):
                for other in ("reference", "kafka-python"):
                    if other in impls:
                        ratios[f"{op}_native_{other}"] = impls["native"][f"{op}_records_s"] / impls[other][f"{op}_records_s"]
            cases.append(dict(value_size=value_size, compression=compression, records=records_per_batch,
                              batch_bytes=len(batch), record_bytes=record_bytes, impls=impls, ratios=ratios))
    bar.close()
    return cases


def bench_append(records_per_batch: int, round_bytes: int, pairs: int, inflight: int, workdir: str | None,
                 warmup: int | None = None, stream_tail_limit: int | None = None) -> tuple[list[dict], list[dict]]:
    """Per value size, in alternating pairs of rounds (after uncounted ones), records/s of each
    side and the median of the pairs' ratios, for two comparisons: append_records against append
    of the same bytes (streams), and idempotent appends (append_records with a producer) against
    plain ones (partitions). A round appends `round_bytes` of batches; everything is uploaded
    between rounds, untimed, so that no round pays for another's upload."""
    from s3stream.records.producers import new_producer
    work = tempfile.mkdtemp(prefix="s3stream-records-", dir=workdir)
    threshold = max(4 * round_bytes, 64 * MiB)             # never reached within a round
    capacity = 2 * threshold
    config = Config(upload_threshold=threshold, cache_size=2 * threshold, reclaim_interval=None,
                    stream_tail_limit=stream_tail_limit,
                    wal=wal.WALConfig(capacity=capacity, full_timeout=60.0))
    if warmup is None:
        # Uncounted pairs first, until the WAL has gone round once: its first pass over the
        # file is slower (and the first rounds of a process warm up more than the WAL).
        warmup = -(-capacity // (2 * round_bytes))
    client = StreamClient(1, os.path.join(work, "node1.wal"), LocalObjectStore(os.path.join(work, "store")),
                          SqliteMetadataStore(os.path.join(work, "meta.db")), config)
    append, idempotent = [], []
    try:
        bar = progress(total=2 * len(VALUE_SIZES) * (pairs + warmup), desc="append", unit="pair")
        producer = new_producer(client)
        for value_size in VALUE_SIZES:
            records = make_records(records_per_batch, value_size)
            batch = RecordBatch(native_records.encode_batch(records), records_per_batch)
            batches = max(1, round_bytes // len(batch.payload))
            as_records, as_bytes = client.create_stream(), client.create_stream()
            plain, produced = open_partition(client, f"plain-{value_size}"), open_partition(client, f"idem-{value_size}")

            def idempotent_append(records: list[Record], _p=produced) -> Any:
                return _p.append_records(records, producer=producer)
            shape = dict(value_size=value_size, records=records_per_batch, batches=batches,
                         batch_bytes=len(batch.payload), stream_tail_limit=config.stream_tail_limit)
            append.append(dict(shape, **_paired(client, {
                "append_records": lambda: _append_rate(as_records.append_records, records, batches, inflight),
                "append": lambda: _append_rate(as_bytes.append, batch, batches, inflight),
            }, pairs, warmup, records_per_batch, bar)))
            idempotent.append(dict(shape, **_paired(client, {
                "idempotent": lambda: _append_rate(idempotent_append, records, batches, inflight),
                "plain": lambda: _append_rate(plain.append_records, records, batches, inflight),
            }, pairs, warmup, records_per_batch, bar)))
        bar.close()
    finally:
        client.close()
        shutil.rmtree(work, ignore_errors=True)
    return append, idempotent


def _paired(client: StreamClient, sides: dict[str, Callable[[], float]], pairs: int, warmup: int,
            records_per_batch: int, bar: Any) -> dict:
    """Rounds of the two `sides` (batches/s) in alternating order, everything uploaded after
    each; the counted rounds' records/s, the pairs' ratios (first side over second) and their
    median, and each side's median records/s."""
    first, second = sides
    rounds: list[dict] = []
    for pair in range(-warmup, pairs):          # pairs below 0: warm-up, uncounted
        rates = {}
        for side in ((first, second) if pair % 2 == 0 else (second, first)):
            rates[side] = sides[side]() * records_per_batch
            client.force_upload(60)
        if pair >= 0:
            rounds.append(dict(pair=pair, **{f"{side}_records_s": r for side, r in rates.items()}))
        bar.update()
    ratios = [r[f"{first}_records_s"] / r[f"{second}_records_s"] for r in rounds]
    return dict(rounds=rounds, pair_ratios=ratios, ratio=statistics.median(ratios),
                **{f"{side}_records_s": statistics.median(r[f"{side}_records_s"] for r in rounds) for side in sides})


def _append_rate(append: Callable[[Any], Any], arg: Any, batches: int, inflight: int) -> float:
    """Batches per second of `batches` calls of append(arg), `inflight` pending at a time."""
    sent, seconds = lean_producers([append], arg, batches, inflight, 600.0)
    return sent / seconds


def format_report(report: dict) -> str:
    names = [n for n in IMPLEMENTATIONS if n in report["implementations"]]
    lines = ["=" * 118, f"Kafka record batches v2, {report['records']} records a batch, one core: records/s "
             f"(MB/s of keys and values); {report['kafka_python']}"]
    head = f"  {'case':<16}{'':<8}" + "".join(f"{n:>22}" for n in names)
    head += "".join(f"{'native/' + n:>20}" for n in names[1:])
    lines.append(head)
    for case in report["cases"]:
        label = f"{case['value_size']} B, {case['compression'] or 'none'}"
        for op in ("encode", "decode"):
            row = f"  {label:<16}{op:<8}"
            for n in names:
                impl = case["impls"][n]
                row += f"{impl[f'{op}_records_s']:>12,.0f} ({impl[f'{op}_mb_s']:>6,.1f})".rjust(22)
            row += "".join(f"{case['ratios'][f'{op}_native_{n}']:>20.1f}" for n in names[1:])
            lines.append(row)
            label = ""
    lines.append("")
    tail = report["append"][0]["stream_tail_limit"] if report["append"] else None
    lines.append(f"append_records against append of the same bytes (one StreamClient: WAL, local store, SQLite; "
                 f"{report['records']} records a batch; alternating rounds, uploads between them; stream tails "
                 f"uploaded {'every ' + fmt_size(tail) if tail else 'only between rounds'} (stream_tail_limit)):")
    for a in report["append"]:
        lines.append(f"  {a['value_size']:>5} B values, {a['batches']:,} batches a round: append_records {a['append_records_records_s']:>10,.0f} "
                     f"records/s, append {a['append_records_s']:>10,.0f} records/s; ratio {a['ratio']:.3f} "
                     f"(median of {len(a['pair_ratios'])} pairs: {', '.join(f'{r:.2f}' for r in a['pair_ratios'])})")
    lines.append(f"Target (issue 29): append_records/append >= {TARGET_APPEND_RATIO}: "
                 + ", ".join(f"{a['value_size']} B {a['ratio']:.3f} {'met' if a['met'] else 'MISSED'}"
                             for a in report["append"]))
    lines.append("idempotent appends (Partition.append_records with a producer) against plain ones, same rounds:")
    for a in report["idempotent"]:
        lines.append(f"  {a['value_size']:>5} B values: idempotent {a['idempotent_records_s']:>10,.0f} records/s, plain "
                     f"{a['plain_records_s']:>10,.0f} records/s; ratio {a['ratio']:.3f} (median of "
                     f"{len(a['pair_ratios'])} pairs: {', '.join(f'{r:.2f}' for r in a['pair_ratios'])})")
    lines.append(f"Target (issue 29): idempotent/plain >= {TARGET_IDEMPOTENT_RATIO}: "
                 + ", ".join(f"{a['value_size']} B {a['ratio']:.3f} {'met' if a['met'] else 'MISSED'}"
                             for a in report["idempotent"]))
    lines.append("=" * 118)
    return "\n".join(lines)


def plot(report: dict, out: str) -> list[str]:
    plt = pyplot("benchmarks.records")
    if plt is None:
        return []
    names = [n for n in IMPLEMENTATIONS if n in report["implementations"]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw=dict(width_ratios=[2, 2, 1]))
    labels = [f"{c['value_size']} B\n{c['compression'] or 'none'}" for c in report["cases"]]
    width = 0.8 / len(names)
    for ax, op in zip(axes, ("encode", "decode")):
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(labels))],
                   [c["impls"][n][f"{op}_records_s"] for c in report["cases"]], width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
        ax.set_yscale("log")
        ax.set_ylabel("records / s (one core)")
        ax.set_title(f"{op}, {report['records']} records a batch")
        ax.legend()
    ax = axes[2]
    sizes = [f"{a['value_size']} B" for a in report["append"]]
    ax.bar([j - 0.2 for j in range(len(sizes))], [a["append_records_records_s"] for a in report["append"]], 0.4,
           label="append_records")
    ax.bar([j + 0.2 for j in range(len(sizes))], [a["append_records_s"] for a in report["append"]], 0.4,
           label="append (same bytes)")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_yscale("log")
    ax.set_ylabel("records / s")
    ratios = ", ".join(f"{a['ratio']:.2f}" for a in report["append"])
    idem = ", ".join(f"{a['ratio']:.2f}" for a in report["idempotent"])
    ax.set_title(f"StreamClient: ratios {ratios} (target >= {TARGET_APPEND_RATIO});\nidempotent/plain {idem} "
                 f"(target >= {TARGET_IDEMPOTENT_RATIO})", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    return [save_figure(plt, fig, out, "records.png")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3stream bench --kind records", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100, help="records a batch")
    p.add_argument("--seconds", type=float, default=None, help="seconds per measurement (default 0.5; --quick 0.03)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the codec measurements (default 3; --quick 1)")
    p.add_argument("--append-round", type=parse_size, default=None, help="bytes of batches a round of appends "
                   "(default 64M; --quick 16M)")
    p.add_argument("--append-pairs", type=int, default=None, help="counted pairs of append rounds (default 10; "
                   "--quick 1)")
    p.add_argument("--append-warmup", type=int, default=None, help="uncounted pairs first (default: until the "
                   "WAL has gone round once; --quick 1)")
    p.add_argument("--inflight", type=int, default=64, help="appends pending at a time")
    p.add_argument("--stream-tail-limit", type=parse_size, default=None, help="Config.stream_tail_limit of the "
                   "append rounds (default: the engine's, 8 MiB here: each stream's tail is uploaded every 8 MiB, "
                   "within the rounds; 0: no tail uploads within a round)")
    p.add_argument("--workdir", default=None, help="where the WAL, store and metadata go (default: a temporary "
                   "directory)")
    p.add_argument("--out", default=os.path.join("reports", "records-bench"), help="report directory")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    return p


def run(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    seconds = args.seconds or (0.03 if args.quick else 0.5)
    rounds = args.rounds or (1 if args.quick else 3)
    round_bytes = args.append_round or (16 if args.quick else 64) * MiB
    pairs = args.append_pairs or (1 if args.quick else 10)
    warmup = args.append_warmup if args.append_warmup is not None else (1 if args.quick else None)
    codecs = [_ours("native", native_records), _ours("reference", records_reference)]
    kafka, kafka_note = _kafka_python()
    if kafka is not None:
        codecs.append(kafka)
    _progress(f"codecs: {', '.join(c.name for c in codecs)}; {rounds} round(s) of {seconds:g} s per measurement")
    cases = bench_codecs(codecs, args.records, seconds, rounds)
    _progress(f"append_records against append: {pairs} pair(s) of rounds of {fmt_size(round_bytes)}")
    append, idempotent = bench_append(args.records, round_bytes, pairs, args.inflight, args.workdir, warmup,
                                      args.stream_tail_limit)
    for rows, target in ((append, TARGET_APPEND_RATIO), (idempotent, TARGET_IDEMPOTENT_RATIO)):
        for a in rows:
            a["target_ratio"] = target
            a["met"] = a["ratio"] >= target
    report = dict(kind="records", records=args.records, seconds=seconds, rounds=rounds,
                  implementations=[c.name for c in codecs], kafka_python=kafka_note, cases=cases, append=append,
                  idempotent=idempotent,
                  targets=dict(append_records_over_append=TARGET_APPEND_RATIO,
                               idempotent_over_plain=TARGET_IDEMPOTENT_RATIO),
                  met=all(a["met"] for a in append + idempotent))
    return publish(report, args.out, plot, format_report)


if __name__ == "__main__":
    run()
