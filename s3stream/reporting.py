"""What every benchmark report shares: matplotlib when it is installed, and saving a figure."""
from __future__ import annotations

import os


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


def save_figure(plt, fig, out: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
