"""Moved to s3stream.cluster.loadreport (the cluster layer); this alias keeps old imports working.
Nothing in the engine imports it."""
from .cluster.loadreport import (  # noqa: F401
    REPORT_PREFIX, SAMPLE_EVERY, SAMPLES_KEPT, LoadReporter, TrafficMeter, read_reports,
)
