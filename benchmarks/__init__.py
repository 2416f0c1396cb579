"""The benchmarks that Spark does not drive, in one home beside the library (issue 52): the
library packages (`_native`, `wal`, `s3stream`, `compaction`) hold no benchmark code and import
none. Spark-driven load tests are in `spark_bench/`; pytest-benchmark microbenchmarks in
`tests/bench/`.

Each module runs with `python -m benchmarks.NAME` and, through the `s3stream.benchmarks` entry
points, with `python3 -m s3stream bench --kind KIND`:

- `engine` (kind engine): ingest into 10 and 1,000 streams against the WAL alone, the main
  job's engine figures, reads (`engine_reads`), the hot partition;
- `wal_disk` (wal): the WAL's throughput and latency against the raw disk;
- `wal_objects` (wal-objects): the object WAL against the file WAL, with S3-like PUT latency;
- `metadata`, `lease`, `records`, `reader`, `visibility`, `wake`: one part each;
- `compaction`: compaction against a Zipf workload (`python -m benchmarks.compaction`);
- `balancer_plan`: the balancer's planner on a simulated cluster.

`kit` is what they share with `spark_bench`: sizes, percentiles, plots, progress bars.
"""
