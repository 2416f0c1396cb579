"""The cluster layer, above the engine: nodes, partitions, leases, failure detection, failover,
migration and load reports (docs/migration.md).

    from s3stream.cluster import Cluster, ClusterConfig, NodeAgent, open_partition, read_partition

    partition = open_partition(client, "orders")       # client: an s3stream.StreamClient
    read_partition(reader, "orders").fetch(0)          # reader: a StreamClient or s3stream.open_reader(...)

This layer wraps the engine: the engine (s3stream.client and below) never imports this package,
and `import s3stream` does not load it.
"""
from .agent import NodeAgent
from .cluster import MIGRATION_SECONDS, BatchMigrationReport, Cluster, MigrationReport
from .config import ClusterConfig
from .detector import FailureDetector
from .partition import (CloseReport, Partition, PartitionMovedError, PartitionReader, PartitionTable, open_partition,
                        open_partitions, partition_on, partition_table, partitions_on, read_partition)

__all__ = ["BatchMigrationReport", "CloseReport", "Cluster", "ClusterConfig", "FailureDetector", "MIGRATION_SECONDS", "MigrationReport",
           "NodeAgent", "Partition", "PartitionMovedError", "PartitionReader", "PartitionTable", "open_partition", "open_partitions",
           "partition_on", "partition_table", "partitions_on", "read_partition"]
