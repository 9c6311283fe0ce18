"""Statistical proofs: the standard rule is lossless, MTAD's extra token is p_{a+1}.

Setting: V = 8, K = 3, 200,000 requests verified in ONE vectorised ``verify`` call.
Target and draft are Markov "models" (position tables ``P_j[prev]``, ``Q_j[prev]``
that depend on the previous token), warped-looking: every row has exact zeros, with
different supports for target and draft, so drafts with p(x) = 0 or a residual that
excludes tokens both happen. Drafts are sampled from Q.

Why per-position chi-square tests are the right check: once x_1..x_j are accepted,
position j + 1 is a fresh verification step with ``P_{j+1}[x_j]``, ``Q_{j+1}[x_j]``
and fresh randomness, so the token emitted in output column j, among the requests
that reach column j and grouped by the token before it, must follow ``P_{j+1}[prev]``
exactly (losslessness, also the bonus column). The recovered token at a rejection
must follow ``norm(max(p - q, 0))`` (full q) or ``p`` without x (one-hot drafter).

Significance: every test asserts a Pearson chi-square p-value > 1e-4 with a fixed
seed (deterministic, not flaky). Cells expected below 5 are pooled per group. Where
requests in one group have different distributions (one-hot recovered tokens), the
expected count is the sum of their probabilities, which keeps the test conservative.
A control test shows the same machinery rejects a wrong distribution.
"""

from __future__ import annotations

import pytest
import torch
from chi_square_helpers import chi_square, random_table

from vllm_specx.algorithms.verify import VerifyBatch, verify

V, K, N = 8, 3, 200_000
SIGNIFICANCE = 1e-4


# Many small torch ops: one intra-op thread is faster on a small shared machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _table(g: torch.Generator, rows: int, zeros: int = 2, scale: float = 1.0) -> torch.Tensor:
    return random_table(g, rows, V, zeros, scale)


class Draws:
    """One 200k-request verification of the Markov setting, and what it emitted."""

    def __init__(self, rule: str, one_hot: bool, seed: int = 20240601, tau: float = 0.3):
        g = torch.Generator().manual_seed(seed)
        scale = 2.0 if one_hot else 1.0  # a peakier target, so one-hot drafts get accepted
        self.p = [_table(g, 1, scale=scale)] + [_table(g, V, scale=scale) for _ in range(K)]
        self.q = [_table(g, 1)] + [_table(g, V) for _ in range(K - 1)]  # Q_1, Q_2..Q_3
        x = []
        for j in range(K):
            q_rows = self.q[j].expand(N, V) if j == 0 else self.q[j][x[-1]]
            draft = torch.multinomial(q_rows, 1, generator=g).squeeze(1)
            if one_hot:
                # A one-hot drafter proposes one token; the rule is lossless for ANY
                # proposal independent of u and the noise (accept x w.p. p(x), else
                # draw p without x: P(y) = P(x=y) p(y) + sum_{x!=y} P(x) p(y) = p(y)).
                # Mostly the target's argmax (a good greedy drafter), sometimes not.
                best = self.p_row(j, torch.stack(x, 1) if x else draft[:, None]).argmax(1)
                draft = torch.where(torch.rand(N, generator=g) < 0.7, best, draft)
            x.append(draft)
        self.x = torch.stack(x, 1)  # [N, K]
        target = torch.stack([self.p_row(j, self.x) for j in range(K)], 1).reshape(N * K, V)
        draft = torch.stack(
            [self.q[0].expand(N, V)] + [self.q[j][self.x[:, j - 1]] for j in range(1, K)], 1
        ).reshape(N * K, V)
        bonus = self.p_row(K, self.x)
        draft_token_probs = draft.gather(1, self.x.reshape(-1, 1)).squeeze(1)
        batch = VerifyBatch(
            rule=rule,
            draft_token_ids=self.x.reshape(-1),
            cu_num_draft_tokens=torch.arange(1, N + 1) * K,
            target_probs=target,
            bonus_probs=bonus,
            is_greedy=torch.zeros(N, dtype=torch.bool),
            uniforms=torch.rand(N * K, generator=g),
            exp_noise=torch.empty(N, V).exponential_(generator=g),
            max_spec_len=K,
            draft_probs=None if (one_hot or rule == "mtad") else draft,
            draft_token_probs=draft_token_probs if rule == "mtad" else None,
            acceptance_threshold=tau,
        )
        self.out = verify(batch)
        self.accepted = (self.out != -1).sum(1) - 1
        self.draft_rows = draft.reshape(N, K, V)

    def p_row(self, j: int, prefix: torch.Tensor) -> torch.Tensor:
        """The target distribution at 0-based position j given the emitted prefix."""
        n = prefix.shape[0]
        return self.p[0].expand(n, V) if j == 0 else self.p[j][prefix[:, j - 1]]

    def prev(self, j: int) -> torch.Tensor:
        return torch.zeros(N, dtype=torch.int64) if j == 0 else self.out[:, j - 1].clamp(min=0)


@pytest.fixture(scope="module")
def full_q() -> Draws:
    return Draws("standard", one_hot=False)


@pytest.fixture(scope="module")
def one_hot() -> Draws:
    return Draws("standard", one_hot=True, seed=7)


@pytest.fixture(scope="module")
def mtad() -> Draws:
    return Draws("mtad", one_hot=False, seed=11)


def _target_per_position(draws: Draws) -> list[tuple[int, int, float, float]]:
    results = []
    for j in range(K + 1):
        reached = draws.out[:, j] != -1
        prefix = draws.out[reached].clamp(min=0)
        stat, dof, p = chi_square(
            draws.out[reached, j], draws.p_row(j, prefix), draws.prev(j)[reached]
        )
        results.append((j, int(reached.sum()), stat, p))
        print(f"column {j}: n={int(reached.sum())} chi2={stat:.1f} dof={dof} p={p:.3g}")
    return results


@pytest.mark.parametrize("fixture", ["full_q", "one_hot"])
def test_standard_rule_reproduces_the_target_at_every_position(request, fixture: str) -> None:
    draws: Draws = request.getfixturevalue(fixture)
    results = _target_per_position(draws)
    assert all(n > 5_000 for _, n, _, _ in results), results  # every column well sampled
    assert all(p > SIGNIFICANCE for *_, p in results), results
    # Both acceptances and rejections happen at every position.
    for j in range(K):
        reached = draws.accepted >= j
        assert 0.05 < (draws.accepted[reached] > j).float().mean() < 0.95


def test_recovered_tokens_follow_the_residual(full_q: Draws) -> None:
    rejected = full_q.accepted < K
    j = full_q.accepted[rejected]
    idx = rejected.nonzero().squeeze(1)
    p = torch.zeros(len(idx), V)
    for pos in range(K):
        at = j == pos
        p[at] = full_q.p_row(pos, full_q.x[idx[at]])
    q = full_q.draft_rows[idx, j]
    residual = (p - q).clamp(min=0)
    tokens = full_q.out[idx, j]
    assert not (tokens == full_q.x[idx, j]).any()  # a rejected draft is never re-emitted
    groups = j * V + torch.where(j > 0, full_q.x[idx, (j - 1).clamp(min=0)], 0)
    stat, dof, pval = chi_square(tokens, residual, groups)
    print(f"full-q recovered: n={len(idx)} chi2={stat:.1f} dof={dof} p={pval:.3g}")
    assert len(idx) > 50_000 and pval > SIGNIFICANCE


def test_one_hot_replacement_is_p_without_the_draft(one_hot: Draws) -> None:
    rejected = one_hot.accepted < K
    idx = rejected.nonzero().squeeze(1)
    j = one_hot.accepted[idx]
    x_j = one_hot.x[idx, j]
    p = torch.zeros(len(idx), V)
    for pos in range(K):
        at = j == pos
        p[at] = one_hot.p_row(pos, one_hot.x[idx[at]])
    without = p.scatter(1, x_j[:, None], 0.0)
    tokens = one_hot.out[idx, j]
    assert not (tokens == x_j).any()
    # Group by (position, previous token, rejected draft): one distribution per group.
    groups = (j * V + torch.where(j > 0, one_hot.x[idx, (j - 1).clamp(min=0)], 0)) * V + x_j
    stat, dof, pval = chi_square(tokens, without, groups)
    print(f"one-hot replacement: n={len(idx)} chi2={stat:.1f} dof={dof} p={pval:.3g}")
    assert len(idx) > 50_000 and pval > SIGNIFICANCE


def test_mtad_extra_token_follows_p_after_the_accepted_prefix(mtad: Draws) -> None:
    a = mtad.accepted
    assert set(a.unique().tolist()) == set(range(K + 1))  # every accepted length occurs
    dist = torch.zeros(N, V)
    for depth in range(K + 1):
        at = a == depth
        dist[at] = mtad.p_row(depth, mtad.x[at])
    tokens = mtad.out.gather(1, a[:, None]).squeeze(1)
    prev = torch.where(a > 0, mtad.x.gather(1, (a - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    stat, dof, pval = chi_square(tokens, dist, a * V + prev)
    print(f"mtad extra token: chi2={stat:.1f} dof={dof} p={pval:.3g}")
    assert pval > SIGNIFICANCE


def test_chi_square_rejects_a_wrong_distribution(full_q: Draws) -> None:
    """Control: the same data tested against q instead of p fails decisively."""
    first = full_q.out[:, 0]
    _, _, pval = chi_square(
        first, full_q.q[0].expand(N, V) + 1e-3, torch.zeros(N, dtype=torch.int64)
    )
    assert pval < 1e-30
