"""`s3stream balance plan|record|status|run`: the AutoBalancer's plan on the live cluster or a
recorded state, its lease and last round, and a balancer candidate in the foreground."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any, Callable

import click

import wal
from wal.sizes import parse_size

from ..balancer import (BYTES_IN, BYTES_OUT, NEUTRAL, Action, BalancerConfig, ClusterModel, NodeState, action_to_dict,
                        explain_action, plan)
from ..balancer.model import imbalance
from ..balancer.explain import format_rate
from ..balancer.loop import LAST_ROUND_KEY, LEASE_KEY, Balancer, live_model
from ..cluster import Cluster
from ..config import Config
from ..errors import ConfigError, S3StreamError
from ..cluster.loadreport import read_reports
from ..metadata import MetadataStore
from .common import (META_HELP, as_number, emit_json, iso_time, json_option, meta_option, metrics_option, open_meta,
                     open_store, serve_metrics, store_option, table, until_stopped, user_errors)


class SizeType(click.ParamType):
    """A size or rate in bytes (4096, 512K, 1M, 1.5GiB; binary units, an optional /s), parsed as
    the benchmarks parse sizes."""
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            return parse_size(text[:-2] if text.lower().endswith("/s") else text)
        except argparse.ArgumentTypeError as e:
            self.fail(str(e), param, ctx)


SIZE = SizeType()
_BALANCER_DEFAULTS = BalancerConfig()
#: Balancer options -> the BalancerConfig fields each sets (one value for bytes in and out alike).
BALANCER_FIELDS = {
    "max_actions": ("max_actions_per_plan",),
    "deviation_ratio": ("bytes_in_deviation_ratio", "bytes_out_deviation_ratio"),
    "detect_threshold": ("bytes_in_detect_threshold", "bytes_out_detect_threshold"),
    "partition_cap": ("partition_count_cap",),
    "node_cap": ("bytes_in_cap_per_node", "bytes_out_cap_per_node"),
    "interval": ("loop_interval_s",),
}
RECORD_FIX = "record one with `s3stream balance record --meta URL --out FILE`"


def balancer_options(fn: Callable) -> Callable:
    """--exclude and the thresholds of the plan, shared by `balance plan` and `balance run`."""
    d = _BALANCER_DEFAULTS
    options = [
        click.option("--exclude", "excluded", type=click.IntRange(min=0), multiple=True, metavar="NODE",
                     help="Move no partition onto NODE (repeatable); moves off it are allowed."),
        click.option("--max-actions", type=int, default=None, metavar="N",
                     help=f"Most moves in one plan [default: {d.max_actions_per_plan}]."),
        click.option("--deviation-ratio", type=float, default=None, metavar="R",
                     help=f"A node is balanced while its bytes in and out are within mean * (1 +/- R) "
                          f"[default: {d.bytes_in_deviation_ratio}]."),
        click.option("--detect-threshold", type=SIZE, default=None, metavar="SIZE",
                     help="Bytes/s (e.g. 512K, 1M): while the mean node traffic is below it, nodes below it "
                          "count as balanced [default: 1M]."),
        click.option("--partition-cap", type=int, default=None, metavar="N",
                     help=f"Most partitions one node may hold [default: {d.partition_count_cap}]."),
        click.option("--node-cap", type=SIZE, default=None, metavar="SIZE",
                     help="Most bytes/s in (and out) one node may carry, e.g. 800M [default: 0.8G]."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def balancer_config(**values: Any) -> BalancerConfig:
    """The default BalancerConfig with the options given (not None) applied. A value it refuses
    is a usage error naming the option, with BalancerConfig's reason and suggested value."""
    config = _BALANCER_DEFAULTS
    for name, value in values.items():
        if value is None:
            continue
        try:
            config = dataclasses.replace(config, **{field: value for field in BALANCER_FIELDS[name]})
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint=f"'--{name.replace('_', '-')}'") from None
    return config


def _recording_problem(data: Any) -> str | None:
    """What keeps `data` from being a state written by `balance record`, or None."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def node_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    missing = [k for k in ("now", "assignment", "live", "reports") if k not in data]
    if missing:
        return f"it has no {', '.join(map(repr, missing))} (keys found: {', '.join(sorted(data)) or 'none'})"
    if not number(data["now"]):
        return f"'now' must be unix seconds, got {data['now']!r}"
    assignment = data["assignment"]
    if not isinstance(assignment, dict) or not all(node_id(v) for v in assignment.values()):
        return f"'assignment' must map partition names to node ids, got {assignment!r:.120}"
    if not isinstance(data["live"], list) or not all(node_id(v) for v in data["live"]):
        return f"'live' must be a list of node ids, got {data['live']!r:.120}"
    if not isinstance(data["reports"], list) or not all(isinstance(r, dict) for r in data["reports"]):
        return f"'reports' must be a list of load report objects, got {data['reports']!r:.120}"
    return None


def load_recording(path: str) -> dict:
    """The cluster state that `balance record` wrote to `path`; a one-line error naming the file
    and the fix if it cannot be read or is not that shape."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise click.ClickException(f"metrics file {path!r} does not exist; check the path, or {RECORD_FIX}") from None
    except IsADirectoryError:
        raise click.ClickException(f"metrics file {path!r} is a directory; give the file `balance record` "
                                   "wrote") from None
    except OSError as e:
        raise click.ClickException(f"cannot read metrics file {path!r}: {e.strerror or e}") from None
    except ValueError as e:         # JSONDecodeError, UnicodeDecodeError
        raise click.ClickException(f"metrics file {path!r} is not JSON ({e}); {RECORD_FIX}") from None
    problem = _recording_problem(data)
    if problem is not None:
        raise click.ClickException(f"metrics file {path!r} is not a recorded cluster state: {problem}; {RECORD_FIX}")
    return data


def recorded_model(path: str, config: BalancerConfig, excluded: tuple[int, ...]) -> ClusterModel:
    """The model of a recorded state, as the balancer would have seen it at its 'now'."""
    data = load_recording(path)
    try:
        return ClusterModel.from_reports(data["assignment"], data["reports"], now=data["now"], live=data["live"],
                                         excluded=excluded, config=config)
    except S3StreamError as e:
        raise click.ClickException(f"metrics file {path!r}: {e}; fix that report or {RECORD_FIX}") from None


def node_state(node: NodeState) -> str:
    """'ok', or why the balancer treats the node apart: dead, excluded, slow, no metrics."""
    flags = [name for name, on in (("dead", not node.alive), ("excluded", node.excluded), ("slow", node.slow),
                                   ("no metrics", node.metrics_stale)) if on]
    return ", ".join(flags) or "ok"


def node_rows(model: ClusterModel) -> list[dict]:
    rows = []
    for node in model.nodes():
        load = model.node_load(node.node_id)
        rows.append(dict(node=node.node_id, bytes_in_per_s=load.bytes_in_per_s, bytes_out_per_s=load.bytes_out_per_s,
                         partitions=load.partition_count, state=node_state(node), alive=node.alive, slow=node.slow,
                         excluded=node.excluded, metrics_stale=node.metrics_stale))
    return rows


def plan_report(model: ClusterModel, config: BalancerConfig) -> tuple[dict, list[str]]:
    """What `balance plan` prints: node loads before and after the plan and its actions (JSON),
    and one explaining line per action."""
    actions = plan(model, config=config)
    after = model.snapshot()
    for action in actions:
        after.move(action.partition, action.dest)
        if action.swap is not None:         # a swap also moves its partner back to the source
            after.move(action.swap, action.source)
    report = dict(nodes_before=node_rows(model), nodes_after=node_rows(after),
                  actions=[action_to_dict(a, model) for a in actions],
                  imbalance_before=round(imbalance(model), 4), imbalance_after=round(imbalance(after), 4),
                  mean_bytes_in_per_s=model.mean(BYTES_IN), mean_bytes_out_per_s=model.mean(BYTES_OUT))
    return report, [explain_action(a, model) for a in actions]


def format_nodes(rows: list[dict]) -> str:
    return table(["node", "bytes in", "bytes out", "partitions", "state"],
                 [[r["node"], format_rate(r["bytes_in_per_s"]), format_rate(r["bytes_out_per_s"]), r["partitions"],
                   r["state"]] for r in rows])


def why_nothing(report: dict, config: BalancerConfig) -> list[str]:
    """Hints for an empty plan."""
    rows = report["nodes_before"]
    if not any(r["partitions"] for r in rows):
        return ["no partition is assigned"]
    hints = []
    if not any(r["state"] == "ok" for r in rows):
        hints.append("no node can receive a partition (each is dead, excluded, slow or without a fresh metrics "
                     "report)")
    if (report["mean_bytes_in_per_s"] < config.bytes_in_detect_threshold
            and report["mean_bytes_out_per_s"] < config.bytes_out_detect_threshold):
        hints.append(f"the mean node traffic (in {format_rate(report['mean_bytes_in_per_s'])}, out "
                     f"{format_rate(report['mean_bytes_out_per_s'])}) is below the detect threshold "
                     f"({format_rate(config.bytes_in_detect_threshold)}), so nodes below it count as balanced; "
                     "lower it with --detect-threshold")
    return hints


def format_plan(report: dict, lines_of_actions: list[str], config: BalancerConfig) -> str:
    balanced = sum(r["alive"] and not r["excluded"] and not r["metrics_stale"] for r in report["nodes_before"])
    lines = [f"Nodes before: imbalance {report['imbalance_before']:.2f} (max node bytes in / mean "
             f"{format_rate(report['mean_bytes_in_per_s'])} over {balanced} balanced nodes)",
             format_nodes(report["nodes_before"])]
    if not report["actions"]:
        lines.append("Nothing to move: the goals are met, or no move would improve them.")
        lines += [f"  ({hint})" for hint in why_nothing(report, config)]
        return "\n".join(lines)
    lines += [f"Nodes after the plan: imbalance {report['imbalance_after']:.2f}",
              format_nodes(report["nodes_after"]),
              f"Actions ({len(report['actions'])})"]
    lines += [f"  {line}" for line in lines_of_actions]
    return "\n".join(lines)


def entry_line(entry: dict) -> str:
    """One executed action (an entry of Balancer.history or of the last round) and its outcome."""
    try:
        action = Action(entry["partition"], entry["source"], entry["dest"], scores=entry.get("scores") or {},
                        load_change=entry.get("load_change", 0.0), goal=entry.get("goal", ""),
                        score=entry.get("score", NEUTRAL), swap=entry.get("swap"))
        line = explain_action(action)
    except (KeyError, TypeError, ValueError):
        return json.dumps(entry, default=str)
    outcome = entry.get("outcome")
    if outcome == "moved":
        line += f": moved in {entry.get('seconds', 0.0):.2f} s, {entry.get('tail_bytes', 0):,} tail bytes uploaded"
    elif outcome is not None:
        line += f": {outcome}: {entry.get('error', '')}"
    return line


def _kv_json(meta: MetadataStore, key: str) -> Any:
    """The JSON record at `key`, None if absent; an unreadable record becomes {"unreadable": its bytes}."""
    raw = meta.get_kv(key)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"unreadable": raw.decode("utf-8", "replace")}


def status_report(meta: MetadataStore) -> dict:
    """The balancer lease, each node's latest load report and the last round, from the metadata."""
    now = time.time()
    lease = _kv_json(meta, LEASE_KEY)
    if isinstance(lease, dict) and as_number(lease.get("expires_ns")) is not None:
        lease["expires_in_s"] = round(lease["expires_ns"] / 1e9 - now, 3)
        lease["valid"] = lease["expires_in_s"] > 0
    live = Cluster(meta, store=None).live_nodes()
    reports = {r["node"]: r for r in read_reports(meta) if as_number(r.get("node")) is not None}
    nodes = []
    for node in sorted(set(live) | set(reports)):
        r = reports.get(node, {})
        traffic = [t for t in (r.get("partitions") or {}).values() if isinstance(t, dict)]
        at = as_number(r.get("at"))
        nodes.append(dict(node=node, live=node in live, report_age_s=None if at is None else round(now - at, 3),
                          window_s=r.get("window_s"), partitions=len(traffic) + int(as_number(r.get("idle")) or 0),
                          bytes_in_per_s=sum(as_number(t.get("bytes_in")) or 0.0 for t in traffic),
                          bytes_out_per_s=sum(as_number(t.get("bytes_out")) or 0.0 for t in traffic),
                          append_p99_ms=r.get("append_p99_ms"), fetch_p99_ms=r.get("fetch_p99_ms")))
    return dict(lease=lease, live_nodes=live, nodes=nodes, last_round=_kv_json(meta, LAST_ROUND_KEY))


def format_lease(lease: Any) -> str:
    if lease is None:
        return "Lease: none (no balancer has run on this cluster)"
    if "expires_in_s" not in lease:
        return f"Lease: unreadable record {json.dumps(lease)[:200]}"
    if lease["valid"]:
        return (f"Lease: held by node {lease.get('holder')}, epoch {lease.get('epoch')}, expires in "
                f"{lease['expires_in_s']:.1f} s ({iso_time(lease['expires_ns'])}) unless renewed")
    return (f"Lease: free (last held by node {lease.get('holder')}, epoch {lease.get('epoch')}, "
            f"{'released' if lease['expires_ns'] == 0 else 'expired'} {-lease['expires_in_s']:.1f} s ago): "
            "no balancer leads now")


def format_status(report: dict) -> str:
    def ms(v: Any) -> str:
        return "-" if as_number(v) is None else f"{v:.1f} ms"

    lines = [format_lease(report["lease"]),
             f"Nodes ({len(report['live_nodes'])} live; load reports: "
             f"{sum(n['report_age_s'] is not None for n in report['nodes'])})"]
    lines.append(table(["node", "live", "report age", "bytes in", "bytes out", "partitions", "append p99",
                        "fetch p99"],
                       [[n["node"], "yes" if n["live"] else "no",
                         "none" if n["report_age_s"] is None else f"{n['report_age_s']:.1f} s",
                         format_rate(n["bytes_in_per_s"]), format_rate(n["bytes_out_per_s"]), n["partitions"],
                         ms(n["append_p99_ms"]), ms(n["fetch_p99_ms"])] for n in report["nodes"]]))
    last = report["last_round"]
    if not isinstance(last, dict):
        lines.append("Last round: none recorded")
    elif "unreadable" in last:
        lines.append(f"Last round: unreadable record {last['unreadable'][:200]!r}")
    else:
        actions = last.get("actions") or []
        at = as_number(last.get("at"))
        when = "-" if at is None else iso_time(int(at * 1e9))
        lines.append(f"Last round: leader node {last.get('leader')}, epoch {last.get('epoch')}, at {when}: "
                     f"{len(actions)} actions" + ("" if actions else " (nothing to move)"))
        lines += [f"  {entry_line(e)}" for e in actions if isinstance(e, dict)]
    return "\n".join(lines)


def follow_balancer(balancer: Balancer, running: Callable[[], bool], poll_s: float = 0.1) -> list[dict]:
    """Print each action the balancer executes once its outcome is known, and its lease changes,
    until running() is false (then print what is left). Returns the entries printed."""
    printed: list[dict] = []
    last: dict | None = None
    leading = False
    while True:
        more = running()
        if balancer.is_leader != leading:
            leading = not leading
            click.echo(f"node {balancer.node_id} " + (f"leads the balancer (epoch {balancer.lease.epoch})" if leading
                                                      else "no longer holds the balancer lease"))
        entries = balancer.history.copy()       # one C call: consistent while the loop appends
        start = next((i + 1 for i in range(len(entries) - 1, -1, -1) if entries[i] is last), 0)
        for entry in list(entries)[start:]:
            click.echo(entry_line(entry))
            printed.append(entry)
        if entries:
            last = entries[-1]
        if not more:
            return printed
        time.sleep(poll_s)


def lease_holder_message(meta: MetadataStore, node_id: int) -> str:
    lease = _kv_json(meta, LEASE_KEY) or {}
    expires = as_number(lease.get("expires_ns"))
    left = "" if expires is None else f" for another {max(0.0, expires / 1e9 - time.time()):.1f} s"
    return (f"node {node_id} did not get the balancer lease: node {lease.get('holder')} holds it (epoch "
            f"{lease.get('epoch')}){left} and only the leader plans; stop that balancer or wait for its lease "
            "to expire, then run again")


def run_one_round(balancer: Balancer) -> None:
    """One forced round in a worker thread, its actions printed as they complete."""
    outcome: dict[str, Any] = {}

    def round_() -> None:
        try:
            outcome["done"] = balancer.run_once(force=True)
            outcome["leading"] = balancer.is_leader
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=round_, name=f"balance-once-{balancer.node_id}", daemon=True)
    worker.start()
    try:
        follow_balancer(balancer, worker.is_alive)
    except KeyboardInterrupt:
        click.echo("interrupted: no further move starts (a move under way finishes first)", err=True)
        raise
    finally:
        balancer.stop()         # no move starts after this
        worker.join()
        balancer.lease.release()
    if "error" in outcome:
        raise outcome["error"]
    if not outcome["leading"] and not outcome["done"]:
        raise click.ClickException(lease_holder_message(balancer.cluster.meta, balancer.node_id))
    done = outcome["done"]
    if not done:
        click.echo("Nothing to move: the goals are met, or no move would improve them "
                   "(`s3stream balance plan` says why)")
        return
    failed = [e for e in done if e.get("outcome") != "moved"]
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(done)} actions did not complete (see above); "
                                   "`s3stream streams --meta URL` shows where each partition is open")
    click.echo(f"Round done: {len(done)} actions executed")


@click.group()
def balance() -> None:
    """Plan and run the AutoBalancer: partition moves that even out node traffic.

    `plan` and `status` only read; `record` saves the live state to plan on it offline; `run`
    moves partitions.
    """


@balance.command("plan")
@click.option("--meta", "meta_url", envvar="S3STREAM_META", metavar="URL",
              help=META_HELP + " Not needed with --metrics.")
@click.option("--metrics", "metrics_path", metavar="FILE",
              help="Plan on a state saved by `s3stream balance record` (as of its recording) instead of the "
                   "live cluster.")
@balancer_options
@json_option
@user_errors
def balance_plan(meta_url: str | None, metrics_path: str | None, excluded: tuple[int, ...], as_json: bool,
                 **thresholds: Any) -> None:
    """Print the moves the balancer would make now, without making any.

    The state comes from the metadata (assignments, live nodes, the nodes' load reports; nothing
    is written) or, with --metrics, from a recorded file. Text: each node's bytes in/out per
    second, partition count and state before and after the plan (imbalance: max node bytes in /
    mean over the balanced nodes), then one line per move with the goal that proposed it and
    every goal's score. --json: nodes_before, nodes_after, actions, imbalance_before/after.
    """
    config = balancer_config(**thresholds)
    if metrics_path is not None:
        model = recorded_model(metrics_path, config, excluded)
    elif meta_url is not None:
        with contextlib.closing(open_meta(meta_url)) as meta:
            model = live_model(Cluster(meta, store=None), config, excluded)
    else:
        raise click.UsageError("give --meta URL (plan on the live cluster) or --metrics FILE (plan on a state "
                               "saved by `s3stream balance record`)")
    report, lines = plan_report(model, config)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_plan(report, lines, config))


@balance.command("record")
@meta_option
@click.option("--out", "out_path", required=True, metavar="FILE", type=click.Path(dir_okay=False),
              help="Where to write the state (JSON; replaced if it exists).")
@user_errors
def balance_record(meta_url: str, out_path: str) -> None:
    """Save what the balancer plans from (assignments, live nodes, load reports, the time) to
    FILE, to plan on it later with `s3stream balance plan --metrics FILE`."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        cluster = Cluster(meta, store=None)
        assignment = {name: a["node"] for name, a in sorted(cluster.assignments().items())}
        reports = read_reports(meta)
        live = cluster.live_nodes()
    state = dict(now=time.time(), assignment=assignment, live=live, reports=reports)
    # Written aside and renamed: a failed write never leaves a truncated state behind.
    tmp = f"{out_path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, out_path)
    click.echo(f"Recorded {len(assignment)} partitions, {len(live)} live nodes and {len(reports)} load reports "
               f"to {out_path}; plan on it with `s3stream balance plan --metrics {out_path}`")


@balance.command("status")
@meta_option
@json_option
@user_errors
def balance_status(meta_url: str, as_json: bool) -> None:
    """Print who holds the balancer lease (epoch, expiry), each node's latest load report (age,
    traffic, p99 latencies) and the actions of the last round with their outcomes."""
    with contextlib.closing(open_meta(meta_url)) as meta:
        report = status_report(meta)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_status(report))


@balance.command("run")
@meta_option
@store_option(required=True)
@click.option("--node-id", type=click.IntRange(min=0), required=True, metavar="N",
              help="This candidate's id for the lease (unique among balancer candidates).")
@click.option("--interval", type=float, default=None, metavar="S",
              help=f"Seconds between plans while leading [default: {_BALANCER_DEFAULTS.loop_interval_s:g}].")
@click.option("--once", is_flag=True, help="Take the lease, plan and execute one round now, then stop.")
@balancer_options
@metrics_option
@user_errors
def balance_run(meta_url: str, store_url: str, node_id: int, once: bool, excluded: tuple[int, ...],
                metrics_port: int, metrics_addr: str, **thresholds: Any) -> None:
    """Run a balancer candidate in the foreground until Ctrl-C, printing each move it makes.

    Candidates compete for one lease; the holder plans every --interval seconds from the nodes'
    load reports and migrates partitions (nodes must run NodeAgents). A source that does not let
    go in time is failed over from here, which needs its WAL readable by this process. Ctrl-C
    lets the move under way finish and releases the lease. --once: one forced round, exit 1 if
    another candidate holds the lease or a move fails. --metrics-port: the durations of the
    migrations and failovers this candidate ran (s3stream_migration_seconds, _failover_seconds).
    """
    config = balancer_config(**thresholds)
    with until_stopped("the balancer") as foreground:
        serve_metrics(metrics_port, metrics_addr)
        # A failover opens the source's WAL with the capacity in its header, whatever it is.
        failover_config = Config(wal=wal.WALConfig(capacity=None))
        with contextlib.closing(open_meta(meta_url)) as meta, contextlib.closing(open_store(store_url)) as store:
            balancer = Balancer(Cluster(meta, store, engine_config=failover_config), node_id, config,
                                excluded=excluded)
            foreground.started = True
            if once:
                run_one_round(balancer)
                return
            # Ctrl-C may come at any moment from here on, the start included: its threads are
            # stopped whatever happens (a KeyboardInterrupt past them left the process waiting for
            # them, forever).
            try:
                balancer.start()
                click.echo(f"balancer candidate {node_id} running: plans every {config.loop_interval_s:g} s while "
                           "it holds the lease; Ctrl-C to stop")
                follow_balancer(balancer, lambda: True)
            except KeyboardInterrupt:
                click.echo("stopping (a move under way finishes first)", err=True)
            finally:
                balancer.stop()
            click.echo(f"stopped: {balancer.moves} moves in {balancer.rounds} rounds")
