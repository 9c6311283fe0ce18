"""Per-request sampling parameters under every specx method, as a user configures it.

A server's batch mixes requests that ask for penalties, logprobs, prompt logprobs,
``min_tokens`` with stop tokens, an allowed-token list, one token only, ``n`` samples and
top-k / top-p filters (``engine_requests.per_request_greedy`` / ``per_request_sampled``).
Each specx method runs such a batch in the real engine (CPU, float32, the methods'
defaults: cost control on; plus ``adaptive`` at a fixed K, so that every step verifies
drafts): greedy requests must equal decoding without speculation under the same
parameters, token for token and logprob for logprob, the parameters must hold, and the
engine must keep serving afterwards. (vLLM itself refuses ``min_p`` and ``logit_bias`` with
speculative decoding, for its own methods too.) Model Runner V2:
``tests/v2/test_v2_per_request_params.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_requests import (
    PER_REQUEST_LOGPROBS_ROW,
    check_per_request_greedy,
    generate,
    output_ids,
    per_request_greedy,
    per_request_sampled,
    per_request_stop_token,
    spec_counts,
)

pytestmark = pytest.mark.engine

NEW_TOKENS = 24
ENGINE_KW: dict[str, Any] = dict(max_model_len=256, max_num_seqs=8,
                                 kv_cache_memory_bytes=8 * 2**20, skip_tokenizer_init=True,
                                 disable_log_stats=False)
# name -> (target: "pair" (the fixture pair's) or "mtp" (the MTP fixture), speculative_config
# without the pair's draft model)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "adaptive": ("pair", {"method": "adaptive", "num_speculative_tokens": 4}),
    "adaptive_fixed_k": ("pair", {"method": "adaptive", "num_speculative_tokens": 4,
                                  "min_speculative_tokens": 4, "cost_control": False}),
    "mtad": ("pair", {"method": "mtad", "num_speculative_tokens": 3}),
    "specx_mtp": ("mtp", {"method": "specx_mtp", "num_speculative_tokens": 3,
                          "adaptive": True}),
}


def _targets() -> dict[str, tuple[str, str]]:
    from vllm_specx.fixtures import fixture_model_dirs, fixtures_root

    target, draft = (str(p) for p in fixture_model_dirs())
    return {"pair": (target, draft), "mtp": (str(fixtures_root() / "mtp_target"), "")}


def _prompts(target: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts

    tok = AutoTokenizer.from_pretrained(target)
    return [tok(t)["input_ids"][:5 + 3 * i] for i, t in enumerate(heldout_prompts(6))]


def _generate(llm: Any, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[Any]:
    """The outputs in request order (``n`` > 1 requests: one output, n completions)."""
    from vllm import SamplingParams

    outs = generate(llm, prompts, [SamplingParams(**p) for p in params])
    return sorted(outs, key=lambda o: int(o.request_id))


def _run(llm: Any, prompts: list[list[int]], greedy: list[dict[str, Any]]) -> dict[str, Any]:
    sampled = per_request_sampled(NEW_TOKENS)
    (greedy_out, sampled_out), drafted, _ = spec_counts(llm, lambda: (
        _generate(llm, prompts, greedy), _generate(llm, prompts[:len(sampled)], sampled)))
    return {"greedy": greedy_out, "sampled": sampled_out, "drafted": drafted,
            # Still serving: the first two requests again.
            "again": output_ids(_generate(llm, prompts[:2], greedy[:2]))}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    """The plain engine's outputs per target, then each config's, one engine at a time."""
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm

    targets = _targets()
    out: dict[str, Any] = {}
    for kind, (target, _) in targets.items():
        prompts = _prompts(target)
        with running_llm(target, **ENGINE_KW) as llm:
            free = output_ids(_generate(llm, prompts, [
                {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}] * len(prompts)))
            stop = per_request_stop_token(free)
            greedy = per_request_greedy(NEW_TOKENS, stop)
            out[kind] = {"prompts": prompts, "free": free, "stop": stop, "params": greedy,
                         "plain": _generate(llm, prompts, greedy)}
    for name, (kind, spec) in CONFIGS.items():
        target, draft = targets[kind]
        config = {**spec, "model": draft} if draft else dict(spec)
        llm = make_llm(target, speculative_config=config, **ENGINE_KW)
        try:
            out[name] = _run(llm, out[kind]["prompts"], out[kind]["params"])
        finally:
            shutdown_llm(llm)
    yield out


def _same_logprobs(mine: Any, theirs: Any) -> bool:
    """Two positions' logprob dicts hold the same tokens at the same values."""
    return set(mine) == set(theirs) and all(
        abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_requests_with_parameters_equal_no_speculation(runs: dict[str, Any],
                                                              name: str) -> None:
    base = runs[CONFIGS[name][0]]
    got, plain = runs[name]["greedy"], base["plain"]
    ids = [list(o.outputs[0].token_ids) for o in got]
    assert ids == [list(o.outputs[0].token_ids) for o in plain]
    # The parameters held (under speculation and without: the runs are equal).
    check_per_request_greedy(ids, base["free"], base["stop"])
    # The same logprobs as without speculation: the five best tokens at every position and
    # the prompt's.
    row = PER_REQUEST_LOGPROBS_ROW
    spec_lp, plain_lp = got[row].outputs[0].logprobs, plain[row].outputs[0].logprobs
    assert len(spec_lp) == NEW_TOKENS and all(len(row) >= 5 for row in spec_lp)
    assert all(_same_logprobs(m, t) for m, t in zip(spec_lp, plain_lp))
    assert all(_same_logprobs(m, t) for m, t in zip(got[row].prompt_logprobs[1:],
                                                    plain[row].prompt_logprobs[1:]))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sampled_requests_keep_their_filters_and_the_engine_serves_on(runs: dict[str, Any],
                                                                     name: str) -> None:
    base, run = runs[CONFIGS[name][0]], runs[name]
    top_k_one, n_three, _, with_logprobs = run["sampled"]
    assert list(top_k_one.outputs[0].token_ids) == base["free"][0]
    assert len(n_three.outputs) == 3
    assert all(len(c.token_ids) == NEW_TOKENS for c in n_three.outputs)
    assert all(len(row) >= 3 for row in with_logprobs.outputs[0].logprobs)
    assert run["again"] == [list(o.outputs[0].token_ids) for o in base["plain"][:2]]


def test_the_fixed_k_engine_verified_drafts(runs: dict[str, Any]) -> None:
    """The fixed-K config drafts on every step, so the equalities above were reached
    through verification, not through plain steps."""
    assert runs["adaptive_fixed_k"]["drafted"] > 0
