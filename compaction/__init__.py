"""Background reorganisation of objects (stream-set-object compaction, stream-object merge,
retention cleanup, object lifecycle). Builds on the s3stream engine."""
