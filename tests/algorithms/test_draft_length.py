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
    CALIBRATION_EDGES,
    AcceptanceHistory,
    ConfidenceCalibration,
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
        skip_debt=float(rng.choice([0.0, rng.uniform(0.0, 0.3)])),
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


def test_choice_with_a_minimum_gain_drafts_only_where_the_best_plan_clears_it():
    # min_gain m: the brute-force best plan where its rate beats the plain step's by more
    # than m, else nobody drafts.
    rng = np.random.default_rng(5)
    kept = dropped = 0
    for _ in range(200):
        num_reqs, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        gains = expected_gains(rng.uniform(0, 1, size=(num_reqs, k)))
        caps = [k] * num_reqs
        costs = _random_costs(rng)
        plain = num_reqs / costs.step_time([0] * num_reqs)
        best = _brute_force(gains, costs, caps)
        choice = choose_draft_lengths(gains, costs, caps, min_gain=0.05)
        if best > plain * 1.05 * (1 + 1e-9):
            assert choice.rate == pytest.approx(best, rel=1e-9)
            kept += int(choice.lengths.any())
        elif best < plain * 1.05 * (1 - 1e-9):
            assert not choice.lengths.any() and choice.rate == pytest.approx(plain)
            dropped += int(best > plain * (1 + 1e-9))  # a plan that paid, below the bar
    assert kept > 10 and dropped > 3


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
    # A model whose plain step costs nothing has no rate to maximise: a plain step for
    # everyone, not a division by zero (an engine once died of it).
    for broken in (StepCosts(0.0, 0.0, 0.0, 0.0, 0.0), StepCosts(-1.0, 0.0, 0.1, 0.1, 0.0),
                   StepCosts(float("nan"), 0.0, 0.1, 0.1, 0.0)):
        assert choose_draft_lengths(gains, broken).lengths.tolist() == [0, 0, 0]


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


def _drive_round(rule, conf: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's draft length when ``rule`` reads ``conf[row, depth]`` at every depth,
    driven as ``glue/chain_drafter.py`` drives a rule (live rows only, up to ``k``)."""
    rows = conf.shape[0]
    state = rule.start(rows, torch.device("cpu"))
    live = torch.arange(rows)
    lengths = torch.zeros(rows, dtype=torch.int64)
    depth = 0
    while True:
        lengths[live] = depth + 1
        if depth + 1 >= k:
            return lengths
        new, keep = rule.step(state[live], depth, next_token_probs=conf[live, depth])
        state[live] = new
        live = live[keep]
        if live.numel() == 0:
            return lengths
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
        # The round drops Y_1 at cap 0.
        lengths = torch.minimum(_drive_round(rule, conf, k), rule.row_caps)
        for r in range(rows):
            want = min(_reference_cost_stop(conf[r].tolist(), rates[r].tolist(),
                                            int(caps[r]), threshold, 0.2), int(caps[r]))
            assert int(lengths[r]) == want


def _reference_shared_pass(conf: torch.Tensor, rates: torch.Tensor, threshold: float,
                           pass_threshold: float) -> list[int]:
    """Every row's length under a shared lookahead pass, by its definition: at each depth
    the rows whose next token pays its own cost (``P * a_next >= threshold``) go on
    together iff their margins above that cost add up to the pass's cost."""
    rows, k = conf.shape
    p = [1.0] * rows
    live = list(range(rows))
    lengths = [0] * rows
    depth = 0
    while True:
        for r in live:
            lengths[r] = depth + 1
        if depth + 1 >= k:
            return lengths
        margins = {}
        for r in live:
            p[r] *= float(conf[r, depth])
            margins[r] = p[r] * float(rates[r, depth + 1]) - threshold
        go = [r for r in live if margins[r] >= 0]
        if not go or sum(margins[r] for r in go) < pass_threshold:
            return lengths
        live = go
        depth += 1


def test_cost_stop_shares_the_lookahead_pass_among_the_rows_that_go_on():
    g = torch.Generator().manual_seed(5)
    shallower = deeper = 0
    for case in range(40):
        rows, k = (1, 6) if case % 2 else (5, 6)
        conf = torch.rand(rows, k, generator=g) ** 0.2
        rates = torch.rand(rows, k, generator=g) ** 0.2
        threshold = float(torch.rand(1, generator=g)) * 0.2
        pass_threshold = float(torch.rand(1, generator=g)) * 0.6
        caps = torch.full((rows,), k)
        rule = CostStop(ConfidenceStop(0.0, max_tokens=k), caps, rates, threshold,
                        pass_threshold=pass_threshold)
        free = CostStop(ConfidenceStop(0.0, max_tokens=k), caps, rates, threshold)
        got = [_drive_round(r, conf, k).tolist() for r in (rule, free)]
        assert got[0] == _reference_shared_pass(conf, rates, threshold, pass_threshold)
        # The pass's cost only ever stops rows earlier.
        assert all(a <= b for a, b in zip(*got))
        shallower += got[0] != got[1]
        deeper += max(got[0]) > 2
    assert shallower > 0 and deeper > 0  # the cases exercise both sides


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


def _reference_tau2(n: np.ndarray, a: np.ndarray) -> float:
    """The method-of-moments between-request variance, spelled out request by request."""
    p = sum(a) / sum(n)
    total = sum(n)
    spread = sum(ni * (ai / ni - p) ** 2 for ni, ai in zip(n, a)) - (len(n) - 1) * p * (1 - p)
    return spread / (total - sum(ni * ni for ni in n) / total)


@pytest.mark.parametrize("case", ["alike", "different"])
def test_requests_that_do_not_differ_share_the_pooled_rate(case):
    # 16 requests, 40 one-token drafts each: all at 0.2 ("alike": a request's own streaks
    # are noise, so its rate is the pooled one), or half at 0.05 and half at 0.8
    # ("different": each keeps its own).
    rng = np.random.default_rng(3)
    h = AcceptanceHistory(2, decay=0.97)
    true = {f"r{i}": (0.2 if case == "alike" else (0.05, 0.8)[i % 2]) for i in range(16)}
    for _ in range(40):
        ids = list(true)
        h.observe_many(ids, [1] * 16, [int(rng.random() < true[r]) for r in ids])
    rows = len(h._slot)
    n, a = h._tried[:rows, 0], h._accepted[:rows, 0]
    tau2 = _reference_tau2(n, a)
    weight = h.request_weight_now()
    rates = h.rates(list(true))[:, 0]
    if case == "alike":
        assert weight > 100 and (tau2 <= 0 or weight == pytest.approx(
            min(0.2 * 0.8 / tau2 - 1, 200), rel=0.3))
        assert np.abs(rates - rates.mean()).max() < 0.03
    else:
        assert weight == h.request_weight == 12.0
        low = [rates[i] for i in range(16) if i % 2 == 0]
        assert max(low) < 0.3 < 0.6 < min(rates[i] for i in range(16) if i % 2 == 1)
    # Fewer than four requests with a few tries each: the configured weight.
    few = AcceptanceHistory(2)
    for _ in range(10):
        few.observe_many(["x", "y", "z"], [1, 1, 1], [0, 1, 0])
    assert few.request_weight_now() == few.request_weight


def test_acceptance_history_rates_and_probes():
    h = AcceptanceHistory(3, prior=0.5, prior_weight=1.0, decay=1.0, pooled_decay=1.0,
                          probe_interval=3, request_weight=1.0)
    for _ in range(8):
        h.observe("good", drafted=3, accepted=3)
        h.observe("bad", drafted=3, accepted=0)
    good, bad, new = h.rates(["good", "bad", "new"])
    assert good[0] > 0.85 and bad[0] < 0.15
    # "bad" never tried positions 2-3: they stay at the pooled rate.
    assert bad[1] == pytest.approx(h.pooled_rates()[1])
    # A position nobody reached takes the rate of the one before it where that is above
    # the prior ...
    deep = AcceptanceHistory(4, prior=0.5, prior_weight=1.0, decay=1.0, pooled_decay=1.0)
    for _ in range(20):
        deep.observe("r", drafted=2, accepted=2)
    rates = deep.pooled_rates()
    assert rates[3] == pytest.approx(rates[1]) and rates[1] > 0.9
    # ... and the prior where the one before it is weak: an unmeasured deeper position is
    # not priced at a weak first one's rate (which kept it undrafted and unmeasured).
    weak = AcceptanceHistory(3, prior=0.6, prior_weight=2.0, decay=1.0, pooled_decay=1.0)
    for i in range(30):
        weak.observe("r", drafted=1, accepted=int(i % 3 == 0))
    rates = weak.pooled_rates()
    assert rates[0] < 0.4 and rates[1] == pytest.approx(0.6) and rates[2] == pytest.approx(0.6)
    # Its own data pull a measured deeper position down below the prior.
    for _ in range(30):
        weak.observe("r", drafted=2, accepted=1)
    assert weak.pooled_rates()[1] < 0.2
    assert new.tolist() == pytest.approx(h.pooled_rates().tolist())
    zero = np.zeros(2, dtype=np.int64)
    assert h.probes(["a", "b"], zero).tolist() == [0, 0]
    assert h.probes(["a", "b"], np.array([0, 2])).tolist() == [0, 2]
    assert h.probes(["a", "b"], zero, may_probe=False).tolist() == [0, 0]  # "a" is due
    assert h.probes(["a", "b"], zero, may_probe=np.array([False, True])).tolist() == [0, 0]
    assert h.probes(["a", "b"], zero).tolist() == [1, 1]  # "a" stayed due; "b" is due
    # While "bad" drafts nothing its own evidence fades: its rate drifts to the pooled one.
    h.decay = 0.5
    before = h.rates(["bad"])[0, 0]
    for _ in range(10):
        h.probes(["bad"], np.zeros(1, dtype=np.int64))
    after = h.rates(["bad"])[0, 0]
    assert before < after == pytest.approx(h.pooled_rates()[0], abs=0.01)
    h.forget_except(["good"])
    assert h.rates(["bad"])[0].tolist() == pytest.approx(h.pooled_rates().tolist())


def _idle_steps_to_probe(h: AcceptanceHistory, rid: str) -> int:
    """Steps planned at zero until ``rid`` probes (its probe drafts one token)."""
    for step in range(1, 10**4):
        if h.probes([rid], np.zeros(1, dtype=np.int64))[0]:
            return step
    raise AssertionError("never probed")


def test_probes_back_off_while_they_fail():
    # A reference written out: the interval starts at probe_interval, doubles per rejected
    # probe up to 2 ** max_probe_backoff times, and an accepted probe or a plan that drafts
    # for the request brings it back.
    h = AcceptanceHistory(2, probe_interval=4, max_probe_backoff=2)
    waits = []
    for accepted in (0, 0, 0, 0, 1, 0):
        waits.append(_idle_steps_to_probe(h, "r"))
        h.observe("r", drafted=1, accepted=accepted)
    assert waits == [4, 8, 16, 16, 16, 4]
    assert h.probe_intervals(["r"]).tolist() == [8]
    h.probes(["r"], np.array([2]))  # the plan drafts for it: the usual interval again
    assert h.probe_intervals(["r"]).tolist() == [4]
    assert _idle_steps_to_probe(h, "r") == 4
    # Only a probe's verdict moves the interval: the plan's own drafts do not double it.
    for _ in range(5):
        h.probes(["r"], np.array([1]))
        h.observe("r", drafted=1, accepted=0)
    assert h.probe_intervals(["r"]).tolist() == [4]
    # Per request, and forgotten with the request.
    h2 = AcceptanceHistory(2, probe_interval=4)
    for _ in range(4):
        h2.probes(["a", "b"], np.zeros(2, dtype=np.int64))
    h2.observe_many(["a", "b"], [1, 1], [0, 1])
    assert h2.probe_intervals(["a", "b"]).tolist() == [8, 4]
    h2.forget_except(["b"])
    assert h2.probe_intervals(["a", "b"]).tolist() == [4, 4]


# -- beam rounds (mtad): per-request depths with per-request beam widths ----------------


def _beam_step_time(costs: StepCosts, lengths: list[int], widths: list[int]) -> float:
    """A beam round's step time written out: request r carries widths[r] rows in each
    lookahead pass d = 1..L_r - 1 and one verification row per drafted token."""
    total = costs.fixed + costs.target_base + costs.target_per_request * len(lengths)
    total += costs.target_per_token * sum(lengths)
    if any(lengths):
        total += costs.draft_round
    else:  # a step where nobody drafts leaves each request's first pass to catch up
        total += costs.skip_debt * len(lengths)
    for d in range(1, max(lengths, default=0)):
        total += costs.draft_pass + costs.draft_row * sum(
            w for n, w in zip(lengths, widths) if n > d)
    return total


def test_beam_depths_match_brute_force_on_random_costs_rates_and_widths():
    """Every request its own depth, priced with its own beam width: the choice's rate is
    the best over every depth vector (brute force over the written-out step time)."""
    rng = np.random.default_rng(8)
    seen: set[int] = set()
    mixed = 0
    for trial in range(300):
        num_reqs, k = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        rates = rng.uniform(0.0, 1.0, size=(num_reqs, k)) ** rng.uniform(0.2, 2.0)
        gains = expected_gains(rates)
        costs = _random_costs(rng)
        widths = [int(x) for x in rng.integers(1, 9, size=num_reqs)]
        caps = [int(x) for x in rng.integers(0, k + 1, size=num_reqs)]
        choice = choose_draft_lengths(gains, costs, caps, widths=widths)
        assert all(0 <= n <= c for n, c in zip(choice.lengths, caps))
        assert choice.step_time == pytest.approx(
            _beam_step_time(costs, list(choice.lengths), widths), rel=1e-9)
        assert costs.step_time(choice.lengths, widths) == pytest.approx(choice.step_time)
        best = max(expected_tokens(gains, lengths) / _beam_step_time(costs, list(lengths),
                                                                     widths)
                   for lengths in itertools.product(*[range(c + 1) for c in caps]))
        assert choice.rate == pytest.approx(best, rel=1e-9), (trial, choice, best)
        seen.update(int(n) for n in choice.lengths)
        mixed += int(len(set(choice.lengths.tolist())) > 1)
    # Both "nobody drafts" and deep rounds, and many steps whose requests' depths differ.
    assert 0 in seen and max(seen) >= 3 and mixed > 30


def test_beam_depths_price_each_requests_beams():
    """Same acceptance and costs: a wide request drafts no deeper than a narrow one (its
    lookahead rows cost more), worthless drafts give 0 for their request only, free
    rows give everyone K, and widths of 1 are the chain's choice."""
    gains = expected_gains(np.full((4, 6), 0.7))
    costs = StepCosts(target_base=1.0, target_per_request=0.05, target_per_token=0.02,
                      draft_pass=0.05, draft_row=0.01)
    lengths = choose_draft_lengths(gains, costs, widths=[1, 4, 16, 64]).lengths.tolist()
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1], lengths
    free = StepCosts(target_base=1.0, target_per_request=0.0, target_per_token=0.0,
                     draft_pass=0.0, draft_row=0.0)
    assert choose_draft_lengths(gains, free, widths=8).lengths.tolist() == [6] * 4
    hopeful = expected_gains(np.array([[0.95] * 6, [0.01] * 6, [0.9] * 6]))
    lengths = choose_draft_lengths(hopeful, costs, widths=4).lengths
    assert lengths[0] > 0 and lengths[1] == 0 and lengths[2] > 0
    rng = np.random.default_rng(3)
    for _ in range(50):
        g = expected_gains(rng.uniform(0, 1, size=(3, 4)))
        c = _random_costs(rng)
        assert (choose_draft_lengths(g, c, widths=1).lengths.tolist()
                == choose_draft_lengths(g, c).lengths.tolist())


def _reference_calibration(steps: list[tuple[list[list[float]], list[int]]], edges: list[float],
                           weight: float, decay: float) -> list[float]:
    """By definition: every verified token (index <= accepted count, a confidence read)
    with weight decay ** (steps after its own), per bin; shrunk toward the bin's middle."""
    bounds = [0.0, *edges, 1.0]
    tried = [0.0] * (len(edges) + 1)
    hits = [0.0] * (len(edges) + 1)
    for age, (confs, accepted) in enumerate(reversed(steps)):
        for row, n in zip(confs, accepted):
            for i, c in enumerate(row):
                if i > n or math.isnan(c):
                    continue
                b = next(j for j in range(len(bounds) - 1)
                         if np.float32(c) <= np.float32(bounds[j + 1]))
                tried[b] += decay ** age
                hits[b] += decay ** age * (i < n)
    mids = [(bounds[j] + bounds[j + 1]) / 2 for j in range(len(bounds) - 1)]
    return [(h + weight * m) / (t + weight) for h, t, m in zip(hits, tried, mids)]


def test_confidence_calibration_matches_counting_by_definition():
    rng = np.random.default_rng(5)
    cal = ConfidenceCalibration(prior_weight=3.0, decay=0.9)
    assert np.allclose(cal.table(), cal.prior)  # nothing seen: confidence at face value
    steps = []
    for _ in range(12):
        confs, accepted = [], []
        for _ in range(4):
            k = int(rng.integers(1, 6))
            row = rng.uniform(0, 1, k) ** 0.5
            row[rng.uniform(size=k) < 0.2] = np.nan  # depths the stop did not read
            confs.append(row.tolist())
            accepted.append(int(rng.integers(0, k + 1)))
        steps.append((confs, accepted))
        cal.observe(confs, accepted)
    want = _reference_calibration(steps, list(CALIBRATION_EDGES), 3.0, 0.9)
    assert np.allclose(cal.table(), want)
    # The device table buckets as the host does, at the edges too.
    edges, table = cal.device_table(torch.device("cpu"))
    probe = torch.tensor([0.0, 0.05, 0.0500001, 0.5, 0.95, 0.951, 1.0])
    got = table[torch.bucketize(probe, edges)].double().numpy()
    assert np.allclose(got, cal.table()[cal.bins(probe.numpy())], atol=1e-6)


def test_cost_stop_reads_the_confidence_through_the_calibration():
    # A draft that is right nearly always but only ~35% sure of its tokens (the MTP
    # fixture): at face value the cost stop ends every draft after one token; through a
    # calibration that has seen those tokens accepted, it drafts to the planned length.
    rows, k = 3, 6
    caps = torch.tensor([6, 4, 6])
    rates = torch.full((rows, k), 0.98)
    cal = ConfidenceCalibration()
    for _ in range(50):
        cal.observe([[0.35] * 6] * 3, [6, 6, 6])
    lengths = {}
    for name, calibration in (("face value", None), ("calibrated", cal.device_table(
            torch.device("cpu")))):
        rule = CostStop(ConfidenceStop(0.0, max_tokens=k), caps, rates, threshold=0.3,
                        calibration=calibration)
        state = rule.start(rows, torch.device("cpu"))
        live, depth, got = torch.arange(rows), 0, torch.zeros(rows, dtype=torch.int64)
        while True:
            got[live] = depth + 1
            if depth + 1 >= k:
                break
            new, keep = rule.step(state[live], depth,
                                  next_token_probs=torch.full((len(live),), 0.35))
            state[live] = new
            live = live[keep]
            if live.numel() == 0:
                break
            depth += 1
        lengths[name] = torch.minimum(got, rule.row_caps).tolist()
        read = rule.confidences(state)
        # The raw confidence of every token the stop judged, NaN past each row's end.
        for r, n in enumerate(lengths[name]):
            assert torch.allclose(read[r, :n - 1], torch.tensor(0.35))
            assert torch.isnan(read[r, n:]).all()
    assert lengths["face value"] == [2, 2, 2]
    assert lengths["calibrated"] == [6, 4, 6]
