"""A PostgreSQL outage seen through a PostgresMetadataStore: the server is stopped as by a crash
(pg_ctl stop -m immediate) for a few seconds and started again. Meanwhile every call fails with
MetadataBusyError naming the database (its password hidden); once the server accepts connections
again, calls through the same store succeed within a bounded time (the pool reconnects every
RECONNECT_DELAY_S, not after psycopg_pool's 1, 2, 4, 8 ... s)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from s3stream import MetadataBusyError
from testservers import postgres as pgserver

OUTAGE_S = 3.0
#: Generous: the pool retries every ~0.25 s; the figure measured is printed.
RECOVERY_BOUND_S = 3.0


@pytest.fixture
def own_server():
    """A PostgreSQL server of this test's own, since the test stops it (never the session's).
    Missing binaries skip the test, except in CI ($CI set), where they fail it."""
    try:
        with pgserver.throwaway_postgres() as server:
            yield server
    except pgserver.MissingBinaries as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and PostgreSQL cannot run here: {e}")
        pytest.skip(str(e))


def _first_connect_after(url: str, started: threading.Event) -> list[float]:
    """Poll `url` with fresh connections every 10 ms from when `started` is set; the monotonic
    time of the first that succeeds (appended to the returned list, by a daemon thread)."""
    import psycopg
    ready: list[float] = []

    def poll() -> None:
        started.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(url, connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                ready.append(time.monotonic())
                return
            except psycopg.Error:
                time.sleep(0.01)

    threading.Thread(target=poll, daemon=True).start()
    return ready


@pytest.mark.slow
def test_outage_errors_name_the_database_and_calls_succeed_soon_after_it(own_server):
    from s3stream.metadata import PostgresMetadataStore
    # A password in the URL (the throwaway server trusts every local user): messages must hide it.
    url = own_server.create_database("outage").replace("postgres@", "postgres:hunter2@")
    # `quick` gives up on a connection after 1 s, so its calls fail during the outage; `patient`
    # waits the default pool_timeout_s (30 s), longer than the outage: its call just completes.
    quick = PostgresMetadataStore(url, pool_max=2, pool_timeout_s=1.0)
    patient = PostgresMetadataStore(url, pool_max=2)
    try:
        quick.put_kv("k", b"before")
        assert patient.get_kv("k") == b"before"

        own_server.stop("immediate")
        down_at = time.monotonic()
        errors: list[tuple[float, str]] = []
        succeeded: dict[str, float] = {}

        def call_until_it_succeeds(name: str, store: PostgresMetadataStore) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                began = time.monotonic()
                try:
                    assert store.get_kv("k") == b"before"
                except MetadataBusyError as e:
                    errors.append((time.monotonic() - began, f"{name}: {e}"))
                    continue
                succeeded[name] = time.monotonic()
                return

        threads = [threading.Thread(target=call_until_it_succeeds, args=(name, store), daemon=True)
                   for name, store in (("quick", quick), ("patient", patient))]
        for thread in threads:
            thread.start()
        time.sleep(OUTAGE_S)
        starting = threading.Event()
        ready = _first_connect_after(url, starting)
        starting.set()
        own_server.start()
        for thread in threads:
            thread.join(60)
        assert ready and set(succeeded) == {"quick", "patient"}, (ready, succeeded, errors[-3:])

        recovery = {name: at - ready[0] for name, at in succeeded.items()}
        print(f"\nserver down {ready[0] - down_at:.2f} s; first successful call after it accepted "
              f"connections again: quick {recovery['quick']:.3f} s, patient {recovery['patient']:.3f} s; "
              f"{len(errors)} MetadataBusyErrors meanwhile, the longest call {max(d for d, _ in errors):.2f} s")
        assert max(recovery.values()) < RECOVERY_BOUND_S, recovery

        # The quick store failed several times, each call after about its pool_timeout_s; every
        # message names the database, without the password.
        assert len(errors) >= 2, errors
        assert max(duration for duration, _ in errors) < 1.0 + 2.0
        for _, message in errors:
            assert quick.display_url in message and "hunter2" not in message, message
        assert "postgres:***@" in quick.display_url

        # And the stores work as before.
        quick.put_kv("k", b"after")
        assert patient.get_kv("k") == b"after"
    finally:
        quick.close()
        patient.close()
