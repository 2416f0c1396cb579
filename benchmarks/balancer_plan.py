"""Planner benchmark on a simulated, Zipf-skewed cluster.

    python3 -m benchmarks.balancer_plan [--partitions 10000 --nodes 100 --seed 1]

Partition traffic follows a Zipf law (the k-th busiest partition carries ~ k^-load_exponent),
bytes out is bytes in times a per-partition fan-out in [0.5, 3], and partitions are placed with
Zipf-skewed node weights (the node of rank r gets ~ r^-placement_exponent of them), so a few
nodes start far above the mean. The plan runs to convergence (the action budget defaults to the
partition count) and one JSON line is printed: sizes, plan time, action count and the bytes-in
imbalance (max node bytes in / mean) before and after applying the plan.

With `--live sqlite` or `--live postgres` (issue 53: "s3stream balance plan on a live cluster of
10 nodes x 10,000 partitions"), the same cluster is written to a metadata store as nodes would
leave it (registered nodes with fresh heartbeats, every assignment, each node's load report
naming every partition), and `s3stream balance plan --meta URL --json` runs against it as an
operator would, a process each time (`--runs`): its wall seconds, the moves and the imbalance.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace

from s3stream.balancer.config import MiB, BalancerConfig
from s3stream.balancer.model import ClusterModel, NodeState, PartitionLoad, imbalance
from s3stream.balancer.planner import plan


def simulated_model(partitions: int, nodes: int, seed: int, load_exponent: float = 0.6,
                    placement_exponent: float = 0.5, mean_node_bytes_in: float = 20 * MiB) -> ClusterModel:
    """A cluster of `nodes` healthy nodes and `partitions` partitions with Zipf-skewed traffic and
    placement, deterministic for a seed. Mean node bytes in is `mean_node_bytes_in`."""
    rng = random.Random(seed)
    weights = [(k + 1) ** -load_exponent for k in range(partitions)]
    rng.shuffle(weights)
    scale = mean_node_bytes_in * nodes / sum(weights)
    node_weights = [(r + 1) ** -placement_exponent for r in range(nodes)]
    placement = rng.choices(range(nodes), weights=node_weights, k=partitions)
    model = ClusterModel()
    for node_id in range(nodes):
        model.add_node(NodeState(node_id))
    for i in range(partitions):
        bytes_in = weights[i] * scale
        model.add_partition(PartitionLoad(f"p{i}", placement[i], bytes_in, bytes_in * rng.uniform(0.5, 3.0)))
    return model


def run(partitions: int = 10_000, nodes: int = 100, seed: int = 1, max_actions: int | None = None,
        load_exponent: float = 0.6, placement_exponent: float = 0.5) -> dict:
    """Build, plan, apply; return the report printed by main()."""
    model = simulated_model(partitions, nodes, seed, load_exponent, placement_exponent)
    config = replace(BalancerConfig(), max_actions_per_plan=max_actions or partitions)
    before = imbalance(model)
    started = time.perf_counter()
    actions = plan(model, config=config)
    elapsed = time.perf_counter() - started
    after = model.snapshot()
    for action in actions:
        after.move(action.partition, action.dest)
    return {"partitions": partitions, "nodes": nodes, "seed": seed, "plan_seconds": round(elapsed, 4),
            "actions": len(actions), "imbalance_before": round(before, 4), "imbalance_after": round(imbalance(after), 4),
            "bytes_out_imbalance_after": round(imbalance(after, "bytes_out"), 4)}


def live(kind: str, partitions: int, nodes: int, seed: int, runs: int) -> dict:
    """The simulated cluster in a metadata store of `kind`; `s3stream balance plan` on it."""
    import contextlib
    import subprocess
    import tempfile
    from s3stream.cluster import Cluster
    from s3stream.cluster.loadreport import REPORT_PREFIX
    from s3stream.metadata import open_metadata
    model = simulated_model(partitions, nodes, seed)
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            url = f"sqlite:///{stack.enter_context(tempfile.TemporaryDirectory())}/meta.db"
        else:
            from testservers.postgres import throwaway_postgres
            url = stack.enter_context(throwaway_postgres()).create_database("plan")
        meta = stack.enter_context(contextlib.closing(open_metadata(url)))
        epochs = {n.node_id + 1: meta.register_node(n.node_id + 1, f"wal-{n.node_id + 1}").node_epoch
                  for n in model.nodes()}
        t0 = time.perf_counter()
        Cluster(meta, None).assign_many({p.name: p.node_id + 1 for p in model.partitions()})
        assigned = time.perf_counter() - t0
        loads: dict[int, dict] = {node: {} for node in epochs}
        for p in model.partitions():
            loads[p.node_id + 1][p.name] = {"bytes_in": p.bytes_in_per_s, "bytes_out": p.bytes_out_per_s}
        out = []
        for _ in range(runs):
            for node, epoch in epochs.items():       # live and reporting now, as running nodes would be
                meta.heartbeat(node, epoch)
                meta.put_kv(f"{REPORT_PREFIX}{node}", json.dumps(
                    {"node": node, "at": time.time(), "window_s": 10.0, "partitions": loads[node], "idle": 0,
                     "append_p99_ms": 1.0, "fetch_p99_ms": 1.0}, sort_keys=True).encode())
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "s3stream", "balance", "plan", "--meta", url, "--json"],
                                  capture_output=True, text=True, timeout=600)
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                raise SystemExit(f"balance plan failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            planned = json.loads(done.stdout)
            out.append({"seconds": round(seconds, 3), "actions": len(planned["actions"]),
                        "imbalance_before": round(planned["imbalance_before"], 4),
                        "imbalance_after": round(planned["imbalance_after"], 4)})
    return {"live": kind, "partitions": partitions, "nodes": nodes, "seed": seed,
            "assign_seconds": round(assigned, 3), "runs": out,
            "median_seconds": sorted(r["seconds"] for r in out)[len(out) // 2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-actions", type=int, default=None,
                        help="action budget of the plan (default: the partition count, i.e. plan to convergence)")
    parser.add_argument("--load-exponent", type=float, default=0.6, help="Zipf exponent of partition traffic")
    parser.add_argument("--placement-exponent", type=float, default=0.5, help="Zipf exponent of node placement")
    parser.add_argument("--live", choices=("sqlite", "postgres"), default=None,
                        help="write the cluster to this metadata store and time `s3stream balance plan` on it")
    parser.add_argument("--runs", type=int, default=3, help="with --live: plans run, each a process of its own")
    args = parser.parse_args(argv)
    if args.partitions < 1 or args.nodes < 1:
        parser.error("--partitions and --nodes must be positive")
    if args.live:
        json.dump(live(args.live, args.partitions, args.nodes, args.seed, args.runs), sys.stdout)
        sys.stdout.write("\n")
        return 0
    report = run(args.partitions, args.nodes, args.seed, args.max_actions, args.load_exponent,
                 args.placement_exponent)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
