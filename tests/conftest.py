"""Test-session environment, set before anything imports vLLM.

vLLM picks its platform at import time: on a host without an NVIDIA GPU the tests run
vLLM's CPU platform with vllm-specx's CPU reference ops.
"""

from __future__ import annotations

import os
import shutil

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# Leave OpenMP threads unpinned: the CPU worker's pinning fights other processes on a
# small shared machine.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Engines default to bfloat16 on CPUs with native bfloat16 (vllm_specx.engine.default_dtype);
# the suite keeps float32, the dtype of the transformers references it compares with.
# tests/engine/test_default_dtype.py runs the default.
os.environ.setdefault("VLLM_SPECX_CPU_DTYPE", "float32")


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch intra-op thread, restoring the count afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
