"""The s3stream data source for PySpark (pyspark.sql.datasource, PySpark 4.1+).

Spark registers it by itself (a module named `pyspark_<name>` exposing `DefaultSource`), so once
s3stream is installed these work in any PySpark session::

    spark.read.format("s3stream").option("metadata", META).option("object_store", STORE)
        .option("subscribe", "orders-0,orders-1").load()                    # batch read
    spark.readStream.format("s3stream")...load()                            # micro-batches
    df.write.format("s3stream").option("metadata", META).option("object_store", STORE)
        .option("partition", "out-0").mode("append").save()                 # batch write
    df.writeStream.format("s3stream")...option("checkpointLocation", DIR).start()

The rows have Spark's Kafka source's schema (SCHEMA), with `partition` a partition's name.
Reading: pyspark_s3stream.source; writing: pyspark_s3stream.sink (docs/spark-datasource.md).
"""
from __future__ import annotations

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

__all__ = ["DefaultSource", "SCHEMA", "NAME"]

NAME = "s3stream"
#: As Spark's Kafka source (`topic` and `partition` are one here: a partition's name).
SCHEMA = ("key binary, value binary, partition string, offset long, timestamp timestamp, "
          "timestampType int, headers array<struct<key: string, value: binary>>")


class DefaultSource(DataSource):
    """`format("s3stream")`: reads and writes partitions of an s3stream cluster."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: StructType):
        from .source import batch_reader
        return batch_reader(dict(self.options), schema)

    def streamReader(self, schema: StructType):
        from .source import StreamReader
        return StreamReader(dict(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool):
        from .sink import BatchWriter
        return BatchWriter(dict(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool):
        from .sink import StreamWriter
        return StreamWriter(dict(self.options), schema, overwrite)
