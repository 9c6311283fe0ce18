"""Requests that finish in the middle of an MTAD draft: stop strings, stop token ids
(how EOS ends a request), max_tokens below K. Real engines on the fixture pair, with
the tokenizer (stop strings need detokenisation).

The stops are picked from the non-speculative greedy continuation so that they fall a
few tokens in, where the draft (K = 4) usually runs past them: whatever MTAD accepted
after the stop must be dropped, and the output, text and finish reason must be those of
non-speculative decoding.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_support import start_engine

pytestmark = pytest.mark.engine

K = 4
# A token budget that fits all prompts at once: a seeded request in a chunked prefill
# hits vLLM's CPU generator defect (docs/upstream-vllm-cpu-adapter-defects.md, item 4).
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256, skip_tokenizer_init=False, max_num_batched_tokens=512
)
N_PROMPTS = 4


@pytest.fixture(scope="module")
def prompts():
    from vllm_specx.fixtures import heldout_prompts

    return heldout_prompts(N_PROMPTS)


def _summary(outputs) -> list[tuple[list[int], str, str, Any]]:
    return [
        (list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason,
         o.outputs[0].stop_reason)
        for o in sorted(outputs, key=lambda o: int(o.request_id))
    ]


def _stop_params(free_runs: list[list[int]], texts: list[str]) -> list[Any]:
    """Per prompt: a stop string, a stop token, max_tokens < K, and a stop string
    with a seeded sampled request, all taken from the free run's continuation."""
    from vllm import SamplingParams

    params = []
    for i, (ids, text) in enumerate(zip(free_runs, texts)):
        kind = i % 4
        if kind == 0:
            # A stop string a few tokens in: 3 characters from the middle of the text.
            cut = len(text) // 3
            params.append(SamplingParams(temperature=0.0, max_tokens=32,
                                         stop=[text[cut:cut + 3]]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=32,
                                         stop_token_ids=[ids[6]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=K - 1))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=32,
                                         stop=[text[5:8]], include_stop_str_in_output=True))
    return params


@pytest.fixture(scope="module")
def runs(prompts):
    from vllm import SamplingParams

    from vllm_specx.engine import running_llm
    from vllm_specx.fixtures import fixture_model_dirs

    target, draft = (str(p) for p in fixture_model_dirs())
    free = SamplingParams(temperature=0.0, max_tokens=32)
    with running_llm(target, **ENGINE_KW) as llm:
        free_out = _summary(llm.generate(prompts, [free] * N_PROMPTS, use_tqdm=False))
        params = _stop_params([f[0] for f in free_out], [f[1] for f in free_out])
        plain = _summary(llm.generate(prompts, params, use_tqdm=False))
    eng = start_engine(target, draft, K, num_beams=2, **ENGINE_KW)
    try:
        mtad = _summary(eng.llm.generate(prompts, params, use_tqdm=False))
        sampled = [
            SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=s, max_tokens=40,
                           stop=["\n"])
            for s in range(N_PROMPTS)
        ]
        first = _summary(eng.llm.generate(prompts, sampled, use_tqdm=False))
        second = _summary(eng.llm.generate(prompts, sampled, use_tqdm=False))
    finally:
        eng.close()
    return dict(free=free_out, plain=plain, mtad=mtad, sampled=(first, second))


def test_stops_land_mid_generation(runs):
    """The fixture works as intended: every stop ends the request early."""
    for (free_ids, *_), (ids, _, reason, _) in zip(runs["free"], runs["plain"]):
        assert 0 < len(ids) < len(free_ids) and len(ids) < 32
        assert reason in ("stop", "length")


def test_greedy_stops_equal_non_speculative(runs):
    assert runs["mtad"] == runs["plain"]


def test_sampled_stop_string_requests_reproduce_and_stop(runs):
    first, second = runs["sampled"]
    assert first == second
    assert any(len(ids) > K for ids, *_ in first)  # some stopped after whole drafts
    for ids, text, reason, stop in first:
        assert "\n" not in text
        assert (reason, stop) == ("stop", "\n") or (reason == "length" and len(ids) == 40)
