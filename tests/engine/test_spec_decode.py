"""vLLM's own speculative decoding (n-gram, draft model) in the real CPU engine.

Greedy speculative decoding must reproduce plain greedy decoding token for token,
while actually accepting and rejecting drafts; seeded sampling must reproduce itself.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
from engine_requests import spec_counts

pytestmark = pytest.mark.engine

NEW_TOKENS = 40


def _prompts() -> list[str]:
    source = inspect.getsource(textwrap)
    return [
        "def wrap(text, width=70, **kwargs):",
        source[1500:1800],
        # Repetitive text: n-gram lookups find matches in the prompt.
        "import os\nimport sys\n" * 12,
        source[5000:5120],
    ]


def _greedy(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(target_llm):
    return _greedy(target_llm)


@pytest.mark.parametrize("engine", ["ngram_llm", "draft_llm"])
def test_greedy_spec_decode_equals_plain_greedy(engine, baseline, request):
    llm = request.getfixturevalue(engine)
    got, drafted, accepted = spec_counts(llm, lambda: _greedy(llm))
    assert got == baseline
    # Both verification outcomes happened: some drafts accepted, some rejected.
    assert drafted > 0
    assert 0 < accepted < drafted


# Short prompts for seeded sampling: all of them prefill in one step (seeded prompts
# prefilled in chunks have a test of their own below).
SHORT_PROMPTS = [
    "def wrap(text, width=70, **kwargs):",
    "import os\nimport sys\nimport os\n",
    "class TextWrapper:",
    "    return result",
]


def _sampled(llm, *, seed: int, temperature: float = 0.8, **kw):
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed + i, **kw
        )
        for i in range(len(SHORT_PROMPTS))
    ]
    outs = llm.generate(SHORT_PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _greedy_short(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(SHORT_PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("engine", ["target_llm", "draft_llm"])
def test_seeded_sampling_is_reproducible(engine, request):
    llm = request.getfixturevalue(engine)
    first = _sampled(llm, seed=1234, top_p=0.95, top_k=50)
    again = _sampled(llm, seed=1234, top_p=0.95, top_k=50)
    other = _sampled(llm, seed=99, top_p=0.95, top_k=50)
    assert first == again
    assert first != other  # the seed reaches the sampler
    vocab = llm.llm_engine.model_config.get_vocab_size()
    assert all(0 <= t < vocab for seq in first for t in seq)


# top_k goes with a top_p < 1: vLLM 0.32.0's top-k-only CPU path (apply_top_k_only)
# crashes on a step with no draft tokens (k.max() of an empty tensor).
@pytest.mark.parametrize(
    "filters", [{"top_k": 1, "top_p": 0.99}, {"top_p": 1e-4}], ids=["top_k", "top_p"]
)
def test_sampled_spec_decode_follows_one_token_filters(filters, draft_llm, target_llm):
    """Random-path speculative decoding with a top-k/top-p filter that keeps one token
    must reproduce greedy decoding, whatever the draws: the target distribution is
    one-hot, so a draft is accepted iff it is the target's argmax and the recovered
    token is that argmax. This needs the per-draft-token top-k/top-p values to reach
    the sampler intact (vLLM 0.32.0's own CPU expand adapter left them uninitialised).
    """
    greedy = _greedy_short(target_llm)
    got, drafted, accepted = spec_counts(
        draft_llm, lambda: _sampled(draft_llm, seed=7, temperature=0.8, **filters)
    )
    assert got == greedy
    assert drafted > 0 and 0 < accepted < drafted


@pytest.mark.parametrize("engine", ["target_llm", "draft_llm"])
def test_seeded_request_prefilled_in_chunks(engine, request):
    """vLLM 0.32.0 rewinds a seeded request's generator with ``set_offset`` after each
    partial prefill chunk, which killed the CPU engine (fix ``cpu_seeded_partial_prefill``).

    The first run prefills the prompt in chunks (engine budget 64 tokens per step), so two
    sampled tokens are discarded; the second run finds the prompt's full blocks in the
    prefix cache and computes its last chunk, the same query as the first run's last
    chunk, in one step, with nothing discarded. The outputs are equal only if the
    discarded samples left the request's own random stream untouched."""
    from vllm import SamplingParams

    llm = request.getfixturevalue(engine)
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode(inspect.getsource(textwrap)[8000:12000])[:150]
    assert len(prompt_ids) == 150  # > 2 x 64: three chunks

    def sample():
        params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)
        out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
        return out[0].outputs[0].token_ids

    chunked, cached = sample(), sample()
    assert len(chunked) == 24
    assert list(chunked) == list(cached)
