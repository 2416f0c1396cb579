"""s3stream: append-only streams on object storage behind a write-ahead log.

The stream engine (StreamClient, Stream, RecordBatch, Config, errors) builds on the `wal`
package; until it lands, the WAL is the usable part (`import wal`).
"""
__all__: list[str] = []
