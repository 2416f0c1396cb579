"""What every benchmark and load test shares (benchmarks/'s and spark_bench's): sizes
(`parse_size`, `fmt_size`, from wal.sizes, which the CLI parses with too), latency percentiles,
matplotlib plots, and progress bars.

Progress bars: tqdm bars on stderr, shown only when someone watches.

A bar is shown when the stream it writes to (stderr by default: reports go to stdout, so they
stay clean when redirected) is a terminal, unless the environment variable CI is set or
S3STREAM_PROGRESS=0; S3STREAM_PROGRESS=1 shows it regardless. Without tqdm installed (it comes
with the `bench` and `test` extras) every bar is a silent stand-in and the benchmarks run the same.

Bars must cost nothing inside a timed section: advance them between rounds and phases, or wrap a
long timed phase in `progress_over`, whose ticker thread redraws at most TICKS_PER_SECOND times a
second and does not run at all when the bar is off. Log lines written with `log_line` appear
above any open bar instead of through it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from wal.sizes import GiB, KiB, MiB, fmt_size, parse_size

__all__ = ["ENV", "TICKS_PER_SECOND", "GiB", "KiB", "MiB", "enabled", "fmt_size", "log_line", "parse_size",
           "percentiles", "periodic", "progress", "progress_over", "publish", "pyplot", "save_figure"]

#: "1": show bars even off a terminal or under CI; "0": never show them.
ENV = "S3STREAM_PROGRESS"
#: The most redraws a second of any bar (tqdm's mininterval) and of `progress_over`'s ticker.
TICKS_PER_SECOND = 4


# ---- statistics ---------------------------------------------------------------------------------

def percentiles(samples_ns, ps=(0.5, 0.99, 0.999)) -> dict:
    """Nearest-rank percentiles of nanosecond samples, in ms."""
    data = sorted(samples_ns)
    n = len(data)
    out: dict = {"samples": n}
    if not n:
        out.update({f"p{_pname(p)}_ms": None for p in ps})
        out.update(mean_ms=None, max_ms=None)
        return out
    for p in ps:
        idx = min(n - 1, max(0, math.ceil(p * n) - 1))
        out[f"p{_pname(p)}_ms"] = data[idx] / 1e6
    out["mean_ms"] = sum(data) / n / 1e6
    out["max_ms"] = data[-1] / 1e6
    return out


def _pname(p: float) -> str:
    return {0.5: "50", 0.9: "90", 0.99: "99", 0.999: "999"}.get(p, str(p).replace("0.", ""))


# ---- plots --------------------------------------------------------------------------------------

def pyplot(who: str):
    """matplotlib.pyplot on the Agg backend, or None (with a note) if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{who}: matplotlib is not installed, so no PNG plots (pip install matplotlib); "
              "report.json is written anyway", flush=True)
        return None
    return plt


def publish(report: dict, out: str, plot: Callable[[dict, str], list], format_report: Callable[[dict], str]) -> dict:
    """A benchmark's ending: write `out`/report.json, draw the plots (their paths go into
    report["plots"] and the JSON is written again with them), print the summary; the report."""
    import json
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "report.json")
    for _ in range(2):
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)
        if "plots" in report:
            break
        report["plots"] = plot(report, out)
    print(format_report(report))
    return report


def save_figure(plt, fig, out: str, name: str) -> str:
    """Save `fig` as out/name (PNG) and close it; returns the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- progress -----------------------------------------------------------------------------------

def enabled(file: TextIO | None = None) -> bool:
    """Whether a bar writing to `file` (default stderr) would be shown."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    file = sys.stderr if file is None else file
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):    # no isatty, or a closed stream
        return False


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str | None = None,
             unit: str = "it", file: TextIO | None = None, leave: bool = False, **tqdm_args: Any):
    """A tqdm bar over `iterable` (or advanced by `.update(n)` up to `total`) writing to `file`
    (default stderr), disabled as `enabled` says. Use it as tqdm: iterate it, or
    `with progress(total=n) as bar: ... bar.update()`. Bars are transient (leave=False) unless
    asked: the log lines keep the record, a bar only shows where a run is."""
    file = sys.stderr if file is None else file
    try:
        from tqdm import tqdm
    except ImportError:
        return _SilentBar(iterable, total)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, leave=leave, disable=not enabled(file),
                mininterval=1 / TICKS_PER_SECOND, dynamic_ncols=True, **tqdm_args)


@contextlib.contextmanager
def progress_over(seconds: float, desc: str | None = None, *, file: TextIO | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Iterator[Any]:
    """A bar over `seconds` of wall time while the body runs (a timed phase that must not pay
    for a bar: Spark tasks the driver waits for, a workload of fixed length). A ticker thread
    redraws it at most TICKS_PER_SECOND times a second; when the bar is off, no thread starts.
    The bar stops at its end if the body runs longer; its elapsed time keeps counting."""
    total = max(float(seconds), 1e-3)
    bar = progress(total=total, desc=desc, unit="s", file=file,
                   bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} of " + _clock_text(total))
    if bar.disable:
        with bar:
            yield bar
        return
    start = clock()

    def tick() -> None:
        bar.n = min(total, clock() - start)
        bar.refresh()

    try:
        with periodic(tick, 1 / TICKS_PER_SECOND, "progress-ticker"):
            yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def periodic(fn: Callable[[], None], every: float, name: str) -> Iterator[None]:
    """Call `fn()` every `every` seconds on a daemon thread named `name` while the block runs;
    the thread is stopped and joined when the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            fn()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def log_line(text: str, file: TextIO | None = None) -> None:
    """Write one line to `file` (default stderr) above any open bar instead of through it."""
    file = sys.stderr if file is None else file
    try:
        from tqdm import tqdm
    except ImportError:
        print(text, file=file, flush=True)
        return
    tqdm.write(text, file=file)
    file.flush()


def _clock_text(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes:02d}:{secs:02d}"


class _SilentBar:
    """Stands in for a tqdm bar when tqdm is not installed: iterates, counts, shows nothing."""
    disable = True

    def __init__(self, iterable: Iterable | None, total: float | None) -> None:
        self.iterable, self.total, self.n = iterable, total, 0

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self) -> "_SilentBar":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass
