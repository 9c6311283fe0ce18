"""Benchmark arithmetic on hand-made traces, every expected number derived by hand here."""

from __future__ import annotations

import math

import pytest

from vllm_specx.bench.metrics import (
    DrafterStats,
    RequestTrace,
    StepTiming,
    aggregate,
    config_metrics,
    counter_delta,
    forward_cost,
    forward_time_stats,
    model_time_speedup,
    perplexity,
    projected_speedup,
    subtract_stats,
)


def two_request_trace() -> list[RequestTrace]:
    """K = 3 draft-model run, max_tokens = 8.

    Request A: prefill emits 1; step 1 drafts 3, accepts 2 -> emits 3; step 2 drafts 3,
    accepts 0 -> emits 1; step 3 drafts 3, accepts 3 -> would emit 4 but only 8 - 5 = 3
    tokens remain, so vLLM trims to 3. Request B (EOS after 6): prefill 1; drafts 3,
    accepts 1 -> emits 2; drafts 2 (an adaptive stop), accepts 2 -> emits 3.
    """
    a = RequestTrace(
        step_tokens=[1, 3, 1, 3],
        logprobs=[-1.0] * 8,
        drafted_per_step=[3, 3, 3],
        accepted_per_step=[2, 0, 3],
        finish_reason="length",
    )
    b = RequestTrace(
        step_tokens=[1, 2, 3],
        logprobs=[-2.0] * 6,
        drafted_per_step=[3, 2],
        accepted_per_step=[1, 2],
        finish_reason="stop",
    )
    return [a, b]


def test_hand_computed_two_request_trace():
    m = config_metrics(two_request_trace(), t_target=1.0, t_draft=0.1, wall_s=2.0,
                       baseline_tokens_per_s=10.0)
    # N = 8 + 6, N_t = 4 + 3 forwards, V = 5 verification steps.
    assert m["generated_tokens"] == 14
    assert m["target_forward_passes"] == 7
    assert m["verification_steps"] == 5
    assert m["drafted_tokens"] == 9 + 5
    assert m["accepted_tokens"] == 5 + 3
    # Drafts in the output: 14 - 7 = 7 (A: 4 of its 5 accepted survive the trim; B: 3).
    assert m["emitted_draft_tokens"] == 7
    assert m["discarded_tokens"] == 14 - 7
    assert m["truncated_requests"] == 1
    assert m["verification_rate"] == pytest.approx(7 / 14)
    assert m["block_efficiency"] == pytest.approx(2.0)
    assert m["discard_rate"] == pytest.approx(7 / 14)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 8 / 5)
    assert m["draft_acceptance_rate"] == pytest.approx(8 / 14)
    # Position 1: drafted in 5 steps, accepted in 4 (A: 2, 3; B: 1, 2).
    # Position 2: drafted in 5, accepted in 3 (A: 2, 3; B: 2).
    # Position 3: drafted in 4 (B's second step stopped at 2), accepted in 1 (A: 3).
    assert m["drafted_per_position"] == [5, 5, 4]
    assert m["accepted_per_position"] == [4, 3, 1]
    assert m["acceptance_per_position"] == pytest.approx([0.8, 0.6, 0.25])
    assert m["padding_ratio"] == 0.0
    assert m["padding_source"] == "vllm-scheduler"
    assert m["perplexity"] == pytest.approx(math.exp((8 * 1.0 + 6 * 2.0) / 14))
    assert m["perplexity_tokens"] == 14
    assert m["tokens_per_s"] == pytest.approx(7.0)
    assert m["measured_speedup"] == pytest.approx(0.7)
    # N_draft = 14 draft forwards: T/N = 0.1 * 14/14 + 1.0 * 7/14 = 0.6 -> 1/0.6.
    # Same through eq. 2.3: discard_rate + 1 - verification_rate = 0.5 + 1 - 0.5 = 1.
    assert m["draft_forward_passes"] == 14
    assert m["projected_speedup"] == pytest.approx(1 / 0.6)
    assert m["projected_tokens_per_s"] == pytest.approx(10.0 / 0.6)
    assert m["warnings"] == []


def test_eq_2_3_identity_holds_on_the_trace():
    m = config_metrics(two_request_trace())
    n = m["generated_tokens"]
    draft_forwards_per_token = m["draft_forward_passes"] / n
    assert draft_forwards_per_token == pytest.approx(
        m["discard_rate"] + 1 - m["verification_rate"]
    )


def test_baseline_trace_is_one_token_per_forward():
    traces = [RequestTrace(step_tokens=[1] * 8, logprobs=[-0.5] * 8) for _ in range(3)]
    m = config_metrics(traces, t_target=0.02, t_draft=0.0, wall_s=1.2,
                       baseline_tokens_per_s=20.0)
    assert m["generated_tokens"] == 24
    assert m["verification_rate"] == 1.0
    assert m["block_efficiency"] == 1.0
    assert m["discard_rate"] == 0.0
    assert m["mean_acceptance_length"] == 1.0
    assert m["acceptance_per_position"] == []
    assert m["padding_ratio"] == 0.0
    assert m["projected_speedup"] == 1.0
    assert m["measured_speedup"] == pytest.approx(1.0)
    assert m["perplexity"] == pytest.approx(math.exp(0.5))


def test_model_free_drafter_with_steps_without_drafts():
    # ngram: prefill 1; no match -> plain step emits 1; match of 2 drafts, both accepted
    # -> emits 3; no match -> 1. Only one step carried drafts.
    tr = RequestTrace(step_tokens=[1, 1, 3, 1], drafted_per_step=[2], accepted_per_step=[2])
    m = config_metrics([tr], t_target=1.0, t_draft=0.0)
    assert m["generated_tokens"] == 6
    assert m["target_forward_passes"] == 4
    assert m["verification_steps"] == 1
    assert m["discarded_tokens"] == 0
    assert m["mean_acceptance_length"] == 3.0
    assert m["acceptance_per_position"] == [1.0, 1.0]
    # t_draft = 0: speed-up is the inverse verification rate, 6 / 4.
    assert m["projected_speedup"] == pytest.approx(1.5)


def test_never_accepted_positions_have_rate_zero():
    tr = RequestTrace(step_tokens=[1, 1, 1], drafted_per_step=[4, 4], accepted_per_step=[0, 0])
    m = config_metrics([tr])
    assert m["acceptance_per_position"] == [0.0, 0.0, 0.0, 0.0]
    assert m["discard_rate"] == pytest.approx(8 / 3)


def test_drafter_reported_padding_and_forwards():
    # The drafter really drafted 12 tokens but handed 14 to the scheduler (vLLM's count);
    # verification needs 12 + 5 positions (k + 1 per step) and computed 14 + 5.
    drafter = DrafterStats(drafted_tokens=12, scheduled_tokens=14, draft_forward_passes=30)
    m = config_metrics(two_request_trace(), drafter=drafter, t_target=1.0, t_draft=0.1)
    assert m["padding_ratio"] == pytest.approx(2 / 17)
    assert m["padding_source"] == "drafter"
    assert m["drafted_tokens"] == 12
    assert m["scheduled_draft_tokens"] == 14
    assert m["discarded_tokens"] == 12 - 7
    assert m["draft_forward_passes"] == 30
    # T/N = 0.1 * 30/14 + 1.0 * 0.5
    assert m["projected_speedup"] == pytest.approx(1 / (0.1 * 30 / 14 + 0.5))


def test_drafter_stats_from_mapping():
    assert DrafterStats.from_mapping(None) is None
    assert DrafterStats.from_mapping({"rounds": 3}) is None
    stats = DrafterStats.from_mapping({"drafted_tokens": 5, "scheduled_tokens": 6.0})
    assert stats == DrafterStats(drafted_tokens=5, scheduled_tokens=6)


def test_merged_steps_are_flagged():
    # 4 tokens in one step with only 1 accepted draft: two forwards were recorded as one.
    tr = RequestTrace(step_tokens=[1, 4], drafted_per_step=[3], accepted_per_step=[1])
    _, warnings = aggregate([tr])
    assert any("merged" in w for w in warnings)


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        aggregate([RequestTrace(step_tokens=[1, 5], drafted_per_step=[3],
                                accepted_per_step=[4])])
    with pytest.raises(ValueError, match="differ in length"):
        aggregate([RequestTrace(step_tokens=[1], drafted_per_step=[3], accepted_per_step=[])])


def test_missing_logprobs_are_left_out_of_perplexity():
    tr = RequestTrace(step_tokens=[1, 1, 1], logprobs=[-1.0, None, -3.0])
    m = config_metrics([tr])
    assert m["perplexity_tokens"] == 2
    assert m["perplexity"] == pytest.approx(math.exp(2.0))
    assert perplexity(0.0, 0) is None


def test_projected_speedup_edge_cases():
    assert projected_speedup(None, 1.0, 1.0, 0.1) is None
    assert projected_speedup(0.5, 1.0, None, 0.1) is None
    assert projected_speedup(0.5, 1.0, 1.0, None) is None
    # A free drafter that halves the target forwards doubles the speed.
    assert projected_speedup(0.5, 3.0, 2.0, 0.0) == pytest.approx(2.0)
    # A draft as slow as the target with nothing accepted: K + 1 forwards per token.
    assert projected_speedup(1.0, 4.0, 1.0, 1.0) == pytest.approx(1 / 5)


def test_empty_run():
    m = config_metrics([])
    assert m["generated_tokens"] == 0
    assert m["verification_rate"] is None
    assert m["block_efficiency"] is None
    assert m["perplexity"] is None
    assert m["projected_speedup"] is None


def test_forward_cost_uses_full_batch_decode_steps():
    steps = [
        StepTiming(5.0, prefill=True, requests=2),
        StepTiming(0.1, prefill=False, requests=2),
        StepTiming(0.3, prefill=False, requests=2),
        StepTiming(0.2, prefill=False, requests=2),
        StepTiming(9.0, prefill=False, requests=1),  # tail: one request left
    ]
    cost = forward_cost(steps)
    assert cost["seconds"] == pytest.approx(0.2)
    assert cost["mean_s"] == pytest.approx(0.2)
    assert cost["steps"] == 3
    assert cost["batch"] == 2
    assert forward_cost([StepTiming(1.0, True, 1)])["seconds"] is None


def test_counter_and_stats_deltas():
    before = {"a": 3, "v": [1, 2], "s": "x"}
    after = {"a": 10, "v": [4, 6, 1], "s": "y"}
    assert counter_delta(before, after) == {"a": 7, "v": [3, 4, 1]}
    assert subtract_stats({"drafted_tokens": 4}, {"drafted_tokens": 10, "tag": "t"}) == {
        "drafted_tokens": 6, "tag": "t"}
    assert subtract_stats(None, {"drafted_tokens": 2}) == {"drafted_tokens": 2}
    assert subtract_stats({"x": 1}, None) is None


def test_forward_time_stats_uses_the_modal_shape_plus_logits():
    # Two prefill-shaped calls (12 tokens) and three decode-shaped calls (2 tokens, the
    # batch); logits calls 0.01 s each.
    record = {
        "forward_s": [0.5, 0.1, 0.2, 0.3, 0.6],
        "tokens": [12, 2, 2, 2, 12],
        "logits_s": [0.01, 0.01, 0.01, 0.01, 0.01],
    }
    stats = forward_time_stats(record)
    assert stats["modal_tokens"] == 2
    assert stats["modal_calls"] == 3
    assert stats["forward_s"] == pytest.approx(0.2)
    assert stats["logits_s"] == pytest.approx(0.01)
    assert stats["seconds"] == pytest.approx(0.21)
    assert stats["calls"] == 5
    assert stats["total_s"] == pytest.approx(1.7 + 0.05)
    # A tie between shapes picks the smaller (decode) one.
    tie = forward_time_stats({"forward_s": [1.0, 2.0], "tokens": [8, 1], "logits_s": []})
    assert tie["modal_tokens"] == 1 and tie["seconds"] == pytest.approx(2.0)
    empty = forward_time_stats(None)
    assert empty["seconds"] is None and empty["calls"] == 0


def test_model_time_speedup():
    # Baseline: 2.0 model seconds for 100 tokens; speculative: 1.5 s for 100 tokens.
    assert model_time_speedup(2.0, 100, 1.5, 100) == pytest.approx(2.0 / 1.5)
    # Per token: a run that generated fewer tokens is compared per token.
    assert model_time_speedup(2.0, 100, 1.0, 25) == pytest.approx(0.02 / 0.04)
    assert model_time_speedup(None, 100, 1.0, 10) is None
    assert model_time_speedup(2.0, 100, 1.0, 0) is None


def test_draft_forwards_counted_per_round():
    # A beam-search drafter ran 7 batched draft forwards per round (1 + 2 beams x 3 depths)
    # while drafting 3 tokens: the 5 verification steps cost 5 x 7 draft forwards.
    m = config_metrics(two_request_trace(), draft_forwards_per_round=7.0, t_target=1.0,
                       t_draft=0.1)
    assert m["draft_forward_passes"] == pytest.approx(35.0)
    assert m["draft_forward_passes_source"].startswith("draft-model forwards per")
    assert m["projected_speedup"] == pytest.approx(1 / (0.1 * 35 / 14 + 0.5))
    # The drafter's own count wins over the hooks'.
    m = config_metrics(two_request_trace(), draft_forwards_per_round=7.0,
                       drafter=DrafterStats(draft_forward_passes=20))
    assert m["draft_forward_passes"] == 20


def test_draft_lengths_and_hindsight_oracle():
    """The two-request trace: drafts 3,3,3 and 3,2 -> mean 14/5, histogram {2: 1, 3: 4}.
    The oracle drafts only the 8 accepted tokens (one forward each) for the same N = 14 and
    N_t = 7: T/N = 0.1 * 8/14 + 1.0 * 7/14, so speed-up = 1 / (0.8/14 + 0.5)."""
    m = config_metrics(two_request_trace(), t_target=1.0, t_draft=0.1)
    assert m["mean_draft_length"] == pytest.approx(14 / 5)
    assert m["draft_length_histogram"] == {"2": 1, "3": 4}
    assert m["oracle_projected_speedup"] == pytest.approx(1 / (0.8 / 14 + 0.5))
    # The drafter itself paid one forward per drafted token (14): the oracle is faster.
    assert m["projected_speedup"] == pytest.approx(1 / (1.4 / 14 + 0.5))
    assert m["oracle_projected_speedup"] > m["projected_speedup"]


def test_drafter_counts_are_scaled_to_the_verified_rounds():
    """The two-request trace has 5 verification steps. A drafter that reports 7
    request-rounds (two more: one after each request's last step), 20 drafted tokens and
    26 draft forwards is charged 5/7 of them, like a hook-counted drafter."""
    drafter = DrafterStats(drafted_tokens=20, scheduled_tokens=20, draft_forward_passes=26,
                           request_rounds=7)
    m = config_metrics(two_request_trace(), drafter=drafter, t_target=1.0, t_draft=0.1)
    assert m["draft_forward_passes"] == pytest.approx(26 * 5 / 7)
    assert m["drafted_tokens"] == round(20 * 5 / 7)
    assert m["padding_ratio"] == 0.0
    assert m["projected_speedup"] == pytest.approx(1 / (0.1 * 26 * 5 / 7 / 14 + 7 / 14))
    assert DrafterStats.from_mapping({"draft_forward_passes": 3, "requests": 2}) == DrafterStats(
        draft_forward_passes=3, request_rounds=2)
