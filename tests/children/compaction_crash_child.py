"""Child of the compaction crash test: one SSO compaction round of node 1, then the lifecycle.

Usage: compaction_crash_child.py TMPDIR
With S3STREAM_COMPACTION_HOOK=after_put|after_commit the compactor prints "compaction-hook POINT"
to stderr at that point and sleeps there until the test SIGKILLs it. Prints "done" otherwise.
"""
import sys
from pathlib import Path

from compaction import Compactor
from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import SqliteMetadataStore
from s3stream.objectstore import LocalObjectStore

from test_compaction import compaction_config


def main() -> None:
    tmp = Path(sys.argv[1])
    meta = SqliteMetadataStore(str(tmp / "meta.db"))
    store = LocalObjectStore(str(tmp / "objects"))
    node = meta.get_node(1)
    Compactor(store, meta, 1, node.node_epoch, compaction_config()).compact_stream_sets()
    ObjectReclaimer(store, meta, destroy_delay=0).run_once()   # "delete" the replaced inputs
    print("done", flush=True)


if __name__ == "__main__":
    main()
