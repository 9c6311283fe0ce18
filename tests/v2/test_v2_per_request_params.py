"""Per-request sampling parameters under the specx methods on Model Runner V2 (CPU
platform, Triton interpreter): the batch of ``tests/engine/test_per_request_params.py``
(penalties, logprobs, ``min_tokens`` against a stop token, an allowed-token list, one
token only; top-k 1, ``n`` = 3, a tiny top-p, penalties with logprobs), each method as a
user configures it (cost control on). Greedy requests must equal V2 without speculation
under the same parameters, token for token and logprob for logprob; top-k 1 at T = 1 must
draw the greedy tokens; the engine must keep serving afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_requests import (
    PER_REQUEST_LOGPROBS_ROW,
    check_per_request_greedy,
    per_request_greedy,
    per_request_sampled,
    per_request_stop_token,
)
from v2_cases import DRAFT, MTP_TARGET, TARGET, heldout_prompts

pytestmark = pytest.mark.engine

NEW_TOKENS = 12
# name -> (target, speculative_config)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "adaptive": (TARGET, {"method": "adaptive", "model": DRAFT, "num_speculative_tokens": 4}),
    "mtad": (TARGET, {"method": "mtad", "model": DRAFT, "num_speculative_tokens": 3}),
    "specx_mtp": (MTP_TARGET, {"method": "specx_mtp", "num_speculative_tokens": 3,
                               "adaptive": True}),
}


def run_params(llm: Any, prompts: list[list[int]], greedy: list[dict[str, Any]],
               sampled: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs in the V2 host: the greedy batch, its logprobs request again on its own (the
    chosen tokens' logprobs), the sampled batch, and the first two greedy requests again."""
    from vllm_specx.testing.v2_engine import generate_token_ids, generate_with_logprobs

    row = PER_REQUEST_LOGPROBS_ROW
    return {
        "greedy": generate_token_ids(llm, prompts, greedy),
        "logprobs": generate_with_logprobs(llm, prompts[row:row + 1], greedy[row])[0],
        "sampled": generate_token_ids(llm, prompts[:len(sampled)], sampled),
        "again": generate_token_ids(llm, prompts[:2], greedy[:2]),
    }


@pytest.fixture(scope="module")
def runs(v2_engine: Any, v2_host: Any) -> dict[str, Any]:
    prompts = [p[:12] for p in heldout_prompts()] + [[(7 * i + 3) % 500 + 10 for i in range(9)],
                                                    [(5 * i + 1) % 400 + 20 for i in range(6)]]
    out: dict[str, Any] = {"prompts": prompts}
    for target in dict.fromkeys(t for t, _ in CONFIGS.values()):
        key = f"plain {target}"
        v2_engine(key, target)
        free = v2_host.generate(key, prompts, {"temperature": 0.0, "max_tokens": NEW_TOKENS,
                                               "ignore_eos": True})
        stop = per_request_stop_token(free)
        greedy = per_request_greedy(NEW_TOKENS, stop)
        out[target] = {"free": free, "stop": stop, "params": greedy,
                       "plain": v2_host.call(key, f"{__name__}:run_params", prompts, greedy,
                                             per_request_sampled(NEW_TOKENS))}
        v2_host.stop(key)
    for name, (target, spec) in CONFIGS.items():
        v2_engine(name, target, speculative_config=spec)
        out[name] = v2_host.call(name, f"{__name__}:run_params", prompts,
                                 out[target]["params"], per_request_sampled(NEW_TOKENS))
        v2_host.stop(name)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_per_request_parameters_on_v2(runs: dict[str, Any], name: str) -> None:
    base, got = runs[CONFIGS[name][0]], runs[name]
    plain = base["plain"]
    assert got["greedy"] == plain["greedy"]
    check_per_request_greedy(got["greedy"], base["free"], base["stop"])
    assert [t for t, _ in got["logprobs"]] == [t for t, _ in plain["logprobs"]]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got["logprobs"], plain["logprobs"]))
    # top-k 1 at T = 1 draws the argmax; every sampled request ran its length.
    assert got["sampled"][0] == base["free"][0]
    assert [len(s) for s in got["sampled"]] == [NEW_TOKENS] * len(got["sampled"])
    assert got["again"] == plain["greedy"][:2]
