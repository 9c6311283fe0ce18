"""The Hugging Face MTAD reference loop (tests/mtad_reference.py) checks itself."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from mtad_reference import (
    Warping,
    greedy_generate,
    hf_beam_draft,
    joint_accept_length,
    last_logits,
    mtad_generate,
    tiny_llama,
)

VOCAB = 24


@pytest.fixture(scope="module")
def models():
    return tiny_llama(VOCAB, seed=0, hidden=48), tiny_llama(VOCAB, seed=1)


PROMPT = [3, 17, 5, 9, 1, 22]


@pytest.mark.parametrize("k,b", [(1, 1), (3, 2), (4, 4)])
def test_greedy_mtad_equals_greedy_target(models, k, b):
    target, draft = models
    want = greedy_generate(target, PROMPT, 20)
    got = mtad_generate(target, draft, PROMPT, 20, k, b, 0.1, Warping(temperature=0.0))
    assert got.tokens == want
    assert all(0 <= r.accepted <= k for r in got.rounds)


def test_greedy_mtad_with_draft_equal_target_accepts_everything(models):
    """Draft == target and B = 1: the greedy beam is the target's greedy path."""
    target, _ = models
    got = mtad_generate(target, target, PROMPT, 12, 3, 1, 0.1, Warping(temperature=0.0))
    assert all(r.accepted == 3 for r in got.rounds[:-1])


def test_hf_beam_draft_exhaustive_when_beams_cover_prefixes(models):
    _, draft = models
    k, b = 2, VOCAB  # B >= V^(k-1)
    tokens, q = hf_beam_draft(draft, PROMPT, b, k, Warping(temperature=0.0))
    best, best_lp = None, -math.inf
    lp0 = last_logits(draft, torch.tensor([PROMPT])).log_softmax(-1)[0]
    ids = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
    lp1 = last_logits(draft, ids).log_softmax(-1)
    for t0, t1 in itertools.product(range(VOCAB), repeat=2):
        s = float(lp0[t0] + lp1[t0, t1])
        if s > best_lp:
            best, best_lp = [t0, t1], s
    assert tokens == best
    assert q == pytest.approx(
        [math.exp(float(lp0[best[0]])), math.exp(float(lp1[best[0], best[1]]))], rel=1e-5
    )


def test_sampled_mtad_is_reproducible_with_seed(models):
    target, draft = models
    w = Warping(temperature=0.8, top_k=10, top_p=0.9)
    a = mtad_generate(target, draft, PROMPT, 16, 4, 3, 0.1, w, seed=5)
    b = mtad_generate(target, draft, PROMPT, 16, 4, 3, 0.1, w, seed=5)
    c = mtad_generate(target, draft, PROMPT, 16, 4, 3, 0.1, w, seed=6)
    assert a.tokens == b.tokens and len(a.tokens) == 16
    assert a.tokens != c.tokens
    for r in a.rounds:
        assert len(r.draft) == 4 and all(0 < x <= 1 for x in r.q)


def test_tiny_tau_accepts_whole_drafts(models):
    """tau -> 0 accepts every draft whose tokens have p > 0 (no top-k/top-p here)."""
    target, draft = models
    w = Warping(temperature=1.0)
    got = mtad_generate(target, draft, PROMPT, 15, 4, 2, 1e-30, w, seed=0)
    assert all(r.accepted == 4 for r in got.rounds)
    assert got.block_efficiency == 5.0


def test_joint_rule_takes_largest_passing_depth():
    # S = [log .5 - log 1, + log 1 - log .1, ...]: depth 1 fails at tau=0.9, depth 2 passes.
    lp = [math.log(0.5), math.log(1.0), math.log(0.01)]
    q = [1.0, 0.1, 1.0]
    assert joint_accept_length(lp, q, 0.9) == 2
    assert joint_accept_length(lp, q, 1.0) == 2
    assert joint_accept_length([math.log(0.01)], [1.0], 0.1) == 0


def test_joint_rule_agrees_with_specx_sampler():
    """The local loop and the sampler's vectorised ``verify(rule="mtad")`` agree."""
    verify_mod = pytest.importorskip("vllm_specx.algorithms.verify")
    torch.manual_seed(0)
    v, b = 7, 40
    counts = torch.randint(0, 5, (b,))
    t = int(counts.sum())
    target = torch.softmax(torch.randn(t, v) * 2, -1)
    bonus = torch.softmax(torch.randn(b, v), -1)
    drafts = torch.randint(0, v, (t,))
    q = torch.rand(t) * 0.9 + 0.05
    tau = 0.3
    batch = verify_mod.VerifyBatch(
        rule="mtad",
        draft_token_ids=drafts,
        cu_num_draft_tokens=counts.cumsum(0),
        target_probs=target,
        bonus_probs=bonus,
        is_greedy=torch.zeros(b, dtype=torch.bool),
        uniforms=torch.rand(t),
        exp_noise=torch.empty(b, v).exponential_(),
        max_spec_len=int(counts.max()),
        draft_token_probs=q,
        acceptance_threshold=tau,
    )
    out = verify_mod.verify(batch)
    start = 0
    for i in range(b):
        n = int(counts[i])
        lp = [math.log(float(target[start + j, drafts[start + j]])) for j in range(n)]
        a = joint_accept_length(lp, q[start : start + n].tolist(), tau)
        row = out[i].tolist()
        emitted = [x for x in row if x >= 0]
        assert len(emitted) == a + 1, (i, row, a)
        assert emitted[:a] == drafts[start : start + a].tolist()
        start += n
