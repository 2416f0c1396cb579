"""Builds the Cython core in _native/.

`pip install -e .` cythonizes automatically (Cython is in build-system.requires).
Set S3STREAM_DEBUG_BUILD=1 for a debug build: line tracing (coverage, profilers),
no optimisation, and annotated HTML next to each .pyx.
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("S3STREAM_DEBUG_BUILD") == "1"

# Each module: (name, extra libraries). zlib provides the CRC-32 used by every record and block.
MODULES = [
    ("checksum", ["z"]),
    ("walio", []),
    ("walrecord", ["z"]),
    ("walring", ["z"]),
    ("walscan", ["z"]),
    ("objcodec", ["z"]),
    ("logcache", []),
    ("appendpath", []),
]

directives = {"language_level": 3, "embedsignature": True}
macros = []
cflags = ["-O0", "-g"] if DEBUG else ["-O2"]
cflags += ["-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
if DEBUG:
    directives.update(linetrace=True, binding=True)
    macros.append(("CYTHON_TRACE_NOGIL", "1"))

extensions = [
    Extension(
        f"_native.{name}",
        [f"_native/{name}.pyx"],
        libraries=libs,
        extra_compile_args=cflags,
        define_macros=macros,
    )
    for name, libs in MODULES
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        annotate=DEBUG,
        nthreads=int(os.environ.get("S3STREAM_BUILD_JOBS", "2")),
    )
)
