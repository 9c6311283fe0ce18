"""Test-session environment, set before anything imports vLLM.

vLLM picks its platform at import time: on a host without an NVIDIA GPU the tests run
vLLM's CPU platform with vllm-specx's CPU reference ops.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

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


def _test_directory(nodeid: str) -> str:
    """``tests/mtad/test_x.py::test_y[p]`` -> ``tests/mtad``; a test file directly under
    tests/ is its own group."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope`` (scripts/test.sh runs two workers) a work unit is a whole
    directory under tests/, not a module: a directory's session- and module-scoped fixtures
    (its models, heads and shared engines) are then built once, in one worker, not once per
    worker that happens to get some of its tests.

    Why a scheduler and not ``--dist loadgroup`` with an ``xdist_group`` mark per directory:
    pytest-xdist 3.8 groups by appending ``@group`` to ``item._nodeid``, which pytest 9.2 no
    longer reads (``Node.nodeid`` comes from ``_id``), so loadgroup silently became ``load``
    and every engine fixture of a directory was built in both workers (measured: the
    hetero-vocabulary mtad engine twice, 33 s + 30 s)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DirectoryScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _test_directory(nodeid)

    return DirectoryScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker the slowest directories come first (scripts/test.sh passes
    ``--no-loadscope-reorder``, so the controller hands the directories out in this order)."""
    if not hasattr(config, "workerinput"):
        return
    rank = {name: i for i, name in enumerate(SLOWEST_DIRECTORIES_FIRST)}

    def directory(item: pytest.Item) -> str:
        parts = _test_directory(item.nodeid).split("/")
        return parts[1] if len(parts) == 2 and not parts[1].endswith(".py") else ""

    items.sort(key=lambda item: rank.get(directory(item), len(rank)))  # stable
