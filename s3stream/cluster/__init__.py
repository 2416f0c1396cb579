"""The cluster layer, above the engine: nodes, partitions, leases, failure detection, failover,
migration, load reports and consumer groups (docs/migration.md).

    from s3stream.cluster import Cluster, ClusterConfig, NodeAgent

The engine (s3stream.client and below) never imports this package; StreamClient's partition
methods reach it through the table s3stream.cluster.partition installs.
"""
from .agent import NodeAgent
from .cluster import MIGRATION_SECONDS, Cluster, MigrationReport
from .config import ClusterConfig
from .detector import FailureDetector
from .partition import CloseReport, Partition, PartitionMovedError, PartitionReader

__all__ = ["CloseReport", "Cluster", "ClusterConfig", "FailureDetector", "MIGRATION_SECONDS", "MigrationReport",
           "NodeAgent", "Partition", "PartitionMovedError", "PartitionReader"]
