"""The specx sampler's own device work on NPU stays inside what torch_npu runs natively.

On Ascend the runner's sampler is the specx sampler subclassed from vLLM-Ascend's
(vllm_specx/glue/ascend.py). What it runs on the device beyond vLLM-Ascend's own code
(logits processors, sampling constraints, the bonus token's sampler) is
``SpecxRejectionSampler._verify``: target argmax and softmax, the one-hot bonus row, the
randomness drawn as vLLM draws it, and the npu backend's ``verify``. Every aten op it
dispatches, for both rules and greedy/sampled batches, is checked against the npu
backend's allow-list (test_npu_ops.py) plus the few ops this plumbing adds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_npu_ops import FORBIDDEN, NPU_SAFE_OPS, _OpRecorder

# Ops the plumbing adds to the backend's list, each native in torch_npu: softmax over
# float32 rows, the RNG draws vLLM-Ascend's own sampler makes the same way (rand/uniform_
# in vLLM's generate_uniform_probs, exponential_ for the noise), eq/arange for the one-hot
# bonus row (no scatter), ones for an all-greedy batch's mask, select/copy/fill for the
# per-request seeded draws.
SAMPLER_EXTRA_OPS = {"_softmax", "rand", "uniform_", "exponential_", "ones", "select",
                     "copy_", "fill_"}


@pytest.fixture(scope="module")
def recorded_sampler_ops() -> dict[str, set[torch.dtype]]:
    from vllm.v1.sample.sampler import Sampler

    from vllm_specx.backends.npu import BACKEND
    from vllm_specx.glue.sampler import SpecxRejectionSampler

    recorder = _OpRecorder()
    generator = torch.Generator().manual_seed(5)
    for method, settings in (("adaptive", {}), ("mtad", {"acceptance_threshold": 0.3})):
        sampler = SpecxRejectionSampler(Sampler(), None, torch.device("cpu"),
                                        {"method": method, **settings}, BACKEND)
        for greedy in (True, False):
            num_draft = [3, 0, 2]
            tokens, vocab, batch = sum(num_draft), 11, len(num_draft)
            metadata = SimpleNamespace(
                num_draft_tokens=num_draft, max_spec_len=3,
                draft_token_ids=torch.randint(0, vocab, (tokens,), dtype=torch.int32),
                cu_num_draft_tokens=torch.tensor(num_draft).cumsum(0).to(torch.int32),
            )
            sampling = SimpleNamespace(
                all_greedy=greedy, temperature=torch.tensor([0.0, 1.0, 0.7]),
                generators={2: generator},
            )
            logits = torch.randn(tokens, vocab)
            bonus = torch.randint(0, vocab, (batch, 1), dtype=torch.int32)
            draft_probs = None if method == "adaptive" else torch.rand(tokens)
            with recorder:
                sampler._verify(metadata, draft_probs, logits, bonus, sampling)
    return recorder.ops


def test_sampler_plumbing_uses_only_npu_native_ops(recorded_sampler_ops) -> None:
    assert "_softmax" in recorded_sampler_ops and "exponential_" in recorded_sampler_ops
    unexpected = set(recorded_sampler_ops) - NPU_SAFE_OPS - SAMPLER_EXTRA_OPS
    assert not unexpected, f"ops outside the NPU allow-list: {sorted(unexpected)}"
    assert not set(recorded_sampler_ops) & FORBIDDEN


def test_float64_only_in_vllms_uniform_draw_and_the_cast(recorded_sampler_ops) -> None:
    """vLLM draws uniforms in float64 (vLLM-Ascend's sampler does the same); they are
    cast to float32 before any arithmetic."""
    users = {op for op, dtypes in recorded_sampler_ops.items() if torch.float64 in dtypes}
    assert users <= {"rand", "slice", "uniform_", "empty", "_to_copy"}, users
