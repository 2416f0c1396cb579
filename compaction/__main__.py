"""Command line: `python -m compaction stats|run`.

    python -m compaction stats --metadata sqlite:////var/lib/s3stream/meta.db
        objects and bytes by kind, the most SSOs of a node and StreamObjects of a stream, and
        each node's compaction record (its SSOs written by compaction)
    python -m compaction run --node 1 --metadata URL --store URL [--force-split]
        one compaction round of node 1 from this process (at the node's current epoch: if the
        node restarts meanwhile the commit is refused), then the object lifecycle
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import open_metadata
from s3stream.objectstore import open_object_store

from . import CompactionConfig, Compactor, object_stats


def _stats(args) -> dict:
    meta = open_metadata(args.metadata)
    try:
        out = dict(objects=object_stats(meta), nodes={})
        for node in meta.list_nodes():
            raw = meta.get_kv(f"compaction/node/{node.node_id}")
            compacted = json.loads(raw)["ssos"] if raw else {}
            ssos = meta.node_stream_set_objects(node.node_id)
            out["nodes"][str(node.node_id)] = dict(
                epoch=node.node_epoch, stream_set_objects=len(ssos),
                compacted_stream_set_objects=sum(str(o.object_id) in compacted for o in ssos))
        return out
    finally:
        meta.close()


def _run(args) -> dict:
    meta = open_metadata(args.metadata)
    store = open_object_store(args.store)
    try:
        config = CompactionConfig(throttle_bytes_per_s=args.throttle)
        clock = time.time_ns
        if args.force_split:
            clock = lambda: time.time_ns() + int(config.force_split_age * 1e9)  # noqa: E731
        compactor = Compactor(store, meta, args.node, meta.get_node(args.node).node_epoch, config,
                              clock=clock)
        result = compactor.run_once().as_dict()
        result["objects_deleted"] = ObjectReclaimer(store, meta, args.destroy_delay).run_once()
        return result
    finally:
        store.close()
        meta.close()


def _print(data: dict, indent: str = "") -> None:
    for key, value in data.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print(value, indent + "  ")
        else:
            print(f"{indent}{key}: {value:,}" if isinstance(value, int) and not isinstance(value, bool)
                  else f"{indent}{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m compaction", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    stats = sub.add_parser("stats", help="objects by kind and each node's compaction state")
    stats.add_argument("--metadata", required=True, help="metadata URL (sqlite:////path/meta.db)")
    run = sub.add_parser("run", help="one compaction round of a node, then the lifecycle")
    run.add_argument("--node", type=int, required=True)
    run.add_argument("--metadata", required=True)
    run.add_argument("--store", required=True, help="object store URL (file:///dir, s3://bucket/prefix)")
    run.add_argument("--force-split", action="store_true", help="split every SSO into StreamObjects")
    run.add_argument("--throttle", type=int, default=None, help="bytes/s (default: unlimited)")
    run.add_argument("--destroy-delay", type=float, default=60.0,
                     help="seconds replaced objects stay readable before deletion")
    for p in (stats, run):
        p.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    data = _stats(args) if args.command == "stats" else _run(args)
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
    else:
        _print(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
