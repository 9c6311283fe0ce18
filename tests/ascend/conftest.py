"""tests/ascend: vllm-specx's hooks into vLLM-Ascend, through fakes of torch_npu and
vllm_ascend (tests/ascend/fakes), as vLLM-Ascend's own unit tests fake torch_npu. No
engine starts here: these tests are cheap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from ascend_fakes import fake_vllm_ascend  # noqa: E402


@pytest.fixture
def ascend(monkeypatch):
    """The fake vLLM-Ascend modules with the specx Ascend patches applied. vLLM's
    pipeline group is not initialised here: the stage check reads the fake runner's
    (the real runner module imports vLLM's get_pp_group, the same group)."""
    from vllm_specx.glue import ascend as specx_ascend

    with fake_vllm_ascend() as modules:
        runner_module = modules["vllm_ascend.worker.model_runner_v1"]
        monkeypatch.setattr(specx_ascend, "is_last_pipeline_stage",
                            lambda: runner_module.get_pp_group().is_last_rank)
        yield modules


@pytest.fixture
def ascend_unpatched():
    with fake_vllm_ascend(apply_patches=False) as modules:
        yield modules
