"""Moved to s3stream.cluster.consumer (the cluster layer); this alias keeps old imports working.
Nothing in the engine imports it."""
from .cluster.consumer import *  # noqa: F401,F403
from .cluster.consumer import ConsumerGroups, StaleGenerationError  # noqa: F401
