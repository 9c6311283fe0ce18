"""Fake vllm_ascend.worker (see tests/ascend/fakes/README.md)."""
