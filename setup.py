"""Builds the Cython core in _native/.

`pip install -e .` cythonizes automatically (Cython is in build-system.requires).
Set S3STREAM_DEBUG_BUILD=1 for a debug build: line tracing (coverage, profilers),
no optimisation, and annotated HTML next to each .pyx.
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("S3STREAM_DEBUG_BUILD") == "1"

# The modules of the core; checksum.pyx includes _native/crc32c.h (CRC-32C of records and blocks);
# kafkarecords.pyx is the Kafka record batch codec under s3stream.records; arrowrecords.pyx encodes
# batches from Arrow columns (the Spark sink).
MODULES = ["checksum", "walio", "walrecord", "walring", "walscan", "objcodec", "logcache", "appendpath",
           "kafkarecords", "arrowrecords"]

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
        include_dirs=["_native"],
        extra_compile_args=cflags,
        define_macros=macros,
    )
    for name in MODULES
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        annotate=DEBUG,
        nthreads=int(os.environ.get("S3STREAM_BUILD_JOBS", "2")),
    )
)
