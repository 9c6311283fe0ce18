"""Shared by the statistics tests (test_verify_statistics.py, test_draft_tree_statistics.py):
random target / draft tables and a Pearson chi-square of emitted tokens against the
distributions they should follow."""

from __future__ import annotations

import torch
from scipy import stats


def random_table(g: torch.Generator, rows: int, vocab: int, zeros: int = 2,
                 scale: float = 1.0) -> torch.Tensor:
    """[rows, vocab] distributions, each with ``zeros`` exact zeros and no tiny entries."""
    logits = scale * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    drop = torch.rand(rows, vocab, generator=g).argsort(dim=1)[:, :zeros]
    support = torch.ones(rows, vocab, dtype=torch.bool).scatter(1, drop, False)
    probs = logits.masked_fill(~support, -torch.inf).softmax(-1)
    probs = 0.8 * probs + 0.2 * support / support.sum(1, keepdim=True)
    return probs.float()


def chi_square(tokens: torch.Tensor, dists: torch.Tensor, groups: torch.Tensor):
    """Pearson chi-square of ``tokens`` against per-request ``dists`` ([n, V]), pooled per
    group; cells expecting fewer than 5 are pooled per group.

    Returns (statistic, degrees of freedom, p-value). Asserts that no token with zero
    expected probability ever occurs (that would be a plain bug, not a statistic).
    """
    vocab = dists.shape[1]
    groups = torch.unique(groups, return_inverse=True)[1]
    n_groups = int(groups.max()) + 1
    observed = torch.zeros(n_groups, vocab, dtype=torch.float64)
    observed.index_put_((groups, tokens), torch.ones(len(tokens), dtype=torch.float64), True)
    dists = dists.double() / dists.double().sum(1, keepdim=True)
    expected = torch.zeros(n_groups, vocab, dtype=torch.float64).index_add_(0, groups, dists)
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "a token with probability 0 was emitted"
    small = (expected < 5) & ~impossible
    big = ~small & ~impossible
    stat = float(((observed - expected) ** 2 / expected)[big].sum())
    cells = int(big.sum())
    pooled_obs, pooled_exp = (observed * small).sum(1), (expected * small).sum(1)
    has_pool = pooled_exp > 0
    stat += float(((pooled_obs - pooled_exp) ** 2 / pooled_exp)[has_pool].sum())
    cells += int(has_pool.sum())
    dof = cells - n_groups
    assert dof > 0
    return stat, dof, float(stats.chi2.sf(stat, dof))
