"""Test-session environment, set before anything imports vLLM.

vLLM picks its platform at import time: on a host without an NVIDIA GPU the tests run
vLLM's CPU platform with vllm-specx's CPU reference ops.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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
# On an AMX CPU, keep oneDNN on its row-count-invariant kernels from the first product on,
# as the plugin does in the processes it starts (vllm_specx/cpu_host.py).
if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
    from vllm_specx.cpu_host import cap_onednn_isa_for_exact_rows

    cap_onednn_isa_for_exact_rows()


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch intra-op thread, restoring the count afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Directories whose tests take longest (engines in several processes, the Triton interpreter),
# handed to the xdist workers first so that no long directory starts last and runs alone.
SLOWEST_DIRECTORIES_FIRST = ("load", "v2", "parallel", "glue", "mtad", "mtp", "eagle",
                             "training", "adaptive", "engine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests by their directory under tests/ for pytest-xdist's ``loadgroup``
    (scripts/test.sh runs two workers): a directory's session-scoped fixtures (its models,
    heads and shared engines) are then built once, in one worker, not once per worker. In
    an xdist worker the slowest directories also come first (scripts/test.sh passes
    ``--no-loadscope-reorder`` so the workers take them in this order)."""
    tests_root = Path(__file__).parent

    def directory(item: pytest.Item) -> str:
        try:
            return item.path.relative_to(tests_root).parts[0]
        except ValueError:
            return ""

    for item in items:
        if directory(item):
            item.add_marker(pytest.mark.xdist_group(directory(item)))
    if hasattr(config, "workerinput"):
        rank = {name: i for i, name in enumerate(SLOWEST_DIRECTORIES_FIRST)}
        items.sort(key=lambda item: rank.get(directory(item), len(rank)))  # stable
