"""Hand-built cases with known answers, run on every backend (cpu, npu, cuda).

Exp(1) noise of all ones makes the extra token the argmax of its distribution, so
each case's output is fixed and written out; where noise matters it is chosen so the
wrong distribution (e.g. not removing the rejected draft) would give another token.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from vllm_specx.algorithms.verify import VerifyBatch


def _batch(
    rule: str,
    drafts: list[list[int]],
    target_rows: list[list[list[float]]],
    bonus: list[list[float]],
    greedy: list[bool] | None = None,
    uniforms: list[list[float]] | None = None,
    noise: list[list[float]] | None = None,
    draft_rows: list[list[list[float]]] | None = None,
    q_tok: list[list[float]] | None = None,
    tau: float = 1.0,
    max_spec_len: int | None = None,
    target_argmax: list[list[int]] | None = None,
) -> VerifyBatch:
    """Build a ``VerifyBatch`` from per-request lists."""
    b = len(drafts)
    v = len(bonus[0])
    counts = [len(d) for d in drafts]
    flat = [x for d in drafts for x in d]
    rows = [r for req in target_rows for r in req]
    q_full = q_flat = argmax = None
    if draft_rows is not None:
        q = [r for req in draft_rows for r in req]
        q_full = torch.tensor(q, dtype=torch.float32).reshape(len(flat), v)
    if q_tok is not None:
        q_flat = torch.tensor([x for req in q_tok for x in req])
    if target_argmax is not None:
        argmax = torch.tensor([x for req in target_argmax for x in req], dtype=torch.int64)
    return VerifyBatch(
        rule=rule,
        draft_token_ids=torch.tensor(flat, dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int64).cumsum(0),
        target_probs=torch.tensor(rows, dtype=torch.float32).reshape(len(flat), v),
        bonus_probs=torch.tensor(bonus, dtype=torch.float32),
        is_greedy=torch.tensor(greedy if greedy is not None else [False] * b),
        uniforms=torch.tensor(
            [u for req in uniforms for u in req] if uniforms else [0.5] * len(flat)
        ),
        exp_noise=torch.tensor(noise, dtype=torch.float32) if noise else torch.ones(b, v),
        max_spec_len=max_spec_len if max_spec_len is not None else max(counts + [0]),
        target_argmax=argmax,
        draft_probs=q_full,
        draft_token_probs=q_flat,
        acceptance_threshold=tau,
    )


def _rows(out: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != -1] for row in out.tolist()]


def _mtad_row(j: int, p: float, v: int = 8) -> list[float]:
    """Target row for position j: mass p on draft token j, the rest on token 4 + j."""
    row = [0.0] * v
    row[j] = p
    row[4 + j] += 1.0 - p
    return row


BONUS8 = [[0.0] * 7 + [1.0]]


def test_mtad_accepts_the_largest_passing_depth(backend_verify) -> None:
    _, verify = backend_verify
    # tau = 0.5, q = 0.5, 0.1, 0.1: S_1 = log 0.4 fails, S_2 = log 3.6 passes,
    # request 0: S_3 = log 32.4 passes -> a = 3, extra from the bonus row (token 7);
    # request 1: p_3 = 0.001 -> S_3 = log 0.036 fails -> a = 2, extra from p_3 (token 6).
    # A first-failure rule would accept nothing in both.
    batch = _batch(
        "mtad",
        drafts=[[0, 1, 2], [0, 1, 2]],
        target_rows=[
            [_mtad_row(0, 0.2), _mtad_row(1, 0.9), _mtad_row(2, 0.9)],
            [_mtad_row(0, 0.2), _mtad_row(1, 0.9), _mtad_row(2, 0.001)],
        ],
        bonus=BONUS8 * 2,
        q_tok=[[0.5, 0.1, 0.1], [0.5, 0.1, 0.1]],
        tau=0.5,
    )
    assert _rows(verify(batch)) == [[0, 1, 2, 7], [0, 1, 6]]


def test_mtad_tau_one_and_zero_accepted(backend_verify) -> None:
    _, verify = backend_verify
    # p == q everywhere: S_i = 0 exactly, and 0 > log(1) = 0 is false -> a = 0; the one
    # token comes from p_1 (token 4), not the bonus. With tau = 0.9 all pass.
    rows = [_mtad_row(0, 0.3), _mtad_row(1, 0.3)]
    for tau, expected in ((1.0, [4]), (0.9, [0, 1, 7])):
        batch = _batch("mtad", [[0, 1]], [rows], BONUS8, q_tok=[[0.3, 0.3]], tau=tau)
        assert _rows(verify(batch)) == [expected], tau


def test_mtad_zero_probabilities_fail_without_nan(backend_verify) -> None:
    _, verify = backend_verify
    # q_1 = 0: term -inf, depth 1 and every deeper depth fail (never +inf / NaN),
    # even though depth 2 alone would pass. p_1 = 0 likewise.
    rows = [_mtad_row(0, 0.9), _mtad_row(1, 0.9)]
    zero_p = [_mtad_row(0, 0.0), _mtad_row(1, 0.9)]
    batch = _batch(
        "mtad",
        [[0, 1], [0, 1]],
        [rows, zero_p],
        BONUS8 * 2,
        q_tok=[[0.0, 0.01], [0.5, 0.01]],
        tau=1e-3,
    )
    assert _rows(verify(batch)) == [[0], [4]]


def test_greedy_ties_take_the_first_maximum(backend_verify) -> None:
    _, verify = backend_verify
    tie = [0.3, 0.3, 0.2, 0.2]
    for rule in ("standard", "mtad"):
        batch = _batch(
            rule,
            drafts=[[1], [0, 1], []],
            target_rows=[[tie], [tie, tie], []],
            bonus=[[0.1, 0.4, 0.4, 0.1]] * 3,
            greedy=[True, True, True],
            q_tok=[[0.9], [0.9, 0.9], []] if rule == "mtad" else None,
            tau=1e-3,
        )
        # argmax of a tie is token 0: draft 1 is rejected (emit 0), draft 0 accepted;
        # the bonus tie 1 vs 2 also resolves to the first (1). MTAD's joint rule
        # would have accepted everything: greedy requests ignore it.
        assert _rows(verify(batch)) == [[0], [0, 0], [1]], rule


def _near_tie_logits() -> torch.Tensor:
    """Logits whose top two differ by one float32 ulp (7.5e-9 at 0.1): vLLM's argmax
    of the logits is token 1, but softmax rounds both to the same float32 probability,
    whose first maximum is token 0."""
    low = torch.tensor(0.1, dtype=torch.float32)
    high = torch.nextafter(low, torch.tensor(1.0))
    return torch.stack([low, high, torch.tensor(-1.0), torch.tensor(-2.0)])


def test_greedy_token_is_vllms_argmax_of_the_logits_not_of_the_probs(backend_verify) -> None:
    _, verify = backend_verify
    logits = _near_tie_logits()
    probs = logits.softmax(-1)
    assert probs[0] == probs[1] and int(probs.argmax()) == 0 and int(logits.argmax()) == 1
    row = probs.tolist()
    for rule in ("standard", "mtad"):
        batch = _batch(
            rule,
            drafts=[[1], [0], [1, 1]],
            target_rows=[[row], [row], [row, row]],
            bonus=[[0.0, 0.0, 1.0, 0.0]] * 3,
            greedy=[True, True, True],
            q_tok=[[0.9], [0.9], [0.9, 0.9]] if rule == "mtad" else None,
            # What the sampler glue passes: argmax of the very logits vLLM's greedy
            # path takes its argmax of.
            target_argmax=[[1], [1], [1, 1]],
        )
        # Draft 1 is vLLM's greedy token: accepted, then the bonus token 2. Draft 0 is
        # not: rejected, and the token emitted is vLLM's 1. The argmax of the
        # probabilities would give [[0], [0, 2], [0]].
        assert _rows(verify(batch)) == [[1, 2], [1], [1, 1, 2]], rule


def test_zero_drafts_emit_from_the_bonus_distribution(backend_verify) -> None:
    _, verify = backend_verify
    bonus = [[0.1, 0.2, 0.7], [0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]
    noise = [[1.0, 1.0, 1.0], [0.01, 1.0, 1.0], [1.0, 1.0, 1.0]]
    for rule, kw in (("standard", {}), ("mtad", {"q_tok": [[], [], []]})):
        batch = _batch(
            rule, [[], [], []], [[], [], []], bonus, greedy=[False, False, True], noise=noise, **kw
        )
        # argmax(bonus / noise): 2, then 0 (0.1 / 0.01 = 10 wins); greedy: argmax 0.
        assert _rows(verify(batch)) == [[2], [0], [0]], rule


def test_no_drafts_and_no_speculative_columns(backend_verify) -> None:
    _, verify = backend_verify
    # K = 0: output [B, 1]; drafts beyond max_spec_len are never emitted.
    batch = _batch(
        "standard", [[], [2]], [[], [[0.0, 0.0, 1.0]]], [[0, 1.0, 0]] * 2, max_spec_len=0
    )
    out = verify(batch)
    assert out.shape == (2, 1) and out.tolist() == [[1], [1]]


def test_standard_rejections_and_residuals(backend_verify) -> None:
    _, verify = backend_verify
    p = [0.5, 0.5, 0.0, 0.0]
    noise_for_0 = [0.01, 1.0, 1.0, 1.0]  # makes token 0 win unless it has no mass
    batch = _batch(
        "standard",
        drafts=[[0], [1], [2], [3]],
        target_rows=[[p], [p], [p], [[0.0, 0.5, 0.5, 0.0]]],
        bonus=[[0.0, 0.0, 0.0, 1.0]] * 4,
        # 0: u = 0.9 > p/q = 0.5/0.9 -> reject; residual max(p - q, 0) = [0, .4, 0, 0] -> 1.
        # 1: p/q = 0.5/0.1 > 1 -> accept, then the bonus token 3.
        # 2: p(x) = 0 -> reject even with u = 0 (vLLM's `p/q >= u` would accept);
        #    residual [0.5, 0.4, 0, 0], token 0 wins the race.
        # 3: p == q and q(x) = 0 -> rejected (the draft could not propose x); the
        #    residual is all zero, so the fallback p = [0, .5, .5, 0] is used: token 2
        #    (not token 0, which argmax of a zero vector would give).
        uniforms=[[0.9], [0.99], [0.0], [0.0]],
        noise=[noise_for_0, noise_for_0, noise_for_0, [1.0, 2.0, 1.0, 1.0]],
        draft_rows=[
            [[0.9, 0.1, 0.0, 0.0]],
            [[0.9, 0.1, 0.0, 0.0]],
            [[0.0, 0.1, 0.9, 0.0]],
            [[0.0, 0.5, 0.5, 0.0]],
        ],
    )
    assert _rows(verify(batch)) == [[1], [1, 3], [0], [2]]


def test_one_hot_drafter(backend_verify) -> None:
    _, verify = backend_verify
    batch = _batch(
        "standard",
        drafts=[[0], [0], [1], [-1]],
        target_rows=[
            [[0.6, 0.4, 0.0]],
            [[1.0, 0.0, 0.0]],
            [[0.0, 0.0, 1.0]],
            [[0.2, 0.3, 0.5]],
        ],
        bonus=[[0.0, 1.0, 0.0]] * 4,
        # 0: u = 0.9 >= p(x) = 0.6 -> reject; the replacement is p without x = token 1,
        #    although the noise favours token 0 a hundredfold.
        # 1: p(x) = 1 -> accepted for any u < 1; bonus token 1.
        # 2: p(x) = 0 -> rejected even at u = 0; p without x is [0, 0, 1] -> 2.
        # 3: vLLM's -1 padding id is rejected; nothing to remove, token from p: 0 by noise.
        uniforms=[[0.9], [0.999999], [0.0], [0.0]],
        noise=[[0.01, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.01, 1.0, 1.0]],
    )
    assert _rows(verify(batch)) == [[1], [0, 1], [2], [0]]


def test_vllm_dtypes_give_the_same_answer(backend_verify) -> None:
    """int32 ids and offsets, float64 uniforms and noise (what vLLM hands over)."""
    _, verify = backend_verify
    batch = _batch(
        "standard",
        drafts=[[0, 1], [2]],
        target_rows=[[[0.6, 0.4, 0.0], [0.3, 0.3, 0.4]], [[0.2, 0.3, 0.5]]],
        bonus=[[0.2, 0.3, 0.5]] * 2,
        uniforms=[[0.5, 0.95], [0.1]],
        noise=[[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]],
    )
    expected = verify(batch)
    converted = dataclasses.replace(
        batch,
        draft_token_ids=batch.draft_token_ids.to(torch.int32),
        cu_num_draft_tokens=batch.cu_num_draft_tokens.to(torch.int32),
        uniforms=batch.uniforms.to(torch.float64),
        exp_noise=batch.exp_noise.to(torch.float64),
    )
    assert torch.equal(verify(converted), expected)
    # 0: accept 0 (u .5 < .6), reject 1 (u .95 >= .3); p without 1 -> [.3, 0, .4] -> 2.
    assert _rows(expected) == [[0, 2], [2, 2]]


def test_float64_uniform_just_below_one_still_accepts_ratio_one(backend_verify) -> None:
    """u = 0.99999999 (float64) rounds to 1.0 in float32; p(x) == q(x) must still accept."""
    _, verify = backend_verify
    batch = _batch(
        "standard",
        drafts=[[0], [0]],
        target_rows=[[[0.5, 0.5, 0.0]], [[1.0, 0.0, 0.0]]],
        bonus=[[0.0, 0.0, 1.0]] * 2,
    )
    one_hot = dataclasses.replace(
        batch, uniforms=torch.tensor([0.99999999, 0.99999999], dtype=torch.float64)
    )
    same_q = dataclasses.replace(one_hot, draft_probs=batch.target_probs.clone())  # q == p
    assert _rows(verify(same_q)) == [[0, 2], [0, 2]]
    assert _rows(verify(one_hot))[1] == [0, 2]  # one-hot: p(x) = 1 is always accepted


def test_empty_batch(backend_verify) -> None:
    _, verify = backend_verify
    z = torch.zeros(0, 5)
    e = torch.zeros(0, dtype=torch.int64)
    batch = VerifyBatch("standard", e, e, z, z, torch.zeros(0, dtype=torch.bool), e.float(), z, 3)
    out = verify(batch)
    assert out.shape == (0, 4) and out.dtype == torch.int64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rule": "typical"}, "standard, mtad"),
        ({"acceptance_threshold": 0.0}, "(0, 1]"),
        ({"acceptance_threshold": 1.5}, "(0, 1]"),
        ({"draft_token_probs": None}, "draft_token_probs"),
        ({"exp_noise": torch.ones(1, 4)}, "exp_noise must be [B=1, V=3], got (1, 4)"),
        ({"target_argmax": torch.zeros(2, dtype=torch.int64)}, "target_argmax must be [T=1]"),
        ({"max_spec_len": -1}, "max_spec_len must be >= 0"),
    ],
)
def test_bad_batches_are_refused_on_construction(change: dict, message: str) -> None:
    """The batch is validated once, where it is built, for every backend alike."""
    batch = _batch("mtad", [[0]], [[[0.5, 0.5, 0.0]]], [[0.5, 0.5, 0.0]], q_tok=[[0.5]])
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(batch, **change)


def test_mtad_reads_q_from_full_draft_probs(backend_verify) -> None:
    _, verify = backend_verify
    # Without draft_token_probs, q_j(x_j) is gathered from draft_probs.
    q = [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    batch = _batch("mtad", [[0]], [[_mtad_row(0, 0.2)]], BONUS8, draft_rows=[q], tau=0.5)
    assert math.log(0.2 / 0.5) < math.log(0.5)
    assert _rows(verify(batch)) == [[4]]
