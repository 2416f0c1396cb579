"""For the Spark tests: an interpreter that is not this one (shared by the test files)."""
from __future__ import annotations

import os
import subprocess
import sys


def interpreter_without_dependencies(where, with_pyarrow: bool = False) -> str:
    """The bin directory of a new venv (at `where`) without packages: its `python3` is another
    interpreter than this one, lacking s3stream's dependencies, as the `python3` a cron job or a
    systemd unit finds first on PATH when it runs /venv/bin/python without the venv activated.
    `with_pyarrow`: but with this interpreter's pyarrow (linked), which PySpark's own workers for
    Python data sources import before any of the source's code runs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    bin_dir = where / "bin"
    if with_pyarrow:
        import pyarrow
        site = subprocess.run([str(bin_dir / "python3"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        os.symlink(os.path.dirname(pyarrow.__file__), os.path.join(site, "pyarrow"))
    lacks = subprocess.run([str(bin_dir / "python3"), "-c", "import tenacity"], capture_output=True)
    assert lacks.returncode != 0, "the venv should not see this interpreter's packages"
    return str(bin_dir)
