"""The specx sampler inside vLLM-Ascend's AscendRejectionSampler, on CPU tensors.

It keeps vLLM-Ascend's logits processing (the fake counts calls to its
apply_logits_processors) and its sampling constraints, and its one-hot-q residual is
``p`` without the drafted token, renormalised: the emitted token's distribution is the
target's exactly (the vLLM-Ascend guide's ``max(P - 1, 0)`` would be all zeros)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ascend_configs import SPECX_MTP, make_config

from vllm_specx.methods import METHODS

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vllm_cpu_ops() -> None:
    """vLLM's Sampler (the bonus token) and vLLM's sampling constraints (the fake
    vLLM-Ascend's) call vLLM's _C ops and Triton kernels: on this CPU host the specx
    reference ops and vLLM's CPU kernel overrides, as in the CPU engine."""
    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    if not register_cpu_reference_ops_if_needed():
        pytest.skip("vllm-specx CPU reference ops not active on this host")
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # vLLM's expand kernel, on CPU


@pytest.fixture
def sampler(ascend, monkeypatch, vllm_cpu_ops):
    monkeypatch.setitem(METHODS, "specx_mtp",
                        dataclasses.replace(METHODS["specx_mtp"], available=True))
    runner = ascend["vllm_ascend.worker.model_runner_v1"].NPUModelRunner(
        make_config("mtp", k=1, specx=SPECX_MTP), CPU)
    return runner.rejection_sampler


def _step(batch: int, draft: int, target_row: torch.Tensor, bonus_row: torch.Tensor):
    """One drafted token per request: rows [target, bonus] per request."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    ones = [1] * batch
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.full((batch,), draft, dtype=torch.int32),
        num_draft_tokens=ones,
        cu_num_draft_tokens=torch.arange(1, batch + 1, dtype=torch.int32),
        cu_num_sampled_tokens=torch.arange(2, 2 * batch + 1, 2, dtype=torch.int32),
        target_logits_indices=torch.arange(0, 2 * batch, 2, dtype=torch.int32),
        bonus_logits_indices=torch.arange(1, 2 * batch, 2, dtype=torch.int32),
        logits_indices=torch.arange(2 * batch, dtype=torch.int32),
    )
    logits = torch.stack([target_row, bonus_row] * batch)
    return metadata, logits


def _sampling_metadata(batch: int, greedy: bool):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None if greedy else torch.ones(batch),
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def _row(probs: list[float], vocab: int = 8) -> torch.Tensor:
    row = torch.full((vocab,), -1e9)
    row[: len(probs)] = torch.tensor(probs).log()
    return row


def test_one_hot_residual_keeps_the_target_distribution(sampler) -> None:
    """p = (0.4, 0.6), draft token 0 with one-hot q: the first emitted token must be 0
    with probability exactly 0.4 (a residual that kept token 0 would give 0.64)."""
    torch.manual_seed(0)
    batch = 4000
    metadata, logits = _step(batch, draft=0, target_row=_row([0.4, 0.6]),
                             bonus_row=_row([0.5, 0.5]))
    out = sampler(metadata, None, logits, _sampling_metadata(batch, greedy=False))
    first = out.sampled_token_ids[:, 0]
    assert set(first.tolist()) <= {0, 1}
    share = (first == 0).double().mean().item()
    assert abs(share - 0.4) < 0.04, share  # 5 standard deviations
    # Rejected requests (first token 1) emit nothing more; accepted ones add the bonus.
    assert (out.sampled_token_ids[first == 1, 1] == -1).all()
    assert (out.sampled_token_ids[first == 0, 1] >= 0).all()
    assert sampler.ascend_logits_processor_calls == 1  # vLLM-Ascend's processing ran


def test_greedy_requests_emit_the_target_argmax(sampler) -> None:
    metadata, logits = _step(3, draft=2, target_row=_row([0.1, 0.2, 0.7]),
                             bonus_row=_row([0.6, 0.3, 0.1]))
    out = sampler(metadata, None, logits, _sampling_metadata(3, greedy=True))
    assert out.sampled_token_ids.tolist() == [[2, 0]] * 3
    metadata, logits = _step(2, draft=1, target_row=_row([0.1, 0.2, 0.7]),
                             bonus_row=_row([0.6, 0.3, 0.1]))
    out = sampler(metadata, None, logits, _sampling_metadata(2, greedy=True))
    assert out.sampled_token_ids.tolist() == [[2, -1]] * 2


def test_compressed_logits_from_vllm_ascend_fail_clearly(sampler, ascend) -> None:
    ascend["vllm_ascend.ascend_config"].get_ascend_config().enable_reduce_sample = True
    metadata, logits = _step(2, draft=0, target_row=_row([0.4, 0.6]), bonus_row=_row([1.0]))
    with pytest.raises(RuntimeError, match="enable_reduce_sample"):
        sampler(metadata, None, logits, _sampling_metadata(2, greedy=False))
