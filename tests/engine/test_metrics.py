"""Prometheus metrics (s3stream.metrics): a fresh registry scraped after real appends, fetches and
uploads through a client on a local store and SQLite, its values checked against what was done
and against the store's own counters."""
from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from s3stream import RecordBatch, StreamClient, metrics
from s3stream.errors import StreamNotFoundError
from s3stream.cluster import Cluster
from s3stream.cluster.cluster import FAILOVER_SECONDS
from s3stream.metadata import MetadataStore, open_metadata
from s3stream.metadata.wrappers import TIMED_OPERATIONS, InstrumentedMetadataStore
from s3stream.objectstore import open_object_store
from s3stream.objectstore.wrappers import InstrumentedObjectStore
from conftest import KiB, small_config


def scrape(registry) -> dict:
    """{(sample name, ((label, value), ...) sorted): value} of one scrape, through the text format."""
    return parse(generate_latest(registry).decode())


def parse(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_url(port: int, timeout: float = 20.0) -> dict:
    """GET /metrics on localhost:`port` (retried while the server starts), parsed as by scrape()."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return parse(response.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def exit_code_after_ctrl_c(proc: subprocess.Popen, timeout: float = 30.0, sig: int = signal.SIGINT) -> int:
    """SIGINT (or `sig`) `proc` and its exit code; past `timeout` it is sent SIGABRT, and the test
    fails with the tracebacks of its threads (PYTHONFAULTHANDLER=1 in its environment prints them)."""
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"no exit {timeout:g} s after Ctrl-C; its threads:\n{err[-20000:]}") from None


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def local(tmp_path):
    return f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"


def test_scrape_after_appends_fetches_and_uploads(tmp_path, local):
    store_url, meta_url = local
    registry = CollectorRegistry()
    own = InstrumentedObjectStore(open_object_store(store_url))
    # 300 KB stay below the split size: nothing goes up before force_upload (no cut).
    client = StreamClient(71, tmp_path / "n1.wal", own, meta_url, small_config(split_size=512 * KiB),
                          metrics=registry)
    try:
        stream = client.create_stream()
        futures = [stream.append(RecordBatch(bytes([i % 256]) * 1000, count=2)) for i in range(300)]
        futures[-1].result()
        before = scrape(registry)
        assert value(before, "s3stream_appends_total", node="71") == 300
        assert value(before, "s3stream_append_bytes_total", node="71") == 300_000
        assert value(before, "s3stream_wal_records_total", node="71") == 300
        used_before = value(before, "s3stream_wal_used_bytes", node="71")
        assert used_before >= 300_000
        assert value(before, "s3stream_upload_blocks_total", node="71") == 0

        hits = value(before, "s3stream_log_cache_hits_total", node="71")
        for _ in range(3):                                   # tail reads: the log cache serves them
            assert stream.fetch(stream.confirm_offset - 2).batches
        after_reads = scrape(registry)
        assert value(after_reads, "s3stream_log_cache_hits_total", node="71") == hits + 3
        assert value(after_reads, "s3stream_fetch_latency_seconds_count", node="71") == 3

        client.force_upload(10)                              # upload and commit what is in the cache
        wait_for(lambda: value(scrape(registry), "s3stream_wal_used_bytes", node="71") < used_before,
                 "the WAL to be trimmed after the commit")
        samples = scrape(registry)
        blocks = value(samples, "s3stream_upload_blocks_total", node="71")
        assert blocks >= 1
        # One metadata commit per uploaded block, and the wrapper saw each one.
        assert value(samples, "s3stream_metadata_latency_seconds_count", node="71", operation="commit") == blocks
        assert value(samples, "s3stream_metadata_latency_seconds_count", node="71",
                     operation="prepare_objects") == blocks
        # The client's PUTs are exactly the ones the caller's own instrumented store counted.
        mine = own.stats()
        assert mine["put"] >= 1
        assert value(samples, "s3stream_object_store_calls_total", node="71", operation="put") == mine["put"]
        assert value(samples, "s3stream_object_store_written_bytes_total", node="71") == mine["bytes_written"]
        assert value(samples, "s3stream_object_store_latency_seconds_count", node="71", operation="put") == mine["put"]
        assert value(samples, "s3stream_upload_bytes_total", node="71") == mine["bytes_written"]
        assert value(samples, "s3stream_object_store_inflight", node="71", operation="put") == 0
        objects = (value(samples, "s3stream_upload_objects_total", node="71", type="stream_set")
                   + value(samples, "s3stream_upload_objects_total", node="71", type="stream"))
        assert objects == mine["put"]
        assert value(samples, "s3stream_upload_queue_blocks", node="71") == 0
    finally:
        client.close()
    assert not any(dict(labels).get("node") == "71" for _, labels in scrape(registry))


def test_instrumented_metadata_store_times_the_whole_contract(local):
    """Every operation of the MetadataStore contract is a method of the wrapper with the
    contract's signature, timed under its name; a call that raises is counted as an error."""
    contract = {name for name, member in vars(MetadataStore).items()
                if callable(member) and not name.startswith("_")} - {"kv_changes", "close"}
    assert set(TIMED_OPERATIONS) == contract
    for operation in TIMED_OPERATIONS:
        assert operation in vars(InstrumentedMetadataStore)
        assert (inspect.signature(getattr(InstrumentedMetadataStore, operation))
                == inspect.signature(getattr(MetadataStore, operation)))
    meta = InstrumentedMetadataStore(open_metadata(local[1]))
    try:
        meta.register_node(1, "/wal")
        stream = meta.create_stream(1, meta.get_node(1).node_epoch)
        assert meta.get_streams([stream.stream_id]) == {stream.stream_id: stream}
        with pytest.raises(StreamNotFoundError):
            meta.get_stream(stream.stream_id + 1)
        assert {op: snap["count"] for op, snap in meta.latencies().items()} == dict(
            create_stream=1, get_node=1, get_stream=1, get_streams=1, register_node=1)
        assert meta.errors() == {"get_stream": 1}
    finally:
        meta.close()


def test_two_clients_on_one_registry_and_unregister(tmp_path, local):
    store_url, meta_url = local
    registry = CollectorRegistry()
    one = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    two = StreamClient(2, tmp_path / "n2.wal", store_url, meta_url, small_config())
    try:
        handle = metrics.instrument(two, registry)
        for client, n in ((one, 5), (two, 7)):
            s = client.create_stream()
            s.append_many([RecordBatch(b"x" * 10)] * n)[-1].result()
        samples = scrape(registry)
        assert value(samples, "s3stream_appends_total", node="1") == 5
        assert value(samples, "s3stream_appends_total", node="2") == 7
        # The second client was built without metrics=: no store wrappers, so no PUT histogram.
        assert ("s3stream_object_store_calls_total", (("node", "2"), ("operation", "put"))) not in samples
        assert ("s3stream_object_store_calls_total", (("node", "1"), ("operation", "put"))) in samples
        with pytest.raises(ValueError, match="node 2"):
            metrics.instrument(two, registry)
        handle.unregister()
        handle.unregister()                                  # idempotent
        samples = scrape(registry)
        assert ("s3stream_appends_total", (("node", "2"),)) not in samples
        assert value(samples, "s3stream_appends_total", node="1") == 5
    finally:
        one.close()
        two.close()
    assert "s3stream_appends_total" not in {name for name, _ in scrape(registry)}


def test_append_latency_samples_each_observed_once(tmp_path, local):
    """Plain Stream.append is sampled natively, one append in 64 over all streams."""
    store_url, meta_url = local
    registry = CollectorRegistry()
    client = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    try:
        streams = [client.create_stream() for _ in range(2)]
        before = client.stats()["append"]["appends"]
        futures = [streams[i % 2].append(RecordBatch(b"y" * 100)) for i in range(640)]
        futures[-1].result()
        first = value(scrape(registry), "s3stream_append_latency_seconds_count", node="1")
        assert first == (before + 640) // 64 - before // 64
        assert value(scrape(registry), "s3stream_append_latency_seconds_count", node="1") == first
        futures = [streams[0].append(RecordBatch(b"y" * 100)) for _ in range(64)]
        futures[-1].result()
        samples = scrape(registry)
        assert value(samples, "s3stream_append_latency_seconds_count", node="1") == first + 1
        assert 0 < value(samples, "s3stream_append_latency_seconds_sum", node="1") < 11 * 20
    finally:
        client.close()


def test_wal_histograms_use_the_latency_buckets(tmp_path, local):
    """The WAL writer's native buckets (walring.pyx WRITE_BOUNDS_NS) are a copy of
    s3stream.latency.LATENCY_BUCKETS: the exported histograms must share one set of bounds."""
    from s3stream.latency import LATENCY_BUCKETS
    store_url, meta_url = local
    client = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config())
    try:
        w = client.stats()["wal"]
        for name in ("write_latency", "fsync_latency"):
            assert w[name]["bounds"] == list(LATENCY_BUCKETS)
            assert len(w[name]["counts"]) == len(LATENCY_BUCKETS) + 1
    finally:
        client.close()


def test_wal_write_latency_counts_every_batch(tmp_path, local):
    store_url, meta_url = local
    registry = CollectorRegistry()
    client = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    try:
        stream = client.create_stream()
        for _ in range(5):
            stream.append_many([RecordBatch(b"z" * 4000)] * 16)[-1].result()
        samples = scrape(registry)
        batches = value(samples, "s3stream_wal_batches_total", node="1")
        syncs = value(samples, "s3stream_wal_syncs_total", node="1")   # one per group of batches
        assert batches >= 5 and 5 <= syncs <= batches
        assert value(samples, "s3stream_wal_write_seconds_count", node="1") == syncs
        assert 0 < value(samples, "s3stream_wal_write_seconds_sum", node="1") < syncs * 30
        assert value(samples, "s3stream_wal_write_seconds_bucket", node="1", le="+Inf") == syncs
        assert value(samples, "s3stream_wal_fsync_seconds_count", node="1") == syncs
        assert 0 < value(samples, "s3stream_wal_fsync_seconds_sum", node="1") < syncs * 30
    finally:
        client.close()


@pytest.mark.slow
def test_failover_duration_is_exported(tmp_path, local):
    from s3stream.metadata import open_metadata
    store_url, meta_url = local
    registry = CollectorRegistry()
    retired = StreamClient(3, tmp_path / "n3.wal", store_url, meta_url, small_config())
    retired.create_stream().append(RecordBatch(b"w" * 100)).result()
    retired.close()
    client = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    store, meta = open_object_store(store_url), open_metadata(meta_url)
    try:
        before = FAILOVER_SECONDS.count
        Cluster(meta, store, engine_config=small_config()).fail_over(3, reassign=False)
        # Process-wide: no node label (the node that ran it is this process, not the one recovered).
        assert value(scrape(registry), "s3stream_failover_seconds_count") == before + 1
    finally:
        client.close()
        store.close()
        meta.close()


def start_balance_run(tmp_path, port: int, ignore_sigint: bool) -> subprocess.Popen:
    """`s3stream balance run --metrics-port port` on a new SQLite database and local store, its
    output piped; `ignore_sigint`: started with SIGINT ignored (a background job of a
    non-interactive shell)."""
    from s3stream.metadata import open_metadata
    open_metadata(f"sqlite:///{tmp_path}/meta.db").close()
    (tmp_path / "objects").mkdir()
    repo = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        [sys.executable, "-m", "s3stream", "balance", "run", "--meta", f"sqlite:///{tmp_path}/meta.db",
         "--store", str(tmp_path / "objects"), "--node-id", "9", "--metrics-port", str(port),
         "--metrics-addr", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
                 PYTHONFAULTHANDLER="1"),
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-ignored-sigint"])
def test_balance_run_serves_metrics_port(tmp_path, stop):
    """`s3stream balance run --metrics-port P` serves /metrics (the process-wide families) until Ctrl-C;
    and until SIGTERM, started with SIGINT ignored (a background job of a non-interactive shell):
    stopped cleanly either way."""
    port = free_port()
    proc = start_balance_run(tmp_path, port, ignore_sigint=stop != "ctrl-c")
    try:
        samples = scrape_url(port)
        assert ("s3stream_migration_seconds_count", ()) in samples
        assert ("s3stream_failover_seconds_count", ()) in samples
        sig = signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM
        assert exit_code_after_ctrl_c(proc, sig=sig) == 0, proc.stderr.read()
        assert f"metrics on http://127.0.0.1:{port}/metrics" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_balance_run_stopped_while_it_starts_exits_cleanly(tmp_path):
    """SIGTERM as soon as `balance run` says where its metrics are, while it still opens its
    stores (a supervisor stopping it right after the start; SIGINT ignored as in a background
    job): exit 0, not click's "Aborted!" and exit 1."""
    proc = start_balance_run(tmp_path, free_port(), ignore_sigint=True)
    try:
        assert proc.stdout.readline().startswith("metrics on http://127.0.0.1:")
        code = exit_code_after_ctrl_c(proc, sig=signal.SIGTERM)
        err = proc.stderr.read()
        assert code == 0, err
        assert "Aborted" not in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_port_taken_is_a_user_error(tmp_path):
    from cli_helpers import fails, run
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fails(run("balance", "run", "--meta", f"sqlite:///{tmp_path}/meta.db", "--store", tmp_path / "objects",
                  "--node-id", 9, "--metrics-port", port, "--metrics-addr", "127.0.0.1"), 1,
              f"cannot serve metrics on 127.0.0.1 port {port}")


@pytest.mark.slow
def test_spark_node_task_serves_metrics_on_its_port(tmp_path):
    """A Spark node task (spark_bench.node.run_node, called here without Spark) with a metrics
    port from --metrics-port serves its node's engine while it runs, and stops serving after."""
    import argparse
    import threading

    from s3stream.cluster import Cluster
    from s3stream.metadata import open_metadata
    from spark_bench.common import assign_metrics_ports, node_spec
    from spark_bench.node import run_node
    store_url, meta_url = f"file://{tmp_path}/objects", f"sqlite:///{tmp_path}/meta.db"
    args = argparse.Namespace(node_dir=None, batch=1024, upload_threshold=1 << 20, wal_capacity=16 << 20, keep=False)
    specs = [node_spec(args, 1, str(tmp_path), store_url, meta_url, ["p0"], 3.0, {})]
    port = free_port()
    assign_metrics_ports(specs, port)
    assert specs[0]["metrics_port"] == port and specs[0]["metrics_addr"] == "127.0.0.1"   # loopback: a benchmark
    meta = open_metadata(meta_url)
    store = open_object_store(store_url)
    try:
        Cluster(meta, store).assign("p0", 1)
        result = {}
        task = threading.Thread(target=lambda: result.update(run_node(specs[0])))
        task.start()
        deadline = time.monotonic() + 20
        samples = scrape_url(port)
        while samples.get(("s3stream_appends_total", (("node", "1"),)), 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            samples = scrape_url(port)
        assert samples[("s3stream_appends_total", (("node", "1"),))] > 0
        task.join(60)
        assert not result["errors"], result["errors"]
        with pytest.raises(OSError):
            scrape_url(port, timeout=0.5)
    finally:
        meta.close()
        store.close()


def test_compaction_rounds_and_objects(tmp_path, local):
    """With compaction attached: its rounds, bytes and the objects by type, per node."""
    import compaction
    from compaction.config import CompactionConfig
    store_url, meta_url = local
    registry = CollectorRegistry()
    client = StreamClient(1, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    runner = compaction.attach(client, CompactionConfig(sso_interval=0.05, so_interval=0.05), start=False)
    try:
        streams = [client.create_stream() for _ in range(3)]
        for _ in range(3):
            for s in streams:
                s.append(RecordBatch(b"c" * 900)).result(10)
            client.force_upload(10)                           # one more StreamSetObject each time
        samples = scrape(registry)
        assert value(samples, "s3stream_objects", node="1", type="stream_set") >= 3
        assert value(samples, "s3stream_compaction_rounds_total", node="1") == 0
        runner.start()
        wait_for(lambda: runner.compactor.totals.commits >= 1, "a compaction commit")
        runner.stop(10)
        samples = scrape(registry)
        rounds = value(samples, "s3stream_compaction_rounds_total", node="1")
        assert rounds >= 1
        timed = sum(value(samples, "s3stream_compaction_round_seconds_count", node="1", kind=kind)
                    for kind in ("stream_set", "stream_object"))
        assert timed == rounds
        assert value(samples, "s3stream_compaction_written_bytes_total", node="1") > 0
    finally:
        runner.stop(10)
        client.close()


def test_agent_metrics_come_from_the_cluster_layer(tmp_path, local):
    """The cluster layer exports its agents' lease, health and counters through the same scrape."""
    from s3stream.cluster import ClusterConfig, NodeAgent
    from s3stream.metadata import open_metadata
    store_url, meta_url = local
    registry = CollectorRegistry()
    client = StreamClient(72, tmp_path / "n1.wal", store_url, meta_url, small_config(), metrics=registry)
    meta = open_metadata(meta_url)
    agent = NodeAgent(client, Cluster(meta, None, ClusterConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0)))
    try:
        wait_for(lambda: value(scrape(registry), "s3stream_agent_heartbeats_total", node="72") >= 3,
                 "three heartbeats")
        samples = scrape(registry)
        assert value(samples, "s3stream_node_serving", node="72") == 1.0
        assert 0 < value(samples, "s3stream_lease_remaining_seconds", node="72") <= 0.5
        assert value(samples, "s3stream_agent_handed_on_total", node="72") == 0
        for name in ("moves_held", "held_seconds", "appends_held", "append_hold_seconds"):
            assert value(samples, f"s3stream_agent_{name}_total", node="72") == 0
    finally:
        agent.stop()
        client.close()
        meta.close()
