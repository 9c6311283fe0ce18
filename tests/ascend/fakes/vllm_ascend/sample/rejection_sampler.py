"""Mirror of vllm_ascend/sample/rejection_sampler.py: AscendRejectionSampler's
constructor, hooks and attributes, and apply_sampling_constraints' return shapes.

Left out: its Triton-Ascend kernels (``rejection_sample``, the penalties kernel). Its
``apply_logits_processors`` here runs vLLM's (the real one reimplements it with
Triton-Ascend penalties, same signature and meaning) and counts its calls, so tests can
see that the specx subclass keeps vLLM-Ascend's logits processing.
"""

import torch
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.rejection_sampler import (
    apply_sampling_constraints as vllm_apply_sampling_constraints,
)

from vllm_ascend.ascend_config import get_ascend_config


class AscendRejectionSampler(RejectionSampler):
    def prepare_sampling(self, top_k):
        self.top_k = top_k if top_k is not None else None

    def __init__(self, sampler, spec_config=None, device=None):
        super().__init__(sampler, spec_config, device)
        self.top_k = None
        get_ascend_config()
        self.ascend_logits_processor_calls = 0  # fake-only probe

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        self.ascend_logits_processor_calls += 1
        return super().apply_logits_processors(logits, sampling_metadata, metadata)

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        raise NotImplementedError("fake vllm_ascend: rejection_sample needs Triton-Ascend")


def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata, top_k):
    """(logits, None) for all-greedy batches; (values, global indices) under
    enable_reduce_sample; else the [T, V] logits with temperature/top-k/top-p applied."""
    if sampling_metadata.all_greedy:
        return logits, None
    if get_ascend_config().enable_reduce_sample:
        indices = torch.arange(logits.shape[1]).expand_as(logits)
        return logits, indices
    return vllm_apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)
