"""tests/ mirrors the code (issue 52): a folder of tests per package (wal/, engine/, records/,
metadata/, objectstore/, cluster/, balancer/, mirror/, compaction/, spark/, cli/, benchmarks/),
the kits they share in kits/ (the cluster simulation and fault harness, helpers) and the scripts
they run as processes in children/. Tests are not a package: they import each other, the kits
and conftest by module name, so `add()` puts tests/ and each of those folders on sys.path and
PYTHONPATH; conftest.py calls it first thing."""
from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
KITS = TESTS / "kits"
CHILDREN = TESTS / "children"


def folders() -> list[Path]:
    """tests/ and every folder of it that holds test modules, kits or children."""
    return [TESTS] + sorted(p for p in TESTS.iterdir()
                            if p.is_dir() and p.name not in ("__pycache__", "bench") and any(p.glob("*.py")))


def add() -> None:
    """Put tests/ and its folders on sys.path (once each), and on PYTHONPATH, so that the
    processes tests start (children, nodes, `python -c` snippets) import them alike."""
    for p in reversed(folders()):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    have = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(p) for p in folders() if str(p) not in have] + have)
