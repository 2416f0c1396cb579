"""PostgreSQL metadata through PgBouncer in transaction mode (Debian's 1.18), started by the tests
in front of the session's server: psycopg's defaults fail there, `pgbouncer=1` in the metadata
URL works (no server-side prepared statements, no session state, change feeds that poll or LISTEN
on a direct `listen_url`)."""
from __future__ import annotations

import os
import threading
import time
from urllib.parse import quote, urlsplit

import pytest

from s3stream import ConfigError, MetadataBusyError, RecordBatch, StreamClient, StreamFencedError
from testservers import postgres as pgserver
from s3stream.metadata import (CommitRange, CommitRequest, CommitSSO, ChangeFeed, ObjectState, PostgresMetadataStore,
                               open_metadata)
from conftest import small_config

CLIENTS, ROWS = 20, 10


@pytest.fixture(scope="module")
def bouncer(pg_server):
    """PgBouncer in transaction mode with 5 server connections per database, in front of the
    session's server. Without pgbouncer the tests skip, except in CI ($CI set), where they fail."""
    try:
        with pgserver.throwaway_pgbouncer(pg_server.url, pool_mode="transaction", pool_size=5) as running:
            yield running
    except pgserver.MissingBinaries as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and PgBouncer cannot run here: {e}")
        pytest.skip(str(e))


@pytest.fixture
def bounced_url(bouncer, pg_url):
    """The test's fresh database (pg_url) through PgBouncer, without s3stream's parameters."""
    return bouncer.database_url(urlsplit(pg_url).path.lstrip("/"))


def _run_clients(work, clients: int = CLIENTS) -> dict[int, BaseException]:
    """Run work(client) on `clients` threads at once; the error each one stopped on."""
    errors: dict[int, BaseException] = {}
    start = threading.Barrier(clients)

    def run(client: int) -> None:
        start.wait()
        try:
            work(client)
        except Exception as e:  # collected and checked by the caller
            errors[client] = e

    threads = [threading.Thread(target=run, args=(client,)) for client in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


def test_psycopg_defaults_fail_through_pgbouncer_in_transaction_mode(bouncer, bounced_url):
    """The failure the URL parameters exist for, reproduced: each client's 6th INSERT makes
    psycopg prepare it as _pg3_0, on whichever of the 5 server sessions PgBouncer lends it; a
    session can hold _pg3_0 once, so at least CLIENTS - 5 clients fail."""
    import psycopg
    with psycopg.connect(bounced_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE rows (client INT, i INT)")

    def insert_rows(client: int) -> None:
        with psycopg.connect(bounced_url, autocommit=True) as conn:    # psycopg's defaults
            for i in range(ROWS):
                conn.execute("INSERT INTO rows VALUES (%s, %s)", (client, i))

    errors = _run_clients(insert_rows)
    with psycopg.connect(bounced_url, autocommit=True) as conn:
        [(rows,)] = conn.execute("SELECT count(*) FROM rows").fetchall()
        conn.execute("DROP TABLE rows")
    kinds = sorted({type(e).__name__ for e in errors.values()})
    print(f"\npsycopg defaults through PgBouncer: {len(errors)} of {CLIENTS} clients failed ({', '.join(kinds)}), "
          f"{rows} of {CLIENTS * ROWS} rows written")
    assert len(errors) >= CLIENTS - bouncer.pool_size and rows < CLIENTS * ROWS
    assert "DuplicatePreparedStatement" in kinds


def test_metadata_contract_basics_through_pgbouncer(bounced_url):
    meta = open_metadata(bounced_url + "?pgbouncer=1")
    other = open_metadata(bounced_url + "?pgbouncer=1")       # a second process's store, say
    try:
        assert isinstance(meta, PostgresMetadataStore) and meta.pgbouncer
        node1, node2 = meta.register_node(1, "/wal/1"), other.register_node(2, "/wal/2")
        assert meta.register_node(1, "/wal/1").node_epoch == node1.node_epoch + 1
        node1 = meta.get_node(1)
        streams = [meta.create_stream(1, node1.node_epoch) for _ in range(8)]   # past psycopg's threshold of 5
        assert len({s.stream_id for s in streams}) == 8
        stream = streams[0]
        for end in range(10, 80, 10):       # one SSO per commit, each continuing the last
            [object_id] = meta.prepare_objects(1, ttl_ns=10**12)
            meta.commit(CommitRequest(1, node1.node_epoch, sso=CommitSSO(
                object_id, 100, [CommitRange(stream.stream_id, 0, end - 10, end)])))
        assert meta.get_stream(stream.stream_id).end_offset == 70
        assert [r.end_offset for r in meta.get_object_refs(stream.stream_id, 0, 70)] == list(range(10, 80, 10))
        assert len(meta.list_objects(state=ObjectState.COMMITTED)) == 7
        closed = meta.close_stream(stream.stream_id, 0, 1)
        reopened = other.open_stream(stream.stream_id, 2, node2.node_epoch)
        assert (closed.state.value, reopened.epoch, reopened.owner_node_id) == ("CLOSED", 1, 2)
        with pytest.raises(StreamFencedError):
            meta.close_stream(stream.stream_id, 0, 1)       # the old epoch is fenced
        # KV compare-and-set, each step run often enough that psycopg would prepare it.
        for i in range(8):
            assert meta.put_kv_if_absent(f"kv/{i}", b"first") == b"first"
            assert other.put_kv_if_absent(f"kv/{i}", b"second") == b"first"
            assert not other.replace_kv(f"kv/{i}", b"stale", b"x")
            assert other.replace_kv(f"kv/{i}", b"first", b"third")
        assert meta.list_kv("kv/") == {f"kv/{i}": b"third" for i in range(8)}
        meta.delete_kv("kv/0")
        assert other.get_kv("kv/0") is None
    finally:
        meta.close()
        other.close()


def test_settings_are_per_transaction_through_pgbouncer(bounced_url, pg_url):
    """lock_timeout_s holds through PgBouncer (SET LOCAL in each transaction), and nothing the
    store sets (lock_timeout, random_page_cost) stays behind in the server sessions other clients of PgBouncer are lent."""
    import psycopg
    meta = open_metadata(bounced_url + "?pgbouncer=1", lock_timeout_s=0.2)
    try:
        meta.put_kv("locked", b"v")
        with psycopg.connect(pg_url) as holder:      # directly, holding the row until rollback
            holder.execute("SELECT 1 FROM kv WHERE key = 'locked' FOR UPDATE")
            started = time.monotonic()
            with pytest.raises(MetadataBusyError, match="lock_timeout_s"):
                meta.replace_kv("locked", b"v", b"w")
            assert time.monotonic() - started < 5
            holder.rollback()
        for i in range(20):
            meta.put_kv(f"k{i}", b"v")
        with psycopg.connect(bounced_url, autocommit=True, prepare_threshold=None) as conn:
            # Each statement may run in any of the 5 server sessions: ask often enough to see them all.
            seen = {(conn.execute("SHOW lock_timeout").fetchone()[0], conn.execute("SHOW random_page_cost").fetchone()[0])
                    for _ in range(50)}
        assert seen == {("0", "4")}, seen
    finally:
        meta.close()


def test_many_clients_through_pgbouncer_write_every_row(bounced_url):
    """CLIENTS stores (one per thread, each with its own connections) write ROWS rows each and
    increment a shared counter by compare-and-set, through 5 server sessions: no error, nothing lost."""
    url = bounced_url + "?pgbouncer=1"
    stores = [open_metadata(url, pool_max=1) for _ in range(CLIENTS)]
    try:
        def write(client: int) -> None:
            meta = stores[client]
            for i in range(ROWS):
                meta.put_kv(f"row/{client:02d}/{i:02d}", b"x" * i)
                while True:                 # compare-and-set: retried when another client won
                    current = meta.get_kv("counter")
                    if meta.replace_kv("counter", current, str(int(current or 0) + 1).encode()):
                        break

        started = time.monotonic()
        errors = _run_clients(write)
        rows = stores[0].list_kv("row/")
        print(f"\n{CLIENTS} stores through PgBouncer: {len(errors)} errors, {len(rows)} of {CLIENTS * ROWS} rows, "
              f"counter {stores[0].get_kv('counter')!r}, {time.monotonic() - started:.2f} s")
        assert errors == {}
        assert len(rows) == CLIENTS * ROWS and rows["row/19/09"] == b"x" * 9
        assert stores[0].get_kv("counter") == str(CLIENTS * ROWS).encode()
    finally:
        for meta in stores:
            meta.close()


def test_stream_client_appends_and_uploads_through_pgbouncer(tmp_path, bounced_url):
    url = bounced_url + "?pgbouncer=1"
    store = f"file://{tmp_path}/objects"
    writer = StreamClient(1, tmp_path / "node1.wal", store, url, small_config())
    try:
        stream = writer.create_stream()
        futures = [stream.append(RecordBatch(bytes([i]) * 1000, 10)) for i in range(200)]
        assert [f.result(30).base_offset for f in futures] == list(range(0, 2000, 10))
        stream.close()              # uploads the tail and commits it through PgBouncer
        stream_id = stream.stream_id
    finally:
        writer.close()
    meta = open_metadata(url)
    try:
        assert meta.get_stream(stream_id).end_offset == 2000
        assert meta.list_objects(state=ObjectState.COMMITTED)
    finally:
        meta.close()
    reader = StreamClient(2, tmp_path / "node2.wal", store, url, small_config())
    try:
        reopened = reader.open_stream(stream_id)
        result = reopened.fetch(990, 1010)
        assert [(b.base_offset, b.payload[:1]) for b in result.batches][:2] == [(990, bytes([99])),
                                                                               (1000, bytes([100]))]
    finally:
        reader.close()


def _agent_sees(feed: ChangeFeed, meta, key: str, poll_interval: float, timeout: float = 10.0) -> float:
    """A node agent's loop: re-read the keys after every wake-up (a push, or its poll interval
    where the feed does not push) until `key` shows up; the seconds that took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if key in meta.list_kv("assignment/"):
            return time.monotonic() - started
        if feed.pushes:
            feed.wait(poll_interval)
        else:
            time.sleep(poll_interval)
    pytest.fail(f"{key} was not seen within {timeout} s")


def test_change_feeds_poll_through_pgbouncer_or_listen_on_listen_url(bounced_url, pg_url):
    writer = open_metadata(bounced_url + "?pgbouncer=1")
    polling = open_metadata(bounced_url + "?pgbouncer=1")
    listening = open_metadata(bounced_url + "?pgbouncer=1&listen_url=" + quote(pg_url, safe=""))
    feeds = []
    try:
        # Through the pooler alone, a LISTEN would hold no session: the feed polls.
        feeds.append(polling.kv_changes(("assignment/",)))
        assert not feeds[-1].pushes
        timer = threading.Timer(0.3, writer.put_kv, ("assignment/a", b"1"))
        timer.start()
        seen_after = _agent_sees(feeds[-1], polling, "assignment/a", poll_interval=0.1)
        timer.join()
        assert seen_after >= 0.2

        # With a direct listen_url the feed LISTENs there; the NOTIFY is sent by a write through
        # PgBouncer, inside its transaction. A write under another prefix does not wake it.
        feeds.append(listening.kv_changes(("assignment/",)))
        feed = feeds[-1]
        assert feed.pushes
        writer.put_kv("other/x", b"1")
        assert not feed.wait(0.5)
        threading.Timer(0.2, writer.put_kv, ("assignment/b", b"1")).start()
        started = time.monotonic()
        assert feed.wait(10)
        woke_after = time.monotonic() - started
        # A long poll interval: only the push makes the agent see the key soon.
        assert _agent_sees(feed, listening, "assignment/b", poll_interval=30) < 10
        print(f"\npolling feed saw the change {seen_after:.2f} s after it started waiting (write at 0.3 s); "
              f"the listen_url feed woke {woke_after:.2f} s after it (write at 0.2 s)")
    finally:
        for feed in feeds:
            feed.close()
        for meta in (writer, polling, listening):
            meta.close()


# ---- URL parameters (no server needed: refused before connecting) ------------------------------

@pytest.mark.parametrize("query, wanted", [
    ("prepare_threshold=sometimes", "prepare_threshold='sometimes'.*must be none"),
    ("prepare_threshold=-1", "prepare_threshold='-1'.*whole number"),
    ("pgbouncer=maybe", "pgbouncer='maybe'.*must be 1 or 0"),
    ("pgbouncer=1&pgbouncer=0", "gives pgbouncer twice"),
    ("listen_url=postgresql%3A%2F%2Fh%2Fdb%3Fnot_a_libpq_parameter%3D1",
     "listen_url of metadata URL .*not a valid PostgreSQL URL"),
    ("not_a_libpq_parameter=1", "not a valid PostgreSQL URL.*not_a_libpq_parameter.*pgbouncer, prepare_threshold, "
                                "listen_url"),
])
def test_bad_url_parameters_are_config_errors(query, wanted):
    port = pgserver.free_port()         # nothing listens there: nothing may get as far as connecting
    with pytest.raises(ConfigError, match=wanted):
        open_metadata(f"postgresql://u:pw@127.0.0.1:{port}/meta?{query}", connect_timeout_s=2)


def test_listen_url_password_is_hidden():
    port = pgserver.free_port()
    listen = quote(f"postgresql://u:listen-secret@127.0.0.1:{port}/meta", safe="")
    with pytest.raises(ConfigError, match="cannot connect") as e:
        open_metadata(f"postgresql://u:main-secret@127.0.0.1:{port}/meta?pgbouncer=1&listen_url={listen}",
                      connect_timeout_s=2)
    message = str(e.value)
    assert "main-secret" not in message and "listen-secret" not in message
    assert "pgbouncer=1" in message and "listen_url=postgresql://u:***@" in message


def test_prepare_threshold_on_a_direct_connection(pg_url):
    """Any threshold works directly: none, 0 (prepare everything at once), psycopg's default."""
    for query in ("?prepare_threshold=none", "?prepare_threshold=0", ""):
        meta = open_metadata(pg_url + query)
        try:
            for i in range(8):
                meta.put_kv(f"k{i}", query.encode())
            assert meta.list_kv("k") == {f"k{i}": query.encode() for i in range(8)}
            feed = meta.kv_changes(("k",))      # direct: pushed, whatever the threshold
            assert feed.pushes
            feed.close()
        finally:
            meta.close()
