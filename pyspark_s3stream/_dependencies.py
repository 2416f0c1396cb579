"""Imported first by the source and the sink: their dependencies, or an ImportError that says
which interpreter lacks them and what to set.

Spark runs a Python data source in its own Python workers (planning and commits on the
driver's host, reads and writes on the executors), started with PYSPARK_PYTHON, else the
`python3` on PATH, in local mode too. A program run as `/venv/bin/python app.py` without the
venv on PATH (cron, systemd) has workers of another interpreter: Spark finds this package
there when the working directory holds it, and then the first import of a dependency fails,
bare, on every task."""
from __future__ import annotations

import os
import sys

try:
    import pyarrow  # noqa: F401
    import s3stream  # noqa: F401
    from _native import arrowrecords, kafkarecords  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"the s3stream data source cannot import {e.name or e} in Spark's Python worker, which runs "
        f"{sys.executable} (PYSPARK_PYTHON is {os.environ.get('PYSPARK_PYTHON') or 'not set there'}): Spark "
        "starts its Python workers with PYSPARK_PYTHON, else the python3 on PATH. Set PYSPARK_PYTHON to the "
        "interpreter that has s3stream installed (the driver's, e.g. PYSPARK_PYTHON=/venv/bin/python) before the "
        "SparkSession is created, or install s3stream for that interpreter", name=e.name) from e
