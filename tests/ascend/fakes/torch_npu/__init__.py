"""Fake torch_npu (no NPU here): importable, with the attributes vLLM-Ascend's own unit
tests fake (tests/ut/conftest.py there). Nothing in it runs on a device."""

from unittest.mock import MagicMock

npu = MagicMock()
profiler = MagicMock()
npu_top_k_top_p = MagicMock(side_effect=AssertionError("fake torch_npu: no NPU kernels"))
