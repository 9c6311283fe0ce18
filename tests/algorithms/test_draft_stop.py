"""Stop rules of ``vllm_specx.algorithms.draft_stop`` against a slow per-row reference.

The reference walks one request at a time through a whole drafting round with plain Python
floats: it keeps drafting while the rule (clamped to [min, max]) says so and records the
length the round stops at. The batched rules are driven the way the drafter drives them: all
live rows at one depth, stopped rows leave the batch, the state sliced by the live mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_specx.algorithms.acceptance_head import AcceptanceHead
from vllm_specx.algorithms.draft_stop import (
    AlwaysContinue,
    ConfidenceStop,
    DraftStopRule,
    HeadStop,
    make_stop_rule,
)

# Many small torch ops: one intra-op thread is faster on a small shared machine.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_round(rows: int, k_max: int, vocab: int, hidden: int, seed: int):
    """Per-row, per-depth inputs for depths 0..k_max: probs [R, K+1, V], token probs, hidden."""
    g = torch.Generator().manual_seed(seed)
    # Peaked and flat distributions mixed, so every signal crosses typical thresholds.
    logits = torch.randn(rows, k_max + 1, vocab, generator=g) * (
        torch.rand(rows, k_max + 1, 1, generator=g) * 6
    )
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=g).view(rows, k_max + 1)
    token_probs = probs.gather(-1, tokens[..., None])[..., 0]
    hiddens = torch.randn(rows, k_max + 1, hidden, generator=g) * 2
    return probs, token_probs, hiddens


def _drive(rule: DraftStopRule, probs, token_probs, hiddens) -> list[int]:
    """Draft lengths from the batched rule, driven like the drafter (the batch shrinks)."""
    rows = probs.shape[0]
    live = torch.arange(rows)
    state = rule.start(rows, torch.device("cpu"))
    lengths = [0] * rows
    depth = 0
    while live.numel():
        # Y_{depth+1} was drawn from q_{depth+1} = probs[:, depth] and has joined;
        # h_depth = hiddens[:, depth]. A row that stops has depth + 1 tokens.
        state, keep = rule.step(
            state,
            depth,
            next_token_probs=token_probs[live, depth],
            next_probs=probs[live, depth],
            hidden=hiddens[live, depth] if rule.needs_hidden else None,
        )
        assert keep.dtype == torch.bool and keep.shape == live.shape
        for r in live[~keep].tolist():
            lengths[r] = depth + 1
        live, state = live[keep], state[keep]
        depth += 1
    return lengths


def _ref_confidence(signal: str, q: list[float], token_p: float) -> float:
    if signal == "token_prob":
        return token_p
    s = sorted(q, reverse=True)
    return s[0] if signal == "max_prob" else s[0] - s[1]


def _ref_lengths(kind: str, probs, token_probs, hiddens, *, k_min, k_max, thr, signal="",
                 head=None) -> list[int]:
    out = []
    for r in range(probs.shape[0]):
        p_all, depth = 1.0, 0
        while True:
            if kind == "head" and depth >= 1:
                # Manual head: blocks then softmax, as plain float math per row.
                with torch.no_grad():
                    x = hiddens[r, depth].double()
                    for lin in head.block_sequence():
                        x = x + torch.nn.functional.silu(
                            lin.weight.double() @ x + lin.bias.double())
                    z = head.output.weight.double() @ x + head.output.bias.double()
                p_all *= 1.0 / (1.0 + math.exp(float(z[0] - z[1])))
            # Y_{depth+1} has joined: the round holds depth + 1 tokens.
            if depth + 1 >= k_max:
                break
            if depth + 1 >= k_min:
                if kind == "conf":
                    conf = _ref_confidence(signal, probs[r, depth].tolist(),
                                           float(token_probs[r, depth]))
                    if not conf >= thr:
                        break
                elif kind == "head" and 1.0 - p_all > thr:
                    break
            depth += 1
        out.append(depth + 1)
    return out


@pytest.mark.parametrize("k_min,k_max", [(1, 6), (2, 5), (1, 1), (3, 3), (4, 4)])
def test_always_continue_is_fixed_k(k_min, k_max):
    probs, tp, hs = _random_round(7, k_max, 11, 4, seed=0)
    assert _drive(AlwaysContinue(k_max, k_min), probs, tp, hs) == [k_max] * 7


@pytest.mark.parametrize("signal", ["token_prob", "max_prob", "top2_margin"])
@pytest.mark.parametrize("thr", [1e-6, 0.1, 0.3, 0.5, 0.8, 1 - 1e-6])
@pytest.mark.parametrize("k_min,k_max", [(1, 6), (2, 7), (1, 1), (4, 4)])
def test_confidence_stop_matches_reference(signal, thr, k_min, k_max):
    for seed in range(3):
        probs, tp, hs = _random_round(33, k_max, 13, 4, seed=seed)
        rule = ConfidenceStop(thr, signal, min_tokens=k_min, max_tokens=k_max)
        got = _drive(rule, probs, tp, hs)
        want = _ref_lengths("conf", probs, tp, hs, k_min=k_min, k_max=k_max, thr=thr,
                            signal=signal)
        assert got == want
        assert all(k_min <= n <= k_max for n in got)
    if k_min < k_max and 0.1 <= thr <= 0.8:
        # Non-trivial threshold: lengths really vary between rows.
        assert len(set(got)) > 1


def _random_head(hidden: int, blocks: int, shared: bool, seed: int, bias: float) -> AcceptanceHead:
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, blocks, shared)
    with torch.no_grad():
        head.output.bias.copy_(torch.tensor([0.0, bias]))  # shifts P(accept) up or down
    return head.eval()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("h", [1e-7, 0.05, 0.3, 0.7, 0.95, 1 - 1e-7])
@pytest.mark.parametrize("k_min,k_max", [(1, 8), (2, 5), (1, 1), (3, 3)])
def test_head_stop_matches_reference(shared, h, k_min, k_max):
    head = _random_head(6, 3, shared, seed=1, bias=2.0)
    lengths_all = []
    for seed in range(3):
        probs, tp, hs = _random_round(29, k_max, 5, 6, seed=seed)
        got = _drive(HeadStop(head, h, min_tokens=k_min, max_tokens=k_max), probs, tp, hs)
        want = _ref_lengths("head", probs, tp, hs, k_min=k_min, k_max=k_max, thr=h, head=head)
        assert got == want
        lengths_all += got
    if h <= 1e-6:
        # h near 0: any predicted risk stops the round as early as the head can: it judges
        # Y_1 once Y_1 was fed, when Y_2 is drawn and kept, so at 2 tokens (or the clamp).
        assert set(lengths_all) == {max(k_min, min(2, k_max))}
    if h >= 1 - 1e-6:
        # h near 1: the product never drops by 1 - 1e-7 in a few steps of P ~ 0.9: full K.
        assert set(lengths_all) == {k_max}
    if k_min < k_max and 0.05 <= h <= 0.7:
        assert len(set(lengths_all)) > 1


def test_head_stop_state_is_running_product():
    head = _random_head(4, 2, False, seed=3, bias=0.0)
    rule = HeadStop(head, 0.999, min_tokens=1, max_tokens=4)
    hs = torch.randn(3, 4)
    state = rule.start(3, torch.device("cpu"))
    state, keep = rule.step(state, 0, next_token_probs=torch.ones(3), next_probs=None, hidden=hs)
    assert torch.equal(state, torch.ones(3)) and keep.all()  # depth 0: nothing multiplied
    s1, _ = rule.step(state, 1, next_token_probs=torch.ones(3), next_probs=None, hidden=hs)
    s2, _ = rule.step(s1, 2, next_token_probs=torch.ones(3), next_probs=None, hidden=hs)
    p = head.accept_prob(hs).detach()
    torch.testing.assert_close(s2, p * p)


def test_make_stop_rule_picks_and_validates():
    head = _random_head(4, 1, True, seed=0, bias=0.0)
    rule = make_stop_rule({"num_speculative_tokens": 5, "stop_threshold": 0.4}, head)
    assert isinstance(rule, HeadStop) and rule.needs_hidden
    assert (rule.min_tokens, rule.max_tokens, rule.stop_threshold) == (1, 5, 0.4)
    rule = make_stop_rule({"num_speculative_tokens": 5, "min_speculative_tokens": 2,
                           "confidence_threshold": 0.3}, None, confidence_signal="max_prob")
    assert isinstance(rule, ConfidenceStop) and not rule.needs_hidden and rule.needs_probs
    assert (rule.min_tokens, rule.max_tokens, rule.threshold, rule.signal) == (2, 5, 0.3,
                                                                                "max_prob")
    # Left-out settings take the rule's defaults (algorithms/stop_defaults.py, which
    # vllm_specx.methods also reads for the adaptive knobs: one source).
    rule = make_stop_rule({"num_speculative_tokens": 3}, None)
    assert (rule.threshold, rule.signal, rule.min_tokens) == (0.5, "token_prob", 1)
    rule = make_stop_rule({"num_speculative_tokens": 3, "confidence_signal": "top2_margin"},
                          None)
    assert rule.signal == "top2_margin"
    with pytest.raises(ValueError, match="confidence_signal='entropy'"):
        make_stop_rule({"num_speculative_tokens": 3}, None, confidence_signal="entropy")
    with pytest.raises(ValueError, match="min_speculative_tokens=4"):
        make_stop_rule({"num_speculative_tokens": 3, "min_speculative_tokens": 4}, None)
    with pytest.raises(ValueError, match="load_head"):
        make_stop_rule({"num_speculative_tokens": 3, "acceptance_head": "/x"}, None)
