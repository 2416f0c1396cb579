"""The randomized cluster fault campaign (issue 32): per seed, a cluster of node processes under a
seeded random fault schedule (a fault every 2-5 s, at most two at once: pauses, kill -9 and
restart, PostgreSQL outages, S3 stalls, migrations, a lost host), then a read-back of every
committed record checked against every acknowledgment. Writes a JSON report and a PNG timeline
per seed and a summary JSON; exits 1 if any seed missed a target.

    python3 tests/kits/cluster_campaign.py --backend pg-s3 --seeds 1,2,3 --seconds 90 --out reports/cluster-campaign/
    python3 tests/kits/cluster_campaign.py --backend sqlite-local --replay 2 --out reports/cluster-campaign/

`--replay SEED` reruns one seed's schedule (with the seconds and sizes of its saved report, if
there is one in --out) and writes `<backend>-seed<N>-replay.json`. See docs/fault-campaign.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_harness as H   # noqa: E402 - tests are not a package: siblings by module name


def campaign_config(nodes: int = 3, partitions: int = 6, rate: float = 100.0, **overrides) -> H.RunConfig:
    """The campaign's cluster: heartbeat every 0.2 s, failed over after 1.5 s of silence."""
    return H.RunConfig(nodes=nodes, partitions=partitions, rate=rate, heartbeat_interval=0.2,
                       heartbeat_timeout=1.5, **overrides)


def run_seed(backend_kind: str, seed: int, seconds: float, config: H.RunConfig, out: Path | None,
             stem: str | None = None, progress: bool = True, keep: bool = False,
             kinds: tuple[str, ...] | None = None, schedule: list[H.PlannedFault] | None = None) -> dict:
    """One seed: start, run the seed's schedule (or `schedule`) for `seconds`, finish, check;
    the report is written to `out` (if given) as `stem`.json/.png, with the node processes' logs
    copied next to it."""
    stem = stem or f"{backend_kind}-seed{seed}"
    workdir = Path(tempfile.mkdtemp(prefix=f"s3stream-campaign-{stem}-"))
    bar = None
    try:
        backend = H.make_backend(backend_kind, workdir)
        if schedule is None:
            schedule = H.plan_schedule(seed, seconds, kinds or backend.faults, config)
        with H.ClusterRun(workdir, backend, config, own_backend=True, seed=seed) as run:
            if progress:
                from tqdm import tqdm
                bar = tqdm(total=round(seconds), desc=f"{stem}", unit="s", leave=True, mininterval=1.0)
            run.start()

            def tick(elapsed: float) -> None:
                if bar is not None and int(elapsed) > bar.n:
                    active = sum(1 for f in run.timeline.faults if f.end_ns is None)
                    bar.set_postfix_str(f"acks {len(run.tail.acks)}, faults {len(run.timeline.faults)} "
                                        f"({active} active)", refresh=False)
                    bar.update(int(elapsed) - bar.n)

            run.run_schedule(schedule, seconds, progress=tick)
            if bar is not None:
                bar.set_postfix_str("settling, closing, reading back")
            result = run.finish()
        result["schedule"] = [asdict(f) for f in schedule]
        result["seconds"] = seconds
        if out is not None:
            H.write_report(result, out, stem)
            logs = out / f"{stem}-logs"
            shutil.rmtree(logs, ignore_errors=True)
            if (workdir / "logs").exists():
                shutil.copytree(workdir / "logs", logs)
        return result
    finally:
        if bar is not None:
            bar.close()
        if keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def summary_line(stem: str, result: dict) -> str:
    c = result["counts"]
    missed = [k for k, ok in result["targets"].items() if not ok]
    return (f"{stem}: acked {c['acknowledged']}, lost {c['lost']}, overwritten {c['overwritten']}, duplicated "
            f"{c['duplicated']}, acked twice {c['acked_twice']}, given up {c['given_up']}, false failovers "
            f"{c['false_failovers']} of {c['failovers']} (forced by migrations {c['forced_failovers']}), partitions stuck on a failed-over node "
            f"{c['stuck_after_failover']}, longest gap outside faults "
            f"{c['longest_gap_outside_faults']:.1f} s, all nodes live {result['settle'].get('all_live')}: "
            + ("every target met" if not missed else f"MISSED {', '.join(missed)}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("pg-s3", "sqlite-local"), default="sqlite-local")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    ap.add_argument("--seconds", type=float, default=90.0, help="faults are injected for this long per seed")
    ap.add_argument("--out", type=Path, default=Path("reports/cluster-campaign"))
    ap.add_argument("--replay", type=int, default=None, metavar="SEED", help="rerun one seed's schedule")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--rate", type=float, default=100.0, help="appends per second per partition")
    ap.add_argument("--kinds", default=None, help=f"comma-separated subset of {','.join(H.FAULT_KINDS)}")
    ap.add_argument("--keep", action="store_true", help="keep each seed's working directory (WALs, objects)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=str(args.out / f"{args.backend}-campaign.log"), level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    config = campaign_config(args.nodes, args.partitions, args.rate)
    seconds = args.seconds
    runs: list[tuple[int, str, list[H.PlannedFault] | None]] = []
    if args.replay is not None:
        seed, schedule = args.replay, None
        saved = args.out / f"{args.backend}-seed{seed}.json"
        if saved.exists():
            # The saved run's sizes, length and schedule, exactly.
            old = json.loads(saved.read_text())
            seconds = old.get("seconds", seconds)
            names = {f.name for f in fields(H.RunConfig)}
            config = H.RunConfig(**{k: v for k, v in old["config"].items() if k in names})
            schedule = [H.PlannedFault(**f) for f in old["schedule"]]
            again = H.plan_schedule(seed, seconds, kinds or H.make_backend_faults(args.backend), config)
            print(f"replaying seed {seed} as saved in {saved}: {seconds:g} s, {len(schedule)} faults; the seed "
                  f"{'regenerates the same schedule' if again == schedule else 'now plans another schedule'}",
                  file=sys.stderr)
        runs.append((seed, f"{args.backend}-seed{seed}-replay", schedule))
    else:
        runs = [(int(s), f"{args.backend}-seed{int(s)}", None) for s in args.seeds.split(",") if s.strip()]
    results = {}
    for seed, stem, schedule in runs:
        t0 = time.monotonic()
        result = run_seed(args.backend, seed, seconds, config, args.out, stem, progress=not args.no_progress,
                          keep=args.keep, kinds=kinds, schedule=schedule)
        result["wall_seconds"] = round(time.monotonic() - t0, 1)
        write_json = args.out / f"{stem}.json"
        write_json.write_text(json.dumps(result, indent=1, default=str))
        results[stem] = result
        print(summary_line(stem, result), flush=True)
    summary = dict(backend=args.backend, seconds=seconds, config=asdict(config),
                   seeds={stem: dict(seed=r["seed"], counts=r["counts"], targets=r["targets"],
                                     faults=len([f for f in r["faults"] if not (f["detail"] or {}).get("skipped")]),
                                     wall_seconds=r["wall_seconds"], report=f"{stem}.json")
                          for stem, r in results.items()},
                   all_targets_met=all(all(r["targets"].values()) for r in results.values()))
    name = f"{args.backend}-summary" + ("-replay" if args.replay is not None else "") + ".json"
    (args.out / name).write_text(json.dumps(summary, indent=1))
    print(f"summary: {args.out / name}")
    return 0 if summary["all_targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
