"""All beams of a depth in one draft pass (issue 15): the batched drafter drafts exactly
what the one-pass-per-beam drafter drafted and what the Hugging Face reference beam
search drafts, for greedy requests, K in {1, 3, 4, 8}, B in {1, 2, 4, 8}, ragged prompts;
and a round costs K draft passes for every B.

One engine per K (B is changed on the running drafter; the engine reserves scratch KV
for B = 8, the widest here).
"""

from __future__ import annotations

import pytest
import torch
from engine_support import check_rounds_against_reference, make_tiny_pair, start_engine
from mtad_reference import Warping, greedy_generate

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [5, 11, 41, 23]
MAX_TOKENS = [9, 3, 7, 10]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = make_tiny_pair(tmp_path_factory.mktemp("mtad_batched"))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target_dir, draft_dir, target, draft


def run(engine, prompts, params):
    before = engine.drafter.stats.as_dict()
    seqs = engine.generate(prompts, params)
    after = engine.drafter.stats.as_dict()
    rounds = {(r.req_id, r.position): (r.tokens, r.q) for r in engine.records}
    delta = {key: after[key] - before[key] for key in ("rounds", "requests",
             "tail_forward_passes", "draft_forward_passes", "sequential_rounds")}
    return seqs, rounds, delta


@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_batched_drafts_equal_one_pass_per_beam_and_reference(pair, k):
    from vllm import SamplingParams

    target_dir, draft_dir, target, draft = pair
    # 256 batched tokens: every depth of 4 requests x 8 beams fits one pass.
    engine = start_engine(target_dir, draft_dir, k, num_beams=8, max_num_batched_tokens=256)
    try:
        g = torch.Generator().manual_seed(k)
        prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
        chain_rounds = None
        for b in (1, 2, 4, 8):
            engine.drafter.num_beams = b
            engine.drafter.batched_beams = False
            _, seq_rounds, seq_cost = run(engine, prompts, params)
            engine.drafter.batched_beams = True
            seqs, rounds, cost = run(engine, prompts, params)
            ids = sorted(seqs, key=int)
            for rid, prompt, sp in zip(ids, prompts, params):
                assert seqs[rid] == prompt + greedy_generate(target, prompt, sp.max_tokens)
            # Same rounds (the second run hits the prefix cache: same drafting points).
            by_index = {(int(r) % 4, p): v for (r, p), v in rounds.items()}
            seq_by_index = {(int(r) % 4, p): v for (r, p), v in seq_rounds.items()}
            assert by_index.keys() == seq_by_index.keys()
            for key, (tokens, q) in by_index.items():
                assert tokens == seq_by_index[key][0], (b, key)
                assert q == pytest.approx(seq_by_index[key][1], rel=1e-4, abs=1e-6), (b, key)
            warpings = {rid: Warping(temperature=0.0) for rid in ids}
            lens = {rid: len(p) for rid, p in zip(ids, prompts)}
            checked, _ = check_rounds_against_reference(engine, seqs, lens, draft, warpings, k)
            assert checked >= 8
            # K draft passes per request-round for every B (first pass + one per depth).
            assert cost["sequential_rounds"] == 0
            assert cost["tail_forward_passes"] == cost["rounds"] * (k - 1)
            assert cost["draft_forward_passes"] == cost["requests"] * k
            if b > 1 and k > 1:  # what batching saves: 1 + B*(K-1) passes before
                assert seq_cost["tail_forward_passes"] == seq_cost["rounds"] * b * (k - 1)
            if b == 1:
                chain_rounds = by_index
        # greedy_chain: greedy rows of a B = 8 drafter draft the B = 1 chain, with its q.
        engine.drafter.greedy_chain = True
        try:
            _, rounds, _ = run(engine, prompts, params)
        finally:
            engine.drafter.greedy_chain = False
        by_index = {(int(r) % 4, p): v for (r, p), v in rounds.items()}
        assert by_index.keys() == chain_rounds.keys()
        for key, (tokens, q) in by_index.items():
            assert tokens == chain_rounds[key][0], key
            assert q == pytest.approx(chain_rounds[key][1], rel=1e-4, abs=1e-6), key
    finally:
        engine.close()
