"""The testing extension (csrc/testing/): the kernels and hooks only the
tests use, kept out of the library that setup.py builds. :func:`load`
builds it with the library's compile flags (setup.py's) into
build/testing/, the first time and again after a source changed, and
imports it; every process that calls it (the test session, rank processes,
scripts/sanitize_ops.py) gets the same build. It needs a GPU build of the
library: the tests take it through the ``testing_extension`` fixture
(tests/conftest.py), which skips where there is none or no GPU."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["csrc/testing/module.cpp", "csrc/testing/testing.cu", "csrc/gpu/runtime.cpp"]
BUILD_DIR = ROOT / "build" / "testing"


@functools.cache
def load():
    """The extension's module, built first where build/testing/ lacks it or a source changed."""
    from torch.utils.cpp_extension import load as build_and_load

    if torch.version.hip:
        os.environ.setdefault("PYTORCH_ROCM_ARCH", "gfx1201")
        gpu_flags = ["-O3"]
    else:
        gpu_flags = ["-O3", "-lineinfo"]  # no fast-math, as the library's kernels
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    return build_and_load("rdna4_comm_testing", [str(ROOT / s) for s in SOURCES], build_directory=str(BUILD_DIR),
                          extra_cflags=["-O3"], extra_cuda_cflags=gpu_flags)
