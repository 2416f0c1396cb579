"""The servers that tests, benchmarks and harnesses start, in one home (issue 52), each with one
starter, all listening on 127.0.0.1 only:

- `testservers.postgres`: PostgreSQL (`PostgresProcess`, `throwaway_postgres`) and PgBouncer
  (`throwaway_pgbouncer`) from the system's binaries, as the `postgres` user when run as root;
- `testservers.moto`: moto's S3 server on a thread (`moto_thread`) or in a process of its own
  that can be frozen (`MotoProcess`);
- `testservers.s3`: SeaweedFS and rclone's S3 servers from the binaries the `test` extra brings.

Not part of the library: nothing in `_native`, `wal`, `s3stream` or `compaction` imports it.
"""
