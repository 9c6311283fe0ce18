"""MTP verification (one-hot q) on the algorithm: ours is exact, the Ascend guide's is not.

An MTP layer drafts its argmax, so ``q`` is one-hot at the draft ``x``. Standard
verification then accepts ``x`` with probability ``p(x)`` and, at a rejection, must sample
from ``p`` with ``x`` removed (renormalised): the emitted token is then distributed as
``p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) = p(y)``. vLLM-Ascend's MTP developer guide
writes the residual as ``max(P_target - 1, 0)``, which is the all-zero vector:
whatever a sampler makes of it (the exponential race picks index 0; a sampler that falls
back to ``p`` on an empty residual emits ``x`` too often), the output is not ``p``.

The samples come from :func:`vllm_specx.algorithms.verify.verify` itself (N one-draft
requests in one batch); the Ascend variants reuse its acceptance step and only change
the residual, so the residual is the only difference under test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vllm_specx.algorithms import verify as V

VOCAB = 6
N = 20_000
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
DRAFT = 1  # the MTP argmax need not be p's argmax; any draft works


def _batch(seed: int) -> V.VerifyBatch:
    g = torch.Generator().manual_seed(seed)
    return V.VerifyBatch(
        rule="standard",
        draft_token_ids=torch.full((N,), DRAFT, dtype=torch.int64),
        cu_num_draft_tokens=torch.arange(1, N + 1),
        target_probs=P.expand(N, VOCAB).contiguous(),
        bonus_probs=P.expand(N, VOCAB).contiguous(),
        is_greedy=torch.zeros(N, dtype=torch.bool),
        uniforms=torch.rand(N, generator=g, dtype=torch.float64),
        exp_noise=torch.empty(N, VOCAB).exponential_(generator=g),
        max_spec_len=1,
        draft_probs=None,  # one-hot q: the MTP drafter
    )


def _first_tokens(out: torch.Tensor) -> torch.Tensor:
    return out[:, 0]


def _ascend_verify(batch: V.VerifyBatch, fall_back_to_p: bool) -> torch.Tensor:
    """Our acceptance step, the guide's residual ``max(p - 1, 0)`` at a rejection."""
    layout = V.request_layout(batch.cu_num_draft_tokens, batch.num_tokens, batch.max_spec_len)
    accepted = V.accepted_lengths(batch, layout)
    residual = (batch.target_probs - 1.0).clamp(min=0)  # all zero
    if fall_back_to_p:
        residual = torch.where(residual.amax(-1, keepdim=True) > 0, residual, batch.target_probs)
    dist = torch.where((accepted >= 1)[:, None], batch.bonus_probs, residual)
    extra = V.sample_extra_token(dist, batch.exp_noise, batch.is_greedy,
                                 torch.zeros_like(accepted))
    return V.assemble_output(batch.draft_token_ids, accepted, extra, layout)


def _p_value(tokens: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    _, p_value = chisquare(observed.numpy(), (P.double() * len(tokens)).numpy())
    return float(p_value)


def test_specx_one_hot_residual_reproduces_the_target():
    out = V.verify(_batch(0))
    tokens = _first_tokens(out)
    accepted = (tokens == DRAFT) & (out[:, 1] != V.PLACEHOLDER_TOKEN_ID)
    # Both branches happened: accepted drafts and replacements from the residual.
    assert 0 < int(accepted.sum()) < N
    replacements = tokens[out[:, 1] == V.PLACEHOLDER_TOKEN_ID]
    assert not bool((replacements == DRAFT).any())  # the draft is removed from the residual
    assert _p_value(tokens) > 1e-3


@pytest.mark.parametrize("fall_back_to_p", [False, True])
def test_ascend_guide_residual_fails_the_same_check(fall_back_to_p):
    batch = _batch(0)
    tokens = _first_tokens(_ascend_verify(batch, fall_back_to_p))
    assert _p_value(tokens) < 1e-6
    # Exactly how it is wrong: every rejection emits token 0 (the race over zeros), or the
    # draft is emitted with probability p(x) + (1 - p(x)) p(x) instead of p(x).
    freq = torch.bincount(tokens, minlength=VOCAB).double() / N
    if fall_back_to_p:
        want = float(P[DRAFT] + (1 - P[DRAFT]) * P[DRAFT])
        assert abs(float(freq[DRAFT]) - want) < 0.02
    else:
        assert float(freq[0] + freq[DRAFT]) == pytest.approx(1.0)
