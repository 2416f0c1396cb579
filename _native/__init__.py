"""Cython core of s3stream: checksums, the WAL record codec, ring writer and recovery scanner.

No Python-level policy lives here; the `wal` and `s3stream` packages wrap these modules.
"""
