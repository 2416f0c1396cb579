"""Background reorganisation of objects: StreamSetObject compaction, StreamObject merges,
retention cleanup, object lifecycle. Builds on the s3stream engine (s3stream never imports it).

    runner = compaction.attach(client, compaction.CompactionConfig())   # background thread
    ...
    runner.stop(); client.close()

or, without a client: `Compactor(store, metadata, node_id, node_epoch, config).run_once()`.
Design and invariants: docs/compaction.md.
"""
from .compactor import CompactionResult, Compactor
from .config import CompactionConfig
from .limits import CompactionStopped
from .metrics import object_stats
from .runner import CompactionRunner, attach

__all__ = ["CompactionConfig", "CompactionResult", "CompactionRunner", "CompactionStopped",
           "Compactor", "attach", "object_stats"]
