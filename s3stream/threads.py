"""Thread priorities: each thread of a Linux process has its own nice value, and a thread
inherits the one of the thread that started it.

A node agent's threads run above the process (ClusterConfig.agent_priority), the upload threads
below it (Config.upload_nice). A pool whose threads may be started lazily by such a thread sets
each of its threads back to the process's value (`thread_nice(0)` as its initializer), so that a
priority never spreads to work it was not meant for."""
from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def thread_nice(offset: int) -> bool:
    """Set the calling thread's nice value to the process's (its main thread's) plus `offset`,
    within -20..19. False where it cannot be done: not Linux, or refused (a value below the
    thread's present one needs CAP_SYS_NICE or an RLIMIT_NICE that allows it); the thread then
    keeps its priority."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        wanted = max(-20, min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + offset))
        if os.getpriority(os.PRIO_PROCESS, tid) != wanted:
            os.setpriority(os.PRIO_PROCESS, tid, wanted)
        return True
    except OSError as e:
        log.debug("could not set the nice value of thread %s to the process's %+d: %s",
                  threading.current_thread().name, offset, e)
        return False


def normal_priority() -> None:
    """A pool's initializer: its thread at the process's priority, whoever started it."""
    thread_nice(0)


__all__ = ["normal_priority", "thread_nice"]
