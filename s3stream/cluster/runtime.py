"""Time, threads and waits of the cluster layer, injected so that a simulation can drive them.

The protocol code (NodeAgent, Cluster) never calls `time` or `threading` for control flow: it
asks its Runtime for the clock, to sleep, for an event, a thread or a worker pool. THREADS is the
real one (CLOCK_MONOTONIC, OS threads); tests/kits/cluster_sim.py runs the same code on a seeded
scheduler where every wait and every metadata call is a point at which the simulation may run
another node, pause or crash this one, or move simulated time on.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol


class Event(Protocol):
    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class Joinable(Protocol):
    def join(self, timeout: float | None = None) -> None: ...


class Executor(Protocol):
    def submit(self, fn: Callable[[], object]) -> object: ...
    def shutdown(self, wait: bool = True) -> None: ...


class Runtime(Protocol):
    def monotonic_ns(self) -> int: ...
    def wall_ns(self) -> int: ...
    def sleep(self, seconds: float) -> None: ...
    def event(self) -> Event: ...
    def spawn(self, name: str, target: Callable[[], None]) -> Joinable: ...
    def executor(self, workers: int, name: str) -> Executor: ...


class ThreadRuntime:
    """The real runtime: CLOCK_MONOTONIC (the clock the native append path checks leases on),
    the wall clock, daemon threads and thread pools."""

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def event(self) -> Event:
        return threading.Event()

    def spawn(self, name: str, target: Callable[[], None]) -> Joinable:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def executor(self, workers: int, name: str) -> Executor:
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)


THREADS = ThreadRuntime()
