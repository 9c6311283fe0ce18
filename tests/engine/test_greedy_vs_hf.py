"""vLLM's real CPU engine (with the reference ops) vs. Hugging Face transformers.

One engine: 32-token KV blocks, a 64-token per-step budget (long prompts prefill in
chunks, mixed with other requests' decodes), prefix caching on.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

from vllm_specx.testing.hf_reference import hf_greedy

pytestmark = pytest.mark.engine

NEW_TOKENS = 24
LOGPROB_ATOL = 1e-5


def _prompts() -> list[str]:
    source = inspect.getsource(textwrap)
    # Different lengths, from a few tokens to several KV blocks.
    return [
        source[start : start + n]
        for start, n in [(0, 12), (900, 90), (2000, 230), (4000, 420), (7000, 600)]
    ]


def _check_against_hf(llm, models, prompts, *, expect_cached: bool):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(models.target)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert [o.prompt_token_ids for o in outputs] == prompt_ids  # same tokenisation
    assert len({len(ids) for ids in prompt_ids}) == len(prompts)
    assert max(len(ids) for ids in prompt_ids) > 3 * 32  # several blocks and chunks
    refs = hf_greedy(models.target, prompt_ids, NEW_TOKENS)
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        assert list(completion.token_ids) == ref.token_ids
        got = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        assert got == pytest.approx(ref.logprobs, abs=LOGPROB_ATOL)
        if expect_cached:
            assert (out.num_cached_tokens or 0) >= 32, "expected a prefix-cache hit"
    return outputs, refs


def test_greedy_tokens_and_logprobs_match_hf(target_llm, models):
    _, refs = _check_against_hf(target_llm, models, _prompts(), expect_cached=False)
    # The comparison is meaningful: no step's argmax is a near tie.
    assert min(min(r.margins) for r in refs) > 1e-4


def test_prefix_cache_hits_match_hf(target_llm, models):
    """Prompts sharing 2+ blocks with earlier prompts reuse cached KV and still match."""
    first = _prompts()
    _check_against_hf(target_llm, models, first[3:], expect_cached=False)
    second = [p[:300] + "\n# a different ending " + str(i) for i, p in enumerate(first[3:])]
    _check_against_hf(target_llm, models, second, expect_cached=True)
