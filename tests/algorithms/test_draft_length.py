"""``vllm_specx.algorithms.draft_length``: the per-step draft-length choice against a
brute-force search over every length vector, the online cost stop against a per-row
reference, and the acceptance history."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from vllm_specx.algorithms.draft_length import (
    AcceptanceHistory,
    CostStop,
    StepCosts,
    choose_draft_lengths,
    expected_gains,
    expected_tokens,
)
from vllm_specx.algorithms.draft_stop import AlwaysContinue, ConfidenceStop

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _brute_force(gains: np.ndarray, costs: StepCosts, caps: list[int]) -> float:
    """The best expected tokens per unit time over every length vector (the reference)."""
    best = 0.0
    for lengths in itertools.product(*[range(c + 1) for c in caps]):
        best = max(best, expected_tokens(gains, lengths) / costs.step_time(lengths))
    return best


def _random_costs(rng: np.random.Generator) -> StepCosts:
    # Scales spanning "drafting is nearly free" to "a draft row costs more than a target
    # step", so both all-zero and full-length optima occur.
    return StepCosts(
        target_base=float(rng.uniform(0.5, 2.0)),
        target_per_request=float(rng.uniform(0.0, 0.3)),
        target_per_token=float(rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(0.5, 3)])),
        draft_pass=float(rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(0.5, 2)])),
        draft_row=float(rng.uniform(0.0, 0.4)),
        fixed=float(rng.uniform(0.0, 0.5)),
        draft_round=float(rng.choice([0.0, rng.uniform(0.0, 1.0)])),
    )


def test_choice_matches_brute_force_on_random_costs_and_rates():
    rng = np.random.default_rng(0)
    seen_lengths: set[int] = set()
    all_zero = some_zero = 0
    for trial in range(300):
        num_reqs = int(rng.integers(1, 5))
        k = int(rng.integers(1, 5))
        rates = rng.uniform(0, 1, size=(num_reqs, k)) ** float(rng.choice([0.3, 1.0, 3.0]))
        gains = expected_gains(rates)
        caps = [int(rng.integers(0, k + 1)) for _ in range(num_reqs)]
        costs = _random_costs(rng)
        choice = choose_draft_lengths(gains, costs, caps)
        assert all(0 <= n <= c for n, c in zip(choice.lengths, caps))
        assert choice.rate == pytest.approx(
            expected_tokens(gains, choice.lengths) / costs.step_time(choice.lengths))
        best = _brute_force(gains, costs, caps)
        assert choice.rate == pytest.approx(best, rel=1e-9), (trial, choice, best)
        seen_lengths.update(int(n) for n in choice.lengths)
        all_zero += int(not choice.lengths.any())
        some_zero += int(choice.lengths.any() and (choice.lengths == 0).any())
    # The random cases really exercise every regime.
    assert all_zero > 10 and some_zero > 10 and max(seen_lengths) >= 3


def test_choice_extremes():
    gains = expected_gains(np.full((3, 4), 0.9))
    free = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0)
    assert choose_draft_lengths(gains, free).lengths.tolist() == [4, 4, 4]
    dear = StepCosts(1.0, 0.0, 5.0, 0.0, 0.0)  # a verification row costs 5 target steps
    assert choose_draft_lengths(gains, dear).lengths.tolist() == [0, 0, 0]
    # One good request, two hopeless ones: only the good one drafts.
    mixed = expected_gains(np.array([[0.95] * 4, [0.01] * 4, [0.02] * 4]))
    lengths = choose_draft_lengths(mixed, StepCosts(1.0, 0.0, 0.2, 0.1, 0.05)).lengths
    assert lengths[0] > 0 and lengths[1] == lengths[2] == 0


def _reference_cost_stop(conf: list[float], rates: list[float], cap: int,
                         threshold: float, inner_threshold: float) -> int:
    """One request through a round: the length the online rule stops at."""
    log_p = 0.0
    depth = 0
    while True:
        if depth + 1 >= len(rates):  # K reached
            return depth + 1
        log_p += math.log(max(conf[depth], 1e-12))
        next_rate = max(rates[depth + 1], 1e-12)
        keep = (conf[depth] >= inner_threshold and depth + 1 < cap
                and log_p + math.log(next_rate) >= math.log(max(threshold, 1e-12)))
        if not keep:
            return depth + 1
        depth += 1


def test_cost_stop_matches_per_row_reference():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        rows, k = 6, 5
        conf = torch.rand(rows, k, generator=g) ** 0.3
        rates = torch.rand(rows, k, generator=g) ** 0.3
        caps = torch.randint(0, k + 1, (rows,), generator=g)
        threshold = float(torch.rand(1, generator=g)) * 0.5
        rule = CostStop(ConfidenceStop(0.2, max_tokens=k), caps, rates, threshold)
        state = rule.start(rows, torch.device("cpu"))
        live = torch.arange(rows)
        lengths = torch.zeros(rows, dtype=torch.int64)
        depth = 0
        while True:  # driven as glue/chain_drafter.py drives a rule
            lengths[live] = depth + 1
            if depth + 1 >= k:
                break
            new, keep = rule.step(state[live], depth, next_token_probs=conf[live, depth])
            state[live] = new
            live = live[keep]
            if live.numel() == 0:
                break
            depth += 1
        lengths = torch.minimum(lengths, rule.row_caps)  # the round drops Y_1 at cap 0
        for r in range(rows):
            want = min(_reference_cost_stop(conf[r].tolist(), rates[r].tolist(),
                                            int(caps[r]), threshold, 0.2), int(caps[r]))
            assert int(lengths[r]) == want


def test_cost_stop_over_always_continue_follows_caps_when_threshold_is_zero():
    caps = torch.tensor([0, 1, 3, 4])
    rule = CostStop(AlwaysContinue(4), caps, torch.ones(4, 4), threshold=0.0,
                    signal="history")
    state = rule.start(4, torch.device("cpu"))
    live, depth, lengths = torch.arange(4), 0, torch.zeros(4, dtype=torch.int64)
    while True:
        lengths[live] = depth + 1
        if depth + 1 >= 4:
            break
        new, keep = rule.step(state[live], depth, next_token_probs=torch.ones(len(live)))
        state[live] = new
        live = live[keep]
        if live.numel() == 0:
            break
        depth += 1
    assert torch.minimum(lengths, rule.row_caps).tolist() == [0, 1, 3, 4]


def test_acceptance_history_rates_and_probes():
    h = AcceptanceHistory(3, prior=0.5, prior_weight=1.0, decay=1.0, pooled_decay=1.0,
                          probe_interval=3)
    for _ in range(8):
        h.observe("good", drafted=3, accepted=3)
        h.observe("bad", drafted=3, accepted=0)
    good, bad, new = h.rates(["good", "bad", "new"])
    assert good[0] > 0.85 and bad[0] < 0.15
    # "bad" never tried positions 2-3: they stay at the pooled rate.
    assert bad[1] == pytest.approx(h.pooled_rates()[1])
    # A position nobody reached takes the rate of the one before it, not the prior.
    deep = AcceptanceHistory(4, prior=0.5, prior_weight=1.0, decay=1.0, pooled_decay=1.0)
    for _ in range(20):
        deep.observe("r", drafted=2, accepted=2)
    rates = deep.pooled_rates()
    assert rates[3] == pytest.approx(rates[1]) and rates[1] > 0.9
    assert new.tolist() == pytest.approx(h.pooled_rates().tolist())
    zero = np.zeros(2, dtype=np.int64)
    assert h.probes(["a", "b"], zero).tolist() == [0, 0]
    assert h.probes(["a", "b"], np.array([0, 2])).tolist() == [0, 2]
    assert h.probes(["a", "b"], zero).tolist() == [1, 0]  # "a" idle for 3 steps
    # While "bad" drafts nothing its own evidence fades: its rate drifts to the pooled one.
    h.decay = 0.5
    before = h.rates(["bad"])[0, 0]
    for _ in range(10):
        h.probes(["bad"], np.zeros(1, dtype=np.int64))
    after = h.rates(["bad"])[0, 0]
    assert before < after == pytest.approx(h.pooled_rates()[0], abs=0.01)
    h.forget_except(["good"])
    assert h.rates(["bad"])[0].tolist() == pytest.approx(h.pooled_rates().tolist())
