"""Moved to s3stream.cluster.partition (the cluster layer); this alias keeps old imports working.
Nothing in the engine imports it."""
from .cluster.partition import *  # noqa: F401,F403
from .cluster.partition import (  # noqa: F401
    DATA_ROLES, Checkpoint, CloseReport, Partition, PartitionMovedError, PartitionReader, PartitionTable,
)
