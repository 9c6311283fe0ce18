"""The specx sampler emits vLLM's greedy tokens even where float32 probabilities tie.

vLLM's rejection sampler takes a greedy request's token as the argmax of the processed
target logits. Two logits one float32 ulp apart (7.5e-9 at 0.1) have the same softmax
probability, so an argmax of the probabilities picks the lower index where vLLM picks
the higher one, and greedy decoding with a specx method would differ from greedy
decoding without speculation. Both samplers run here on the same step, with vLLM's own
``Sampler`` for the bonus token and vLLM's real ``RejectionSampler`` (its CPU kernels
are the specx reference ops, as in the CPU engine).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def vllm_cpu_kernels() -> None:
    """vLLM's rejection kernels on this CPU host (as each CPU worker sets them up)."""
    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    if not register_cpu_reference_ops_if_needed():
        pytest.skip("vllm-specx CPU reference ops not active on this host")
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def _near_tie_row(vocab: int, low_index: int, high_index: int) -> torch.Tensor:
    row = torch.full((vocab,), -3.0)
    low = torch.tensor(0.1, dtype=torch.float32)
    row[low_index] = low
    row[high_index] = torch.nextafter(low, torch.tensor(1.0))
    return row


def _step(drafts: list[list[int]], rows: list[torch.Tensor]):
    """SpecDecodeMetadata and logits for one step: per request its target rows, then
    its bonus row, in vLLM's flattened layout."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    target_idx: list[int] = []
    bonus_idx: list[int] = []
    flat: list[int] = []
    cursor = 0
    for ids in drafts:
        for _ in ids:
            target_idx.append(cursor)
            cursor += 1
        bonus_idx.append(cursor)
        cursor += 1
        flat += ids
    logits = torch.stack(rows)
    num = [len(d) for d in drafts]
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32),
        num_draft_tokens=num,
        cu_num_draft_tokens=torch.tensor(num).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=(torch.tensor(num) + 1).cumsum(0).to(torch.int32),
        target_logits_indices=torch.tensor(target_idx, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus_idx, dtype=torch.int32),
        logits_indices=torch.arange(cursor, dtype=torch.int32),
    )
    return metadata, logits


def _greedy_sampling_metadata(batch: int, vocab: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None,
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@pytest.mark.parametrize("method", ["mtad", "adaptive"])
def test_greedy_near_tie_gives_vllms_tokens(vllm_cpu_kernels, method: str) -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_specx.backends.cpu import BACKEND
    from vllm_specx.glue.sampler import SpecxRejectionSampler

    vocab = 16
    tie = _near_tie_row(vocab, 3, 9)  # vLLM's greedy token: 9; the probabilities': 3
    assert tie.softmax(-1)[3] == tie.softmax(-1)[9] and int(tie.argmax()) == 9
    bonus = _near_tie_row(vocab, 5, 6)
    # Request 0 drafts vLLM's token (accepted), request 1 the probabilities' (rejected),
    # request 2 accepts one and is rejected at the second.
    drafts = [[9], [3], [9, 3]]
    rows = [tie, bonus, tie, bonus, tie, tie, bonus]
    metadata, logits = _step(drafts, rows)
    sampling = _greedy_sampling_metadata(len(drafts), vocab)

    settings = {"method": method, "acceptance_threshold": 0.1}
    ours = SpecxRejectionSampler(Sampler(), None, torch.device("cpu"), settings, BACKEND)
    theirs = RejectionSampler(Sampler(), None, torch.device("cpu"))
    got = ours(metadata, None, logits.clone(), sampling).sampled_token_ids
    want = theirs(metadata, None, logits.clone(), sampling).sampled_token_ids
    assert want.tolist() == [[9, 6, -1], [9, -1, -1], [9, 9, -1]]  # vLLM's own answer
    assert got.tolist() == want.tolist()
