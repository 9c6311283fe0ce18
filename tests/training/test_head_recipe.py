"""SpecDec++ head-training pieces against slow, obviously-correct references: labels, token
mixing, the weighted soft BCE, the soft AUC, teacher-forced scoring on the fixture pair, the
held-out split and the training loop's determinism."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from vllm_specx.training.data import Response
from vllm_specx.training.head import (
    HeadTrainOptions,
    acceptance_labels,
    greedy_acceptance_labels,
    mix_tokens,
    response_generator,
    score_responses,
    split_responses,
    weighted_soft_bce,
)
from vllm_specx.training.loop import soft_auc, train_loop

# Many small torch ops: one intra-op thread is faster on a small shared machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_acceptance_labels_match_per_token_reference():
    g = torch.Generator().manual_seed(0)
    L, V = 40, 9
    p = torch.softmax(torch.randn(L, V, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(L, V, generator=g) * 3, -1)
    y = torch.multinomial(q, 1, generator=g).squeeze(1)
    got = acceptance_labels(p, q, y)
    for t in range(L):
        pt, qt = float(p[t, y[t]]), float(q[t, y[t]])
        assert math.isclose(float(got[t]), min(1.0, pt / qt), rel_tol=1e-6)
    # Identical distributions: always accepted; a token the target cannot produce: never.
    assert torch.equal(acceptance_labels(q, q, y), torch.ones(L))
    p0 = p.clone()
    p0[torch.arange(L), y] = 0
    assert torch.equal(acceptance_labels(p0, q, y), torch.zeros(L))
    # Draft vocabulary larger than the target's: tokens past the target's vocab get 0.
    assert float(acceptance_labels(p[:, :4], q, torch.full((L,), 6))[0]) == 0.0


def test_greedy_labels_are_argmax_agreement():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(30, 5, generator=g), -1)
    q = torch.softmax(torch.randn(30, 5, generator=g), -1)
    y, a = greedy_acceptance_labels(p, q)
    for t in range(30):
        qt, pt = q[t].tolist(), p[t].tolist()
        assert int(y[t]) == qt.index(max(qt))
        assert float(a[t]) == (1.0 if pt.index(max(pt)) == int(y[t]) else 0.0)
    assert 0 < float(a.sum()) < 30


def test_mix_tokens_matches_reference_draws():
    x = torch.arange(100, 400)
    y = -torch.arange(100, 400)
    for r in (0.0, 0.15, 0.5):
        mixed, keep = mix_tokens(x, y, r, torch.Generator().manual_seed(7))
        u = torch.rand(x.shape, generator=torch.Generator().manual_seed(7))
        for t in range(x.numel()):
            want_keep = bool(u[t] < r)
            assert bool(keep[t]) == want_keep
            assert int(mixed[t]) == (int(x[t]) if want_keep else int(y[t]))
        if r == 0.0:
            assert not keep.any()
    # r = 0.15 keeps about 15% of target tokens over many positions.
    _, keep = mix_tokens(torch.zeros(20000), torch.ones(20000), 0.15,
                         torch.Generator().manual_seed(1))
    assert abs(float(keep.float().mean()) - 0.15) < 0.01


def test_weighted_soft_bce_matches_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(57, 2, generator=g) * 2
    a = torch.rand(57, generator=g)
    a[:5] = 1.0
    a[5:9] = 0.0
    for w in (1.0, 6.0, 0.3):
        num = den = 0.0
        for i in range(57):
            z0, z1 = float(logits[i, 0]), float(logits[i, 1])
            lse = max(z0, z1) + math.log(math.exp(z0 - max(z0, z1)) + math.exp(z1 - max(z0, z1)))
            ai = float(a[i])
            num += w * (1 - ai) * (lse - z0) + ai * (lse - z1)
            den += w * (1 - ai) + ai
        assert math.isclose(float(weighted_soft_bce(logits, a, w)), num / den, rel_tol=1e-5)
    # The weight moves the optimum: for one soft label 0.5, the best P(accept) is 1/(1+w).
    z = torch.zeros(1, 2, requires_grad=True)
    opt = torch.optim.SGD([z], lr=0.5)
    for _ in range(400):
        opt.zero_grad()
        weighted_soft_bce(z, torch.tensor([0.5]), 6.0).backward()
        opt.step()
    assert abs(float(torch.softmax(z.detach(), -1)[0, 1]) - 1 / 7) < 1e-3


def _slow_soft_auc(s: list[float], y: list[float]) -> float:
    num = den = 0.0
    for i, j in itertools.permutations(range(len(s)), 2):
        w = y[i] * (1 - y[j])  # i as a positive, j as a negative
        den += w
        num += w * (1.0 if s[i] > s[j] else 0.5 if s[i] == s[j] else 0.0)
    return num / den


@pytest.mark.parametrize("seed", range(4))
def test_soft_auc_matches_pairwise_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n = 35
    s = torch.randint(0, 8, (n,), generator=g).float() / 8  # many ties
    y = torch.rand(n, generator=g)
    if seed == 0:
        y = (y > 0.5).float()  # hard labels: the usual AUC
    assert math.isclose(soft_auc(s, y), _slow_soft_auc(s.tolist(), y.tolist()), rel_tol=1e-9)
    # Perfect and reversed rankings of hard labels.
    hard = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert soft_auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), hard) == 1.0
    assert soft_auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), hard) == 0.0


def test_split_is_seeded_disjoint_and_complete():
    tr, he = split_responses(50, 0.1, seed=5)
    assert tr.isdisjoint(he) and tr | he == set(range(50)) and len(he) == 5
    assert split_responses(50, 0.1, seed=5) == (tr, he)
    assert split_responses(50, 0.1, seed=6) != (tr, he)
    assert split_responses(2, 0.01, seed=0)[1] and split_responses(2, 0.99, seed=0)[0]


def test_options_refuse_bad_values_with_one_line():
    with pytest.raises(ValueError, match=r"mix_ratio=1\.0 is not allowed; allowed: a number in"):
        HeadTrainOptions(mix_ratio=1.0).check()
    with pytest.raises(ValueError, match=r"temperature=\[\] is not allowed"):
        HeadTrainOptions(temperatures=()).check()


def test_train_loop_is_deterministic_and_learns():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g)
    y = (x[:, 0] > 0).float()

    def run(seed: int) -> tuple[nn.Module, list]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        hist = train_loop(model, (x, y), lambda m, b: weighted_soft_bce(m(b[0]), b[1], 1.0),
                          epochs=3, batch_size=64, lr=0.05, seed=seed, progress=False,
                          log=lambda _m: None)
        return model, hist

    m1, h1 = run(1)
    m2, h2 = run(1)
    m3, _ = run(2)
    assert torch.equal(m1.weight, m2.weight) and [e["train_loss"] for e in h1] == [
        e["train_loss"] for e in h2]
    assert not torch.equal(m1.weight, m3.weight)  # the seed drives the shuffle
    assert h1[-1]["train_loss"] < h1[0]["train_loss"] < math.log(2)
    with torch.no_grad():
        assert soft_auc(torch.softmax(m1(x), -1)[:, 1], y) > 0.95


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_score_responses_on_fixture_pair_matches_per_position_reference(mode):
    """Teacher-forced labels and features of two responses, batched and padded, equal a
    per-response, per-position recomputation with the same generator draws."""
    from transformers import AutoModelForCausalLM

    from vllm_specx.fixtures import fixture_model_dirs

    target_dir, draft_dir = fixture_model_dirs()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    responses = [
        Response([0, 100, 200, 300], [400, 500, 600, 700, 800, 900], 1.0, 0),
        Response([0, 55], [66, 77, 88], 1.0, 1),  # shorter: padded in the batch
    ]
    r = 0.4
    data = score_responses(target, draft, responses, mix_ratio=r, seed=11, batch_size=2,
                           progress=False, draft_tokens=mode)
    rows = 0
    for i, resp in enumerate(responses):
        seq = torch.tensor([resp.prompt_ids + resp.response_ids])
        n_p = len(resp.prompt_ids)
        with torch.no_grad():
            p = torch.softmax(target(seq).logits[0].float(), -1)
            q = torch.softmax(draft(seq).logits[0].float(), -1)
        gen = response_generator(11, i)
        qs = q[n_p - 1:n_p - 1 + len(resp.response_ids)]
        if mode == "greedy":
            y = qs.argmax(-1)
        else:
            y = torch.multinomial(qs, 1, generator=gen).squeeze(1)
        u = torch.rand(len(resp.response_ids), generator=gen)
        mixed = [resp.response_ids[t] if u[t] < r else int(y[t])
                 for t in range(len(resp.response_ids))]
        with torch.no_grad():
            h = draft.model(torch.tensor([resp.prompt_ids + mixed])).last_hidden_state[0]
            # The feature is what the LM head reads: logits from it equal the draft's logits.
            torch.testing.assert_close(
                draft.lm_head(h), draft(torch.tensor([resp.prompt_ids + mixed])).logits[0])
        for t in range(len(resp.response_ids)):
            if u[t] < r:
                continue  # target token kept: no row
            p_y, q_y = float(p[n_p - 1 + t, y[t]]), float(q[n_p - 1 + t, y[t]])
            assert int(data.response_index[rows]) == i
            if mode == "greedy":
                want = 1.0 if int(p[n_p - 1 + t].argmax()) == int(y[t]) else 0.0
            else:
                want = min(1.0, p_y / q_y)
            assert math.isclose(float(data.labels[rows]), want, rel_tol=1e-4)
            torch.testing.assert_close(data.features[rows], h[n_p + t], rtol=1e-4, atol=1e-4)
            qt = sorted(q[n_p - 1 + t].tolist(), reverse=True)
            assert math.isclose(float(data.signals["token_prob"][rows]), q_y, rel_tol=1e-5)
            assert math.isclose(float(data.signals["max_prob"][rows]), qt[0], rel_tol=1e-5)
            assert math.isclose(float(data.signals["top2_margin"][rows]), qt[0] - qt[1],
                                rel_tol=1e-4, abs_tol=1e-6)
            rows += 1
    assert rows == data.labels.numel() and 0 < rows < 9
    assert data.stats["positions"] == 9
