"""Hand-built cases with known answers, run on every backend (cpu, npu, cuda).

Exp(1) noise of all ones makes the extra token the argmax of its distribution, so
each case's output is fixed and written out; where noise matters it is chosen so the
wrong distribution (e.g. not removing the rejected draft) would give another token.
"""

from __future__ import annotations

import math

import pytest
import torch


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
) -> tuple[tuple, dict]:
    """Build ``verify`` arguments from per-request lists."""
    b = len(drafts)
    v = len(bonus[0])
    counts = [len(d) for d in drafts]
    flat = [x for d in drafts for x in d]
    rows = [r for req in target_rows for r in req]
    args = (
        rule,
        torch.tensor(flat, dtype=torch.int64),
        torch.tensor(counts, dtype=torch.int64).cumsum(0),
        torch.tensor(rows, dtype=torch.float32).reshape(len(flat), v),
        torch.tensor(bonus, dtype=torch.float32),
        torch.tensor(greedy if greedy is not None else [False] * b),
        torch.tensor([u for req in uniforms for u in req] if uniforms else [0.5] * len(flat)),
        torch.tensor(noise, dtype=torch.float32) if noise else torch.ones(b, v),
        max_spec_len if max_spec_len is not None else max(counts + [0]),
    )
    kwargs: dict = {"acceptance_threshold": tau}
    if draft_rows is not None:
        q = [r for req in draft_rows for r in req]
        kwargs["draft_probs"] = torch.tensor(q, dtype=torch.float32).reshape(len(flat), v)
    if q_tok is not None:
        kwargs["draft_token_probs"] = torch.tensor([x for req in q_tok for x in req])
    return args, kwargs


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
    args, kwargs = _batch(
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
    assert _rows(verify(*args, **kwargs)) == [[0, 1, 2, 7], [0, 1, 6]]


def test_mtad_tau_one_and_zero_accepted(backend_verify) -> None:
    _, verify = backend_verify
    # p == q everywhere: S_i = 0 exactly, and 0 > log(1) = 0 is false -> a = 0; the one
    # token comes from p_1 (token 4), not the bonus. With tau = 0.9 all pass.
    rows = [_mtad_row(0, 0.3), _mtad_row(1, 0.3)]
    for tau, expected in ((1.0, [4]), (0.9, [0, 1, 7])):
        args, kwargs = _batch("mtad", [[0, 1]], [rows], BONUS8, q_tok=[[0.3, 0.3]], tau=tau)
        assert _rows(verify(*args, **kwargs)) == [expected], tau


def test_mtad_zero_probabilities_fail_without_nan(backend_verify) -> None:
    _, verify = backend_verify
    # q_1 = 0: term -inf, depth 1 and every deeper depth fail (never +inf / NaN),
    # even though depth 2 alone would pass. p_1 = 0 likewise.
    rows = [_mtad_row(0, 0.9), _mtad_row(1, 0.9)]
    zero_p = [_mtad_row(0, 0.0), _mtad_row(1, 0.9)]
    args, kwargs = _batch(
        "mtad",
        [[0, 1], [0, 1]],
        [rows, zero_p],
        BONUS8 * 2,
        q_tok=[[0.0, 0.01], [0.5, 0.01]],
        tau=1e-3,
    )
    assert _rows(verify(*args, **kwargs)) == [[0], [4]]


def test_greedy_ties_take_the_first_maximum(backend_verify) -> None:
    _, verify = backend_verify
    tie = [0.3, 0.3, 0.2, 0.2]
    for rule in ("standard", "mtad"):
        args, kwargs = _batch(
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
        assert _rows(verify(*args, **kwargs)) == [[0], [0, 0], [1]], rule


def test_zero_drafts_emit_from_the_bonus_distribution(backend_verify) -> None:
    _, verify = backend_verify
    bonus = [[0.1, 0.2, 0.7], [0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]
    noise = [[1.0, 1.0, 1.0], [0.01, 1.0, 1.0], [1.0, 1.0, 1.0]]
    for rule, kw in (("standard", {}), ("mtad", {"q_tok": [[], [], []]})):
        args, kwargs = _batch(
            rule, [[], [], []], [[], [], []], bonus, greedy=[False, False, True], noise=noise, **kw
        )
        # argmax(bonus / noise): 2, then 0 (0.1 / 0.01 = 10 wins); greedy: argmax 0.
        assert _rows(verify(*args, **kwargs)) == [[2], [0], [0]], rule


def test_no_drafts_and_no_speculative_columns(backend_verify) -> None:
    _, verify = backend_verify
    # K = 0: output [B, 1]; drafts beyond max_spec_len are never emitted.
    args, kwargs = _batch("standard", [[], [2]], [[], [[0.0, 0.0, 1.0]]], [[0, 1.0, 0]] * 2)
    args = args[:-1] + (0,)
    out = verify(*args, **kwargs)
    assert out.shape == (2, 1) and out.tolist() == [[1], [1]]


def test_standard_rejections_and_residuals(backend_verify) -> None:
    _, verify = backend_verify
    p = [0.5, 0.5, 0.0, 0.0]
    noise_for_0 = [0.01, 1.0, 1.0, 1.0]  # makes token 0 win unless it has no mass
    args, kwargs = _batch(
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
    assert _rows(verify(*args, **kwargs)) == [[1], [1, 3], [0], [2]]


def test_one_hot_drafter(backend_verify) -> None:
    _, verify = backend_verify
    args, kwargs = _batch(
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
    assert _rows(verify(*args, **kwargs)) == [[1], [0, 1], [2], [0]]


def test_vllm_dtypes_give_the_same_answer(backend_verify) -> None:
    """int32 ids and offsets, float64 uniforms and noise (what vLLM hands over)."""
    _, verify = backend_verify
    args, kwargs = _batch(
        "standard",
        drafts=[[0, 1], [2]],
        target_rows=[[[0.6, 0.4, 0.0], [0.3, 0.3, 0.4]], [[0.2, 0.3, 0.5]]],
        bonus=[[0.2, 0.3, 0.5]] * 2,
        uniforms=[[0.5, 0.95], [0.1]],
        noise=[[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]],
    )
    expected = verify(*args, **kwargs)
    converted = list(args)
    converted[1] = args[1].to(torch.int32)
    converted[2] = args[2].to(torch.int32)
    converted[6] = args[6].to(torch.float64)
    converted[7] = args[7].to(torch.float64)
    assert torch.equal(verify(*converted, **kwargs), expected)
    # 0: accept 0 (u .5 < .6), reject 1 (u .95 >= .3); p without 1 -> [.3, 0, .4] -> 2.
    assert _rows(expected) == [[0, 2], [2, 2]]


def test_float64_uniform_just_below_one_still_accepts_ratio_one(backend_verify) -> None:
    """u = 0.99999999 (float64) rounds to 1.0 in float32; p(x) == q(x) must still accept."""
    _, verify = backend_verify
    args, kwargs = _batch(
        "standard",
        drafts=[[0], [0]],
        target_rows=[[[0.5, 0.5, 0.0]], [[1.0, 0.0, 0.0]]],
        bonus=[[0.0, 0.0, 1.0]] * 2,
    )
    args = list(args)
    args[6] = torch.tensor([0.99999999, 0.99999999], dtype=torch.float64)
    kwargs["draft_probs"] = args[3].clone()  # q == p in both rows
    assert _rows(verify(*args, **kwargs)) == [[0, 2], [0, 2]]
    del kwargs["draft_probs"]  # one-hot: p(x) = 1 is always accepted
    assert _rows(verify(*args, **kwargs))[1] == [0, 2]


def test_empty_batch(backend_verify) -> None:
    _, verify = backend_verify
    z = torch.zeros(0, 5)
    e = torch.zeros(0, dtype=torch.int64)
    out = verify("standard", e, e, z, z, torch.zeros(0, dtype=torch.bool), torch.zeros(0), z, 3)
    assert out.shape == (0, 4) and out.dtype == torch.int64


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rule": "typical"}, "standard, mtad"),
        ({"acceptance_threshold": 0.0}, "(0, 1]"),
        ({"acceptance_threshold": 1.5}, "(0, 1]"),
        ({"draft_token_probs": None}, "draft_token_probs"),
        ({"exp_noise": torch.ones(1, 4)}, "exp_noise"),
    ],
)
def test_bad_arguments_raise(backend_verify, change: dict, message: str) -> None:
    _, verify = backend_verify
    args, kwargs = _batch("mtad", [[0]], [[[0.5, 0.5, 0.0]]], [[0.5, 0.5, 0.0]], q_tok=[[0.5]])
    names = ["rule", "draft_token_ids", "cu", "target", "bonus", "greedy", "u", "exp_noise", "k"]
    named = dict(zip(names, args))
    for key, value in change.items():
        if key in named:
            named[key] = value
        else:
            kwargs[key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        verify(*named.values(), **kwargs)


def test_mtad_reads_q_from_full_draft_probs(backend_verify) -> None:
    _, verify = backend_verify
    # Without draft_token_probs, q_j(x_j) is gathered from draft_probs.
    q = [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    args, kwargs = _batch("mtad", [[0]], [[_mtad_row(0, 0.2)]], BONUS8, draft_rows=[q], tau=0.5)
    assert math.log(0.2 / 0.5) < math.log(0.5)
    assert _rows(verify(*args, **kwargs)) == [[4]]
