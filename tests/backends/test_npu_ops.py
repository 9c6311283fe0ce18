"""The torch path (cpu and npu backends) stays inside what Ascend runs well.

Every aten op the npu backend's ``verify`` dispatches, on random batches of every
rule with vLLM's float64 uniforms and noise, is recorded with the dtypes it reads
and writes, and checked against an allow-list of ops torch_npu implements natively.
The same recording proves there is no host synchronisation (``.item()`` and
``.tolist()`` dispatch ``aten::_local_scalar_dense``) and no data-dependent shape
(``nonzero``, ``masked_select``), so the path is graph-capturable.

Also: importing any backend module imports neither torch_npu, Triton nor vLLM.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from verify_reference import RULE_VARIANTS, random_batch

# Ops torch_npu implements on the device (no CPU fallback), by aten name.
NPU_SAFE_OPS = {
    # elementwise and comparisons
    "add", "sub", "mul", "reciprocal", "log", "clamp", "where",
    "eq", "ne", "lt", "gt", "ge", "le", "bitwise_and", "bitwise_or", "bitwise_not",
    # creation, casts, views
    "arange", "full", "full_like", "zeros_like", "ones_like", "new_full", "new_zeros",
    "empty", "_to_copy", "view", "unsqueeze", "squeeze", "expand", "slice", "cat", "clone",
    # indexing and reductions
    "gather", "index_select", "argmax", "amax", "amin", "cumsum", "sum",
}  # fmt: skip
FORBIDDEN = {
    "_local_scalar_dense",  # .item() / .tolist(): a host sync
    "nonzero", "masked_select",  # data-dependent shapes
    "sort", "topk", "cumprod", "searchsorted", "scatter", "index", "index_put",
}  # fmt: skip


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = self.ops.setdefault(func.overloadpacket.__name__, set())
        flat = list(args) + list((kwargs or {}).values())
        flat += list(out) if isinstance(out, (tuple, list)) else [out]
        dtypes.update(x.dtype for x in flat if isinstance(x, torch.Tensor))
        return out


@pytest.fixture(scope="module")
def recorded_ops() -> dict[str, set[torch.dtype]]:
    sys.modules.setdefault("torch_npu", None)  # the path must not need it at all
    from vllm_specx.backends import npu

    recorder = _OpRecorder()
    for variant in RULE_VARIANTS:
        for seed in range(5):
            batch = random_batch(700 + seed, variant)
            batch = dataclasses.replace(
                batch,
                uniforms=batch.uniforms.double(),  # what vLLM generates
                exp_noise=batch.exp_noise.double(),
                cu_num_draft_tokens=batch.cu_num_draft_tokens.to(torch.int32),
            )
            with recorder:
                npu.verify(batch)
    if sys.modules.get("torch_npu", 0) is None:
        del sys.modules["torch_npu"]
    return recorder.ops


def test_only_npu_native_ops(recorded_ops) -> None:
    assert "argmax" in recorded_ops and "cumsum" in recorded_ops  # the recorder works
    unexpected = set(recorded_ops) - NPU_SAFE_OPS
    assert not unexpected, f"ops outside the NPU allow-list: {sorted(unexpected)}"
    assert not set(recorded_ops) & FORBIDDEN


def test_no_float64_arithmetic(recorded_ops) -> None:
    """float64 only ever enters a cast to float32 (the uniforms and noise vLLM makes)."""
    users = {op for op, dtypes in recorded_ops.items() if torch.float64 in dtypes}
    assert users == {"_to_copy"}, users


def test_reductions_use_float32_or_produce_indices(recorded_ops) -> None:
    """Position and probability reductions run on float32 (Ascend's ReduceMin/Max and
    ArgMax take float); only cumsum (MTAD) is float32 too."""
    for op in ("amax", "amin", "argmax", "cumsum"):
        assert recorded_ops[op] <= {torch.float32, torch.int64}, (op, recorded_ops[op])
    assert recorded_ops["cumsum"] == {torch.float32}


def test_importing_backends_pulls_in_no_device_runtime() -> None:
    code = (
        "import sys\n"
        "import vllm_specx.backends, vllm_specx.backends.cpu, vllm_specx.backends.npu\n"
        "import vllm_specx.backends.cuda, vllm_specx.algorithms.verify\n"
        "bad = [m for m in ('torch_npu', 'triton', 'vllm') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from vllm_specx.backends import backend_for_device\n"
        "assert all(backend_for_device(d).verify for d in ('cpu', 'npu', 'cuda'))\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
