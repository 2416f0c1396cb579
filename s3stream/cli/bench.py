"""`s3stream bench`: run a benchmark registered as an entry point of the group
s3stream.benchmarks. The benchmarks are found, not imported: the Spark load tests live in
spark_bench, a layer above this package."""
from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

import click

from .common import user_errors


#: The entry point group of the benchmarks `bench --kind` runs (pyproject.toml): each is a callable taking
#: the benchmark's argv, where a leading --quick asks for a short smoke run, and returning its report.
BENCH_GROUP = "s3stream.benchmarks"
INSTALL_FIX = 'install s3stream from its source checkout: pip install -e ".[bench]"'


def benchmark_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed benchmarks by name (nothing is imported until one is loaded)."""
    found = importlib.metadata.entry_points(group=BENCH_GROUP)
    return {ep.name: ep for ep in sorted(found, key=lambda ep: ep.name)}


class BenchmarkKind(click.Choice):
    """--kind: one of the benchmarks registered as entry points, looked up when --kind is parsed
    or shown rather than when the CLI is imported."""

    def __init__(self) -> None:
        super().__init__(())

    def _refresh(self) -> None:
        # An assignment, not a property: click's own type of `choices` changed (Sequence in 8.4,
        # tuple in 8.5), and a tuple is both.
        self.choices = tuple(benchmark_entry_points())

    def get_metavar(self, *args: Any, **kwargs: Any) -> str | None:
        self._refresh()
        return super().get_metavar(*args, **kwargs)

    def shell_complete(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().shell_complete(*args, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        self._refresh()
        if not self.choices:
            raise click.ClickException(f"no benchmarks are registered (entry point group {BENCH_GROUP}): "
                                       f"{INSTALL_FIX}")
        return super().convert(value, param, ctx)


def load_benchmark(kind: str) -> Callable[[list[str]], Any]:
    """The callable registered for benchmark `kind`; a one-line error if it cannot be imported."""
    entry_point = benchmark_entry_points()[kind]
    try:
        entry = entry_point.load()
    except (ImportError, AttributeError) as e:
        raise click.ClickException(f"the {kind} benchmark is not available: {entry_point.value} cannot be loaded "
                                   f"({e}); {INSTALL_FIX}") from None
    if not callable(entry):
        raise click.ClickException(f"the {kind} benchmark is not available: {entry_point.value} is not callable; "
                                   f"{INSTALL_FIX}")
    return entry


def run_benchmark(run: Callable[[list[str]], Any], argv: list[str]) -> None:
    """Run an argparse-based benchmark, turning its exits into click's."""
    try:
        result = run(argv)
    except SystemExit as e:
        if e.code in (None, 0):
            return
        if isinstance(e.code, int):
            raise click.exceptions.Exit(e.code) from None
        raise click.ClickException(str(e.code)) from None
    if isinstance(result, int) and not isinstance(result, bool) and result:
        raise click.exceptions.Exit(result)


@click.command(context_settings=dict(ignore_unknown_options=True),
              short_help="Run the engine, WAL or Spark benchmarks.")
@click.option("--kind", type=BenchmarkKind(), default="spark-throughput", show_default=True,
              help="Which benchmark (see above).")
@click.option("--quick", is_flag=True, help="A short smoke run (seconds; the Spark tests: small sizes) instead "
                                            "of the full benchmark.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Report directory (report.json and PNG plots). Default: the benchmark's own, e.g. "
                   "reports/engine-bench.")
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED, metavar="[BENCH OPTIONS]...")
@user_errors
def bench(kind: str, quick: bool, out: str | None, bench_args: tuple[str, ...]) -> None:
    """Run a benchmark on embedded defaults; print its results and write its report.

    The default is the main job: the Spark load test, Spark tasks acting as nodes (each its own
    WAL file) over a local object store and SQLite metadata, for 1, 2 and 4 nodes. The kinds are
    the entry points of the group s3stream.benchmarks; those installed with s3stream:

    \b
    spark-throughput  spark_bench: aggregate and per-node MB/s, latency, scaling (needs pyspark, Java)
    spark-migration   spark_bench: partition migration time under load against a copy baseline
    spark-balance     spark_bench: the balancer on a Zipf-skewed 4-node cluster, and after a
                      hot spot moves: imbalance before/after, seconds to balance, moves, lost
    spark-mirror      spark_bench: mirror 16 partitions under load, a worker SIGKILLed, a consumer failover
    engine            benchmarks.engine: ingest into 10 and 1,000 streams against WAL-only
                      ingest, small records (128 B-64 KiB) and CPU per GiB against the WAL
                      alone, open-loop append latency, object-store requests per GiB,
                      catch-up and tail reads
    wal               benchmarks.wal_disk: WAL throughput and latency against the raw disk limit
    metadata          benchmarks.metadata: metadata operations per second with 10 and
                      100,000 streams (SQLite; PostgreSQL with --start-postgres or --meta URL)
    records           benchmarks.records: Kafka record batches encoded and decoded per
                      second (native, pure Python, kafka-python); append_records against append
    reader            benchmarks.reader: a reader that is not a node against a node,
                      catch-up MB/s; commit-to-tail visibility p50/p99 (SQLite, PostgreSQL)
    visibility        benchmarks.visibility: append to seen by a reader in another process
                      at 10 to 10,000 records/s and the maximum, with the node's PUTs/s
    wake              benchmarks.wake: how late a node's high-priority thread runs when
                      it wakes, under appends and busy cores (a move's tail)
    scale             benchmarks.scale: 100 to 10,000 partitions per node: open, restart,
                      failover, drain, idle CPU and RSS, busy partitions among idle ones
    notify            benchmarks.notify: PostgreSQL LISTEN/NOTIFY fan-out of a failover of
                      10,000 partitions to 9 listening nodes: writer, server and listener CPU

    Other options go to the benchmark itself: `s3stream bench --kind wal --quick --capacity 256M`;
    list them with `s3stream bench --kind wal -- --help`.
    """
    argv = (["--quick"] if quick else []) + (["--out", out] if out else []) + list(bench_args)
    run_benchmark(load_benchmark(kind), argv)
