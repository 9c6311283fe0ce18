"""The benchmark's numbers against an obviously-correct reference.

Greedy speculative decoding is deterministic, so the acceptance the engine reports for
``draft_model`` must be what a plain loop over the same two models in transformers gets:
draft K tokens greedily, accept while they equal the target's argmax, emit the accepted
tokens plus the target's own next token. The loop recomputes everything each step (no KV
cache), which is slow but leaves nothing to get wrong. Uses the trained fixture pair
(skipped when it is not built): random models have near-tied logits, where float
rounding alone could flip an argmax.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

K = 3
NUM_PROMPTS = 4
MAX_TOKENS = 32


def _fixture_pair():
    from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts

    try:
        target, draft = fixture_model_dirs()
        prompts = heldout_prompts(NUM_PROMPTS)
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(f"fixture models not built: {exc}")
    return target, draft, prompts


def reference_greedy_speculation(target_dir: Path, draft_dir: Path, prompts: list[str]) -> dict:
    """Per-position acceptance, forwards and tokens of greedy speculative decoding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    eos = target.config.eos_token_id

    def argmax_next(model, ids: torch.Tensor) -> torch.Tensor:
        return model(ids).logits[0].argmax(-1)  # argmax after every position

    accepted_at = [0] * K
    steps = forwards = generated = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            start = ids.shape[1]
            out: list[int] = [int(argmax_next(target, ids)[-1])]  # prefill
            fwd = 1
            while len(out) < MAX_TOKENS and out[-1] != eos:
                ctx = torch.cat([ids, torch.tensor([out])], 1)
                proposal = ctx
                for _ in range(K):
                    nxt = argmax_next(draft, proposal)[-1]
                    proposal = torch.cat([proposal, nxt.view(1, 1)], 1)
                drafts = proposal[0, ctx.shape[1]:].tolist()
                verdict = argmax_next(target, proposal)[ctx.shape[1] - 1:].tolist()  # K + 1
                fwd += 1
                steps += 1
                a = 0
                while a < K and drafts[a] == verdict[a]:
                    a += 1
                for i in range(a):
                    accepted_at[i] += 1
                for t in drafts[:a] + [verdict[a]]:  # stop at max_tokens or EOS, like vLLM
                    if len(out) >= MAX_TOKENS or out[-1] == eos:
                        break
                    out.append(t)
            assert start > 0
            forwards += fwd
            generated += len(out)
    return {
        "acceptance_per_position": [n / steps for n in accepted_at],
        "target_forward_passes": forwards,
        "generated_tokens": generated,
    }


def test_greedy_draft_model_matches_the_reference_loop(tmp_path: Path):
    from vllm_specx.cli import main

    target, draft, prompts = _fixture_pair()
    out = tmp_path / "r.json"
    rc = main([
        "bench", "--pair", "fixture", "--temperature", "0", "--num-prompts", str(NUM_PROMPTS),
        "--max-tokens", str(MAX_TOKENS), "--no-plots", "--output", str(out),
        "--config", json.dumps({"method": "draft_model", "num_speculative_tokens": K}),
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["models"]["target"]["path"] == str(target)
    dm = report["configs"][1]
    ref = reference_greedy_speculation(target, draft, prompts)

    assert dm["generated_tokens"] == ref["generated_tokens"]
    # Float32 in two implementations: allow an argmax flip or two out of ~100 tokens.
    assert dm["target_forward_passes"] == pytest.approx(ref["target_forward_passes"], abs=2)
    assert dm["acceptance_per_position"] == pytest.approx(ref["acceptance_per_position"],
                                                          abs=0.05)
    assert dm["block_efficiency"] == pytest.approx(
        ref["generated_tokens"] / ref["target_forward_passes"], abs=0.1)
    assert dm["matches_baseline"] == 1.0
