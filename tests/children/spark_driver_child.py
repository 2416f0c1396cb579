"""A Spark driver of the data source's users' kind (a plain local session, not spark_bench's):
writes rows to a partition and reads them back, and prints one JSON line per step, {"ok": ...}
or {"error": message}. Usage: spark_driver_child.py METADATA_URL STORE_URL PARTITION."""
from __future__ import annotations

import json
import os
import sys

from pyspark.sql import SparkSession


def step(name: str, fn) -> None:
    try:
        print(json.dumps({"step": name, "ok": fn()}), flush=True)
    except Exception as e:  # what a user sees; the parent judges it
        print(json.dumps({"step": name, "error": str(e)}), flush=True)


def main() -> None:
    meta, store, partition = sys.argv[1:4]
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    spark = (SparkSession.builder.master("local[1]").appName("spark_driver_child")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    try:
        opts = {"metadata": meta, "object_store": store}
        df = spark.createDataFrame([("a",), ("b",)], "value string")
        step("write", lambda: df.write.format("s3stream").options(**opts).option("partition", partition)
             .mode("append").save())
        step("read", lambda: sorted(bytes(r.value).decode() for r in spark.read.format("s3stream").options(**opts)
                                    .option("subscribe", partition).load().collect()))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
