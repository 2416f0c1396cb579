"""A Spark standalone cluster on this machine's loopback, for a run or a test.

`standalone_cluster` starts a master and N workers with the pyspark package's own
`bin/spark-class`, each in its own process group with its log in the work directory, waits until
every worker has registered, yields the master URL, and kills the groups (the workers' executors
and their Python workers with them) on the way out. Every process sees this host's file system:
it is a single-host cluster, fit for checking that nodes share nothing but the metadata and the
object store (each in its own executor process, with its own WAL directory), not for measuring
what a cluster of machines would do.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

#: Seconds to wait for the master's web UI and every worker to register.
START_TIMEOUT = 90.0
#: Seconds a process group gets after SIGTERM before SIGKILL.
STOP_GRACE = 10.0


def spark_home() -> str:
    """The pyspark package directory: it carries bin/spark-class and the jars."""
    try:
        import pyspark
    except ImportError as e:
        raise SystemExit("a standalone cluster needs pyspark: pip install pyspark (Java 17 must be installed)") from e
    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


def _master_state(webui_port: int) -> dict | None:
    """The master's JSON status ("status", "workers", ...), or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{webui_port}/json/", timeout=2) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _alive_workers(state: dict) -> int:
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every group, then SIGKILL what is left after the grace period; reap them all."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The group may hold executors and Python workers that outlive its leader: kill it whole.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@contextlib.contextmanager
def standalone_cluster(workers: int, cores_per_worker: int = 1, memory: str = "1g", *,
                       workdir: str, timeout: float = START_TIMEOUT) -> Iterator[str]:
    """Start a master and `workers` workers (each `cores_per_worker` cores and `memory`) on
    127.0.0.1; yield the master URL (spark://127.0.0.1:port) once all workers registered.

    Logs go to `workdir`/master.log and worker-<i>.log, each worker's executors run under
    `workdir`/worker-<i>. Executors use this interpreter (PYSPARK_PYTHON). Raises RuntimeError,
    with the logs' tails, if the cluster is not up within `timeout` seconds or a process exits."""
    if workers < 1 or cores_per_worker < 1:
        raise ValueError(f"need at least one worker with one core, got {workers} x {cores_per_worker}")
    home = spark_home()
    spark_class = os.path.join(home, "bin", "spark-class")
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    # No REST submission server: it listens on a fixed port (6066) that two clusters would share.
    master_opts = f"{os.environ.get('SPARK_MASTER_OPTS', '')} -Dspark.master.rest.enabled=false".strip()
    env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               SPARK_MASTER_OPTS=master_opts)
    port, webui = free_port(), free_port()
    master_url = f"spark://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    logs: list[str] = []

    def launch(name: str, args: list[str]) -> None:
        log_path = os.path.join(workdir, f"{name}.log")
        with open(log_path, "ab") as log:
            # A process group per daemon: stopping it stops the JVM and everything it started.
            procs.append(subprocess.Popen([spark_class, *args], env=env, cwd=workdir, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log_path)

    def failure(reason: str) -> RuntimeError:
        tails = "\n".join(f"--- {path} (last lines)\n{_tail(path)}" for path in logs)
        return RuntimeError(f"the standalone cluster did not start: {reason}\n{tails}")

    def wait_until(ready, what: str, deadline: float) -> None:
        while True:
            dead = [(path, p.returncode) for path, p in zip(logs, procs) if p.poll() is not None]
            if dead:
                raise failure(", ".join(f"{os.path.basename(path)} process exited with {rc}" for path, rc in dead))
            state = _master_state(webui)
            if state is not None and ready(state):
                return
            if time.monotonic() > deadline:
                raise failure(f"{what} after {timeout:g} s (master {master_url}, status "
                              f"{None if state is None else state.get('status')}, "
                              f"{0 if state is None else _alive_workers(state)} of {workers} workers alive)")
            time.sleep(0.2)

    try:
        deadline = time.monotonic() + timeout
        launch("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                          "--webui-port", str(webui)])
        # Workers started before the master listens retry only after ~10 s: start them once it is up.
        wait_until(lambda state: state.get("status") == "ALIVE", "the master is not up", deadline)
        for i in range(workers):
            worker_dir = os.path.join(workdir, f"worker-{i}")
            os.makedirs(worker_dir, exist_ok=True)
            launch(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", master_url, "--host", "127.0.0.1",
                                   "--cores", str(cores_per_worker), "--memory", memory, "--work-dir", worker_dir,
                                   "--webui-port", str(free_port())])
        wait_until(lambda state: _alive_workers(state) >= workers, "not every worker registered", deadline)
        yield master_url
    finally:
        _stop(procs[::-1])            # workers (and their executors) first, then the master
