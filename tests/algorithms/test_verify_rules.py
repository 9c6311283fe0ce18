"""The verification rules of ``vllm_specx.algorithms.verify``, checked exhaustively.

* MTAD: on a full grid of per-token (p, q) values the accepted length equals a
  brute-force evaluation of the rule written as products (largest i with
  prod p_j / prod q_j > tau), and the extra token comes from p_{a+1}.
* Greedy requests: speculative decoding with the sampler reproduces plain greedy
  decoding token for token, under both rules, with tied logits.
* The building blocks: per-token decisions, accepted lengths, NaN-freedom.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from vllm_specx.algorithms import verify as V


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on 2 shared cores
    yield
    torch.set_num_threads(threads)


GRID = (0.0, 0.05, 0.2, 0.6, 0.9, 1.0)
VOCAB = 8


def _brute_force_mtad(ps: tuple, qs: tuple, tau: float) -> tuple[int, bool]:
    """(a, fragile): the largest depth whose joint likelihood ratio exceeds tau.

    A zero q_j means the draft could not have proposed x_j: depth j and deeper fail.
    ``fragile``: a ratio equals tau up to float32 rounding of the logs.
    """
    a, fragile = 0, False
    num = den = 1.0
    dead = False
    for i, (p, q) in enumerate(zip(ps, qs), start=1):
        dead |= q == 0.0 or p == 0.0
        if dead:
            continue
        num *= p
        den *= q
        ratio = num / den
        if ratio > tau:
            a = i
        exact = all(pj == qj for pj, qj in zip(ps[:i], qs[:i]))  # log ratio exactly 0
        fragile |= not exact and abs(math.log(ratio) - math.log(tau)) < 1e-5
    return a, fragile


def _mtad_row(j: int, p: float) -> list[float]:
    row = [0.0] * VOCAB
    row[j] = p
    row[4 + j] += 1.0 - p  # the rest on a token that identifies position j
    return row


@pytest.mark.parametrize("tau", [1.0, 0.37, 0.013])
def test_mtad_matches_brute_force_on_a_full_grid(tau: float) -> None:
    cases = [
        (ps, qs)
        for n in (1, 2, 3)
        for ps in itertools.product(GRID, repeat=n)
        for qs in itertools.product(GRID, repeat=n)
    ]
    cases.append(((), ()))  # a request without drafts
    drafts, rows, q_tok, counts = [], [], [], []
    for ps, qs in cases:
        counts.append(len(ps))
        drafts += list(range(len(ps)))  # draft j is token j
        rows += [_mtad_row(j, p) for j, p in enumerate(ps)]
        q_tok += list(qs)
    b = len(cases)
    bonus = torch.zeros(b, VOCAB)
    bonus[:, 7] = 1.0
    batch = V.VerifyBatch(
        rule="mtad",
        draft_token_ids=torch.tensor(drafts),
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0),
        target_probs=torch.tensor(rows, dtype=torch.float32),
        bonus_probs=bonus,
        is_greedy=torch.zeros(b, dtype=torch.bool),
        uniforms=torch.rand(len(drafts)),
        exp_noise=torch.ones(b, VOCAB),  # noise 1: the extra token is the argmax of its row
        max_spec_len=3,
        draft_token_probs=torch.tensor(q_tok, dtype=torch.float32),
        acceptance_threshold=tau,
    )
    out = V.verify(batch)
    accepted = V.num_accepted_from_output(out).tolist()
    out_rows = out.tolist()
    compared = skipped = longer_after_fail = 0
    for i, (ps, qs) in enumerate(cases):
        a, fragile = _brute_force_mtad(ps, qs, tau)
        if fragile:
            skipped += 1
            continue
        compared += 1
        assert accepted[i] == a, (ps, qs, tau, out_rows[i])
        if a < len(ps):  # extra token from p_{a+1}: token a or 4 + a, whichever is larger
            extra = a if ps[a] > 1.0 - ps[a] else 4 + a
        else:
            extra = 7
        assert out_rows[i][: a + 1] == list(range(a)) + [extra], (ps, qs, out_rows[i])
        first_fail = next((j for j in range(len(ps)) if _brute_force_mtad(
            ps[: j + 1], qs[: j + 1], tau)[0] != j + 1), len(ps))  # fmt: skip
        longer_after_fail += a > first_fail
    # Skipped: products equal to tau in exact arithmetic by different factors, e.g.
    # (0.2 / 0.6) * (0.6 / 0.2) = 1 at tau = 1, which float32 logs may round either way
    # (about 2% of the grid at tau = 1, none otherwise). p == q exactly is not skipped.
    assert compared > 0.97 * len(cases), (compared, skipped)
    # The grid exercises "a longer prefix passes after a shorter one failed" many times.
    assert longer_after_fail > 100


def test_accepted_lengths_helper_agrees_with_the_output() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from verify_reference import RULE_VARIANTS, random_batch

    for variant in RULE_VARIANTS:
        for seed in range(20):
            batch = random_batch(900 + seed, variant)
            out = V.verify(batch)
            lengths = V.accepted_lengths(batch)
            assert torch.equal(lengths, V.num_accepted_from_output(out))


def _target_logits(context: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A deterministic toy "model": logits from a hash of the context, with ties."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.randn(vocab, generator=g).mul(1.5).round()  # rounding makes ties


def _draft_logits(context: tuple[int, ...], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((hash(context) * 7 + 3) % (2**31))
    return _target_logits(context, vocab) + torch.randn(vocab, generator=g)


@pytest.mark.parametrize("rule", ["standard", "mtad"])
def test_greedy_speculative_decoding_equals_greedy_decoding(rule: str) -> None:
    vocab, k, steps_out, b = 6, 3, 24, 6
    prompts = [(i,) for i in range(b)]
    reference = []
    for prompt in prompts:
        seq = list(prompt)
        while len(seq) < len(prompt) + steps_out:
            seq.append(int(_target_logits(tuple(seq), vocab).argmax()))
        reference.append(seq)

    seqs = [list(p) for p in prompts]
    rounds = 0
    while min(len(s) - 1 for s in seqs) < steps_out:
        rounds += 1
        drafts, rows, q_tok, counts, bonus = [], [], [], [], []
        for r, seq in enumerate(seqs):
            n = (r + rounds) % (k + 1)  # ragged: 0..K drafts, changing every round
            ctx = list(seq)
            for _ in range(n):
                q = _draft_logits(tuple(ctx), vocab).softmax(-1)
                x = int(q.argmax())
                rows.append(_target_logits(tuple(ctx), vocab).softmax(-1))
                drafts.append(x)
                q_tok.append(float(q[x]))
                ctx.append(x)
            counts.append(n)
            bonus.append(_target_logits(tuple(ctx), vocab).softmax(-1))
        t = len(drafts)
        batch = V.VerifyBatch(
            rule=rule,
            draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
            cu_num_draft_tokens=torch.tensor(counts).cumsum(0),
            target_probs=torch.stack(rows) if rows else torch.zeros(0, vocab),
            bonus_probs=torch.stack(bonus),
            is_greedy=torch.ones(b, dtype=torch.bool),
            uniforms=torch.rand(t),
            exp_noise=torch.empty(b, vocab).exponential_(),
            max_spec_len=k,
            draft_token_probs=torch.tensor(q_tok) if rule == "mtad" else None,
            acceptance_threshold=1e-6,  # MTAD would accept almost anything: greedy ignores it
        )
        out = V.verify(batch)
        for seq, row in zip(seqs, out.tolist()):
            seq.extend(tok for tok in row if tok != -1)
    for seq, ref in zip(seqs, reference):
        assert seq[: len(ref)] == ref
    assert rounds < steps_out  # drafts were accepted: fewer rounds than tokens


def test_per_token_decisions() -> None:
    target = torch.tensor([[0.3, 0.3, 0.4, 0.0], [0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    draft = torch.tensor([[0.3, 0.3, 0.0, 0.4], [0.5, 0.5, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]])
    ids = torch.tensor([2, 0, -1])
    u = torch.tensor([0.0, 0.99, 0.0])
    # greedy: the draft is the given greedy token; -1 is never accepted
    assert V.greedy_accept(ids, torch.tensor([2, 0, 3])).tolist() == [True, True, False]
    assert V.greedy_accept(ids, torch.tensor([2, 1, 3])).tolist() == [True, False, False]
    # full q: q(2) = 0 in row 0 -> rejected although p(2) = 0.4; row 1 ratio 1 -> accepted
    assert V.rejection_accept(ids, target, u, draft).tolist() == [False, True, False]
    # one-hot: u < p(x)
    assert V.rejection_accept(ids, target, u).tolist() == [True, False, False]
    terms = V.joint_log_ratio(ids, target, torch.tensor([0.0, 0.5, 0.3]))
    assert terms[0] == -math.inf and terms[1] == 0.0 and terms[2] == -math.inf
    assert not torch.isnan(terms).any()


def test_extra_token_distribution_falls_back_to_p() -> None:
    layout = V.request_layout(torch.tensor([1]), 1, 2)
    target = torch.tensor([[0.0, 0.5, 0.5]])
    batch = V.VerifyBatch(
        "standard", torch.tensor([0]), torch.tensor([1]), target,
        torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([False]), torch.zeros(1),
        torch.ones(1, 3), 2, draft_probs=target,
    )  # fmt: skip
    dist = V.extra_token_distribution(batch, torch.tensor([0]), layout)
    assert dist.tolist() == [[0.0, 0.5, 0.5]]  # residual max(p - p, 0) = 0 -> p


def test_batch_fills_in_defaults_once() -> None:
    """Without logits the greedy token is the first maximum of the probabilities
    (``torch.argmax``'s tie-break), and MTAD's q_j(x_j) is read off the full q."""
    target = torch.tensor([[0.3, 0.3, 0.4, 0.0], [0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.1, 0.2, 0.7, 0.0], [0.6, 0.4, 0.0, 0.0]])
    batch = V.VerifyBatch(
        "mtad", torch.tensor([2, -1]), torch.tensor([2]), target, target[:1],
        torch.tensor([True]), torch.zeros(2), torch.ones(1, 4), 2, draft_probs=q,
    )  # fmt: skip
    assert batch.target_argmax.tolist() == [2, 0]
    assert batch.draft_token_probs.tolist() == pytest.approx([0.7, 0.6])  # -1 reads column 0
    given = dataclasses.replace(batch, target_argmax=torch.tensor([1, 1], dtype=torch.int32))
    assert given.target_argmax.dtype == torch.int64 and given.target_argmax.tolist() == [1, 1]


def test_verify_greedy_equals_verify_on_all_greedy_batches() -> None:
    """The all-greedy shortcut (token ids only: no probabilities, no random draws) gives
    exactly what the full rule and the slow reference give once every request is greedy
    and the bonus distribution is one-hot at vLLM's bonus token (what the sampler glue
    passes), under both rules, on ragged batches with ties, off-support drafts and
    steps without drafts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from verify_reference import RULE_VARIANTS, random_batch, reference_verify

    for variant in RULE_VARIANTS:
        for seed in range(40):
            batch = random_batch(1300 + seed, variant)
            bonus_ids = torch.randint(0, batch.vocab_size, (batch.num_requests,),
                                      generator=torch.Generator().manual_seed(seed))
            one_hot = torch.nn.functional.one_hot(bonus_ids, batch.vocab_size).float()
            greedy = dataclasses.replace(
                batch, is_greedy=torch.ones(batch.num_requests, dtype=torch.bool),
                bonus_probs=one_hot)
            out = V.verify_greedy(greedy.draft_token_ids, greedy.cu_num_draft_tokens,
                                  greedy.target_argmax, bonus_ids.view(-1, 1),
                                  greedy.max_spec_len)
            assert out.dtype == torch.int64
            assert torch.equal(out, V.verify(greedy)), (variant, seed)
            emitted, _ = reference_verify(greedy)
            assert [[t for t in row if t != -1] for row in out.tolist()] == emitted


def test_verify_greedy_uniform_equals_the_ragged_path() -> None:
    """The fixed-K shortcut of verify_greedy (every request has exactly K drafts, known on
    the host) gives what the ragged path gives: random batches with every accepted
    length 0..K present (drafts copied from the target's argmax up to a random point,
    then a different token), K = 1..5."""
    gen = torch.Generator().manual_seed(7)
    for k in range(1, 6):
        for trial in range(20):
            b = 1 + trial % 7
            target = torch.randint(0, 11, (b * k,), generator=gen)
            drafts = target.clone().view(b, k)
            cut = torch.randint(0, k + 1, (b,), generator=gen)
            for r in range(b):
                c = int(cut[r])
                if c < k:
                    drafts[r, c] = (target.view(b, k)[r, c] + 1) % 11
                    drafts[r, c + 1:] = torch.randint(0, 11, (k - c - 1,), generator=gen)
            drafts = drafts.reshape(-1).to(torch.int32)
            bonus = torch.randint(0, 11, (b, 1), generator=gen).to(torch.int32)
            cu = torch.arange(1, b + 1, dtype=torch.int32) * k
            ragged = V.verify_greedy(drafts, cu, target, bonus, k)
            fast = V.verify_greedy(drafts, cu, target, bonus, k, uniform=True)
            assert fast.dtype == torch.int64 and torch.equal(fast, ragged), (k, trial)
            accepted = (ragged != -1).sum(dim=1) - 1
            assert torch.equal(accepted, cut), (k, trial)
