"""What keeps compaction polite: a memory meter, a byte-rate token bucket and a pause/stop gate."""
from __future__ import annotations

import threading
import time
from typing import Callable


class CompactionStopped(Exception):
    """The runner was stopped in the middle of a round; what was written stays PREPARED and the
    lifecycle deletes it after its expiry."""


class MemoryMeter:
    """Counts the object bytes compaction holds (raw reads, decoded batches, encoded outputs) and
    remembers the peak, so tests and metrics can check it against the memory budget."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.peak = 0

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class TokenBucket:
    """`rate` bytes per second with bursts up to `burst` bytes. `take(n)` may overdraw: the caller
    then sleeps until the debt is repaid, so one large PUT is allowed but paid for afterwards."""

    def __init__(self, rate: int | None, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._rate = rate
        self._burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()
        self.waited = 0.0

    def take(self, nbytes: int) -> None:
        if self._rate is None:
            return
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            delay = -self._tokens / self._rate
            self.waited += delay
            self._sleep(delay)


class Gate:
    """Pause and stop, checked by the compactor between chunks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._stopped = False

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopped(self) -> bool:
        return self._stopped

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def checkpoint(self) -> None:
        """Wait while paused; raise CompactionStopped once stopped."""
        with self._cond:
            self._cond.wait_for(lambda: not self._paused or self._stopped)
            if self._stopped:
                raise CompactionStopped("compaction was stopped")

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` s, waking early on stop; True if stopped."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped, timeout)
            return self._stopped
