"""Mirror of vllm_ascend/sample/sampler.py: AscendSampler is a vLLM Sampler (its NPU
top-k/top-p kernels are left out; vLLM's CPU path samples here)."""

from vllm.v1.sample.sampler import Sampler


class AscendSampler(Sampler):
    pass
