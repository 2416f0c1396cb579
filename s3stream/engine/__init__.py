"""One node's internals, behind StreamClient (issue 52): where the WAL lives and how it opens
(`walopen`), recovery after a crash (`recovery`) and of another node's WAL (`failover`), the log
cache (`logcache`), when bytes are PUT (`uploadpolicy`) and the uploads themselves (`upload`,
with its pure-Python twin `upload_reference`), the read path (`readpath`), and the object
lifecycle (`lifecycle`). The hot path's native halves are in `_native/`.

Nothing here is public API: `s3stream` (client, stream, reader, config, errors) is. The cluster
layer (`s3stream.cluster`) sits above and imports the engine, never the reverse.
"""
