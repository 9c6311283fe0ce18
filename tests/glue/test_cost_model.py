"""``glue/cost_model.py``: the online cost model recovers the costs a scripted clock
charges, ignores idle gaps and prefill steps, and the control learns each request's
acceptance from the rejected counts and plans zero for a request whose drafts fail."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from vllm_specx.algorithms.draft_length import StepCosts, choose_draft_lengths
from vllm_specx.algorithms.draft_stop import AlwaysContinue, ConfidenceStop
from vllm_specx.glue.cost_model import CostControl, MeasuredCosts, probe_could_pay


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _started() -> tuple[MeasuredCosts, Clock]:
    """A model on a scripted clock whose first round has ended (nothing before it to
    time): each test's steps start from here."""
    clock = Clock()
    model = MeasuredCosts(clock)
    model.round_ends(False, 0, 0)
    return model, clock


TRUE = StepCosts(target_base=0.010, target_per_request=0.0005, target_per_token=0.001,
                 draft_pass=0.002, draft_row=0.0002, draft_round=0.001)


# What the target side pays for verifying anything at all (the verification path): the
# model folds it into the "anyone drafts" cost.
ANY_VERIFIED = 0.0007


def _random_target_side(rng: np.random.Generator) -> tuple[int, int, float]:
    """A step of 1-8 requests verifying 0 (half the time) to 4 per request draft tokens,
    and what its target side costs: TRUE's time plus ANY_VERIFIED when it verifies any."""
    b = int(rng.integers(1, 9))
    s = int(rng.integers(1, 4 * b + 1)) if rng.random() < 0.5 else 0
    return b, s, float(TRUE.target(b, s)) + (ANY_VERIFIED if s else 0.0)


def _steps(model: MeasuredCosts, clock: Clock, n: int, rng: np.random.Generator,
           in_interval: Callable[[int], None] | None = None,
           in_round: Callable[[int], None] | None = None) -> None:
    """``n`` steps of varying batch and lengths (half of them verifying nothing), each
    costing exactly TRUE's times plus ANY_VERIFIED when it verifies drafts.
    ``in_interval(i)`` / ``in_round(i)``: run at the end of step ``i``'s target side /
    round (a catch-up the test scripts there)."""
    for i in range(n):
        b, s, seconds = _random_target_side(rng)
        clock.now += seconds
        if in_interval is not None:
            in_interval(i)
        model.round_begins(b, s)
        passes = int(rng.integers(0, 4))
        rows = passes * int(rng.integers(1, b + 1))
        clock.now += TRUE.draft_round + TRUE.draft_pass * passes + TRUE.draft_row * rows
        if in_round is not None:
            in_round(i)
        model.round_ends(True, passes, rows)


def test_measured_costs_recover_the_scripted_costs():
    clock = Clock()
    model = MeasuredCosts(clock)
    before = model.step_costs()  # the prior before anything is measured: sane, positive
    assert before.target_base > 0 and before.target_per_token > 0
    model.round_ends(False, 0, 0)  # the first round: nothing to time before it
    _steps(model, clock, 200, np.random.default_rng(0))
    got = model.step_costs()
    for name in ("target_base", "target_per_request", "target_per_token", "draft_pass",
                 "draft_row"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.05, abs=2e-5)
    # Verifying anything costs the target ANY_VERIFIED once: priced with the round's
    # "anyone drafts", not spread over the draft tokens (within the prior's pull on a
    # term the data pin down less well than the others: it is 7% of a step).
    assert got.draft_round == pytest.approx(TRUE.draft_round + ANY_VERIFIED, rel=0.1)
    assert model.describe()["target_ms"]["any_verified"] == pytest.approx(
        1e3 * ANY_VERIFIED, rel=0.2)
    # An idle gap between two generate calls is not a step; a prefill step is not used.
    count = model.target.count
    clock.now += 5.0
    model.round_begins(4, 4)
    model.round_ends(True, 0, 0)
    model.round_begins(4, None)
    assert model.target.count == count and model.skipped == 2
    # A step that ran no round (vLLM asked for K = 0): the interval after it is not used.
    model.round_ends(True, 0, 0)
    model.forget_interval()
    clock.now += 0.05
    model.round_begins(4, 4)
    assert model.target.count == count
    assert model.describe()["source"] == "measured online"


def test_control_learns_acceptance_and_plans_zero_for_failing_drafts():
    control = CostControl(4)
    control.fixed_costs = StepCosts(1.0, 0.0, 0.15, 0.05, 0.02)
    inner = ConfidenceStop(0.0, max_tokens=4)
    ids = ("good", "bad")
    # A request's own counts weigh against 12 pseudo-observations of the pooled rate
    # (here 0.5) over a window of about 33 drafts: "bad" needs a few dozen straight
    # rejections to go below the 0.15 a token must be accepted at to pay.
    for _ in range(100):
        control.begin(ids, torch.tensor([0, 4]), None)  # "good" keeps all, "bad" none
        plan = control.plan(ids, 4, inner, torch.device("cpu"))
        control.end(ids, [4, 4], 3, 6)  # as if both had drafted 4
    assert plan.caps.tolist()[0] > 0 and plan.caps.tolist()[1] == 0
    assert control.describe()["partial_zero_steps"] > 0


def test_a_retired_request_is_planned_nothing_however_good_its_drafts():
    # DraftKVHoles.retired: requests whose draft KV upkeep stopped. Both requests' drafts
    # are always accepted and drafting is cheap; the retired one is planned zero by the
    # chain plan and the beam depth plan alike, and probes nothing.
    retired: set[str] = set()
    control = CostControl(4, retired=lambda: retired)
    control.fixed_costs = StepCosts(1.0, 0.0, 0.05, 0.05, 0.02)
    inner = ConfidenceStop(0.0, max_tokens=4)
    ids = ("a", "b")
    for step in range(3 * control.history.probe_interval):
        if step == 5:
            retired.add("b")
        control.begin(ids, torch.tensor([0, 0]), None)
        caps = control.plan(ids, 4, inner, torch.device("cpu")).caps.tolist()
        depths = control.plan_depths(ids, 4, 1).tolist()
        assert caps[0] > 0 and depths[0] > 0
        assert (caps[1] > 0, depths[1] > 0) == (step < 5, step < 5)
        control.end(ids, caps, 3, sum(caps))


@pytest.mark.parametrize("num_reqs", [1, 3, 8])
def test_a_batch_of_retired_requests_plans_what_the_full_choice_plans(num_reqs):
    # When every request is retired the control skips the weighing (its host time ran on
    # every step of such a batch); what it returns must be the exact choice's for zero
    # rates at the same costs: lengths, rate, expected tokens and step time, no probes,
    # and the same counts.
    from vllm_specx.glue.cost_model import MIN_PLAN_GAIN

    rng = np.random.default_rng(num_reqs)
    ids = tuple(f"r{i}" for i in range(num_reqs))
    compared = 0
    for _ in range(20):
        costs = StepCosts(*rng.uniform(0.0, 1.0, size=5), draft_round=rng.uniform(0, 1),
                          skip_debt=rng.uniform(0, 0.1))
        control = CostControl(4, retired=lambda: set(ids))
        control.fixed_costs = costs
        control.history.probe_interval = 1  # every request due a probe: none may probe
        rates, got_costs, choice, caps = control._choose(ids, 4)
        assert got_costs is costs and not rates.any() and rates.shape == (num_reqs, 4)
        assert choice.lengths.tolist() == caps.tolist() == [0] * num_reqs
        # The plain step by StepCosts' own definition: one token per request.
        plain = costs.step_time([0] * num_reqs)
        assert choice.step_time == pytest.approx(plain)
        assert choice.expected_tokens == pytest.approx(num_reqs)
        assert choice.rate == pytest.approx(num_reqs / plain)
        want = choose_draft_lengths(np.zeros((num_reqs, 4)), costs, min_gain=MIN_PLAN_GAIN)
        if not want.lengths.any():
            # The exact choice drafts nothing too (it may draft a worthless token only to
            # avoid a skip's debt, which a retired request never leaves): the same choice.
            assert choice.rate == pytest.approx(want.rate)
            assert choice.expected_tokens == pytest.approx(want.expected_tokens)
            assert choice.step_time == pytest.approx(want.step_time)
            compared += 1
        plan = control.plan(ids, 4, ConfidenceStop(0.0, max_tokens=4), torch.device("cpu"))
        assert not plan.caps.any()
        d = control.describe()
        assert (d["steps"], d["all_zero_steps"], d["probes"]) == (2, 2, 0)
        assert control.retires_arrivals(num_reqs, 2) == (not control.sure_token_pays(num_reqs))
    assert compared >= 10


def test_control_learns_nothing_from_a_step_that_did_not_verify_the_drafts():
    # Round 1 drafts 4 for each; the next step verifies none of them (vLLM ran a step
    # without a round, or dropped the drafts): 2 requests, 2 target tokens, no rejections.
    # That must not read as 8 accepted drafts.
    control = CostControl(4)
    ids = ("a", "b")
    control.begin(ids, torch.tensor([0, 0]), 2)
    control.plan(ids, 4, ConfidenceStop(0.0, max_tokens=4), torch.device("cpu"))
    control.end(ids, [4, 4], 3, 6)
    before = control.history.pooled_rates().copy()
    control.begin(ids, torch.tensor([0, 0]), 2)
    assert np.array_equal(control.history.pooled_rates(), before)
    # The drafts verified as drafted (2 + 8 target tokens): learned.
    control.begin(ids, torch.tensor([0, 0]), 10)
    assert (control.history.pooled_rates() > before).all()


class _DeviceCounts:
    """Rejected counts that record every read of them to the host (on a GPU each read
    waits for the step that produced them)."""

    def __init__(self, values: list[int]) -> None:
        self.values = torch.tensor(values)
        self.reads = 0

    def to(self, device: str) -> torch.Tensor:
        self.reads += 1
        return self.values.to(device)


def test_control_reads_no_rejected_counts_after_a_step_without_drafts():
    control = CostControl(4)
    ids = ("a", "b")
    counts = _DeviceCounts([0, 0])
    for _ in range(5):  # nobody drafted: a plain decode step, nothing to learn
        control.begin(ids, counts, 2)
        control.end(ids, [0, 0], 0, 0)
    assert counts.reads == 0
    control.end(ids, [0, 2], 1, 1)  # "b" drafted two tokens: they must be read
    before = control.history.pooled_rates().copy()
    control.begin(ids, counts, 4)
    assert counts.reads == 1
    assert (control.history.pooled_rates()[:2] > before[:2]).all()


def test_control_calibrates_the_confidence_from_verified_drafts():
    # The cost stop read 0.35 for every token; the target accepted them all, step after
    # step: the plan's stop then reads 0.35 as an acceptance near 1. The last token of
    # each round (no read: NaN) and tokens past a rejection teach nothing.
    control = CostControl(4)
    control.fixed_costs = StepCosts(1.0, 0.0, 0.15, 0.05, 0.02)
    inner = ConfidenceStop(0.0, max_tokens=4)
    ids = ("a", "b")
    nan = float("nan")
    control.begin(ids, torch.tensor([0, 0]), None)
    for _ in range(40):
        plan = control.plan(ids, 4, inner, torch.device("cpu"))
        control.end(ids, [4, 4], 3, 6, torch.tensor([[0.35, 0.35, 0.35, nan]] * 2))
        control.begin(ids, torch.tensor([0, 0]), 10)
    table = control.calibration.table()
    b = int(control.calibration.bins(np.array([0.35]))[0])
    assert table[b] > 0.9 and control.calibration.tried.sum() == pytest.approx(
        control.calibration.tried[b])
    plan = control.plan(ids, 4, inner, torch.device("cpu"))
    edges, got = plan.rule.calibration
    assert float(got[torch.bucketize(torch.tensor(0.35), edges)]) == pytest.approx(table[b])
    # Rounds whose drafts are all rejected at the first token (only that token is judged,
    # two per step against six before): the bin follows within the decay's window.
    for _ in range(150):
        control.end(ids, [4, 4], 3, 6, torch.tensor([[0.35, 0.35, 0.35, nan]] * 2))
        control.begin(ids, torch.tensor([4, 4]), 10)
    assert control.calibration.table()[b] < 0.2
    assert "confidence_calibration" in control.describe()


def test_bench_report_prints_the_cost_model():
    from vllm_specx.bench.report import markdown_table

    clock = Clock()
    control = CostControl(4)
    control.costs = MeasuredCosts(clock)
    control.costs.round_ends(False, 0, 0)
    _steps(control.costs, clock, 20, np.random.default_rng(1))
    report = {"configs": [{"name": "adaptive cc", "method": "adaptive",
                           "drafter_stats": {"cost_control": control.describe()}}]}
    table = markdown_table(report)
    line = next(x for x in table.splitlines() if x.startswith("- cost control of adaptive cc"))
    assert "ms per draft token verified" in line and "measured online, 20 steps" in line
    assert "ms every round (drafting or not)" in line
    assert "retired" not in line  # none retired: not said
    assert "catch up" not in line  # nothing caught up: no skip prices said
    for positions in (1, 1, 8, 16):  # 3 ms a pass + 0.2 ms a position
        control.costs.exclude(0.003 + 0.0002 * positions, positions=positions)
    line = next(x for x in markdown_table(
        {"configs": [{"name": "adaptive cc", "method": "adaptive",
                      "drafter_stats": {"cost_control": control.describe()}}]}).splitlines()
        if x.startswith("- cost control of adaptive cc"))
    assert ("0.200 ms per request to catch up a skipped first pass (a catch-up pass: 3.000 "
            "ms fixed, not charged)") in line
    stats = {**control.describe(),
             "idle_first_pass": {"retired_requests": 7, "retire_after": 48}}
    report["configs"][0]["drafter_stats"]["cost_control"] = stats
    line = next(x for x in markdown_table(report).splitlines()
                if x.startswith("- cost control of adaptive cc"))
    assert "7 requests retired from drafting (idle for 48 skipped steps in a row" in line
    stats["idle_first_pass"].update(retired_on_arrival=5, retired_idle_batch=1,
                                    retire_idle_batch_after=16)
    line = next(x for x in markdown_table(report).splitlines()
                if x.startswith("- cost control of adaptive cc"))
    assert ("7 requests retired from drafting (5 on arrival and 1 with their batch, once 16 "
            "plans in a row drafted nothing and not even a sure draft token paid; the rest "
            "idle for 48 skipped steps in a row") in line


def test_cpu_backend_times_steps_by_this_process_cpu_time():
    # Another job holding the host's cores makes this process wait, not work: on the CPU
    # backend's clock a wait costs (almost) nothing, so it is not read as the cost of
    # drafting. The GPU backend keeps wall time (the host waits for the device there).
    import time

    from vllm_specx.backends import backend_for_device
    from vllm_specx.glue.cost_model import engine_step_clock

    clock = engine_step_clock()  # what the controls get on this (CPU) platform
    assert clock is backend_for_device("cpu").cost_clock
    t0 = clock()
    time.sleep(0.3)
    assert clock() - t0 < 0.1
    assert backend_for_device("cuda").cost_clock is time.perf_counter


@pytest.mark.parametrize("cheap", [True, False])
def test_control_probes_only_where_a_sure_token_would_pay(cheap):
    # Every draft fails, so both requests are planned at zero and become due a probe.
    # Where verifying one token costs little against the step (a small batch), a due
    # request probes; where even a token certain to be accepted costs more than the step
    # earns per token (the round's fixed cost, 30 steps' worth here: a large batch on a
    # CPU), nobody probes, however long they have been idle.
    control = CostControl(4)
    control.fixed_costs = (StepCosts(1.0, 0.0, 0.05, 0.05, 0.02, draft_round=0.05) if cheap
                           else StepCosts(1.0, 0.0, 0.05, 0.05, 0.02, draft_round=30.0))
    inner = ConfidenceStop(0.0, max_tokens=4)
    ids = ("a", "b")
    probed = 0
    for _ in range(3 * control.history.probe_interval):
        control.begin(ids, torch.tensor([1, 1]), None)
        control.history.observe_many(ids, [1, 1], [0, 0])
        plan = control.plan(ids, 4, inner, torch.device("cpu"))
        # A request that drafts at all drafts one token, which fails (the rejected count
        # of 1 above); the caps of a confidence rule are "may draft" (up to K), not lengths.
        drafted = (plan.caps > 0).long()
        probed += int(drafted.sum())
        control.end(ids, drafted.tolist(), 0, 0)
    assert (probed > 0) == cheap
    assert (control.describe()["probes"] > 0) == cheap


def test_a_request_whose_probes_fail_at_batch_1_goes_idle_long_enough_to_retire():
    # Batch 1 with cheap drafting (a sure token pays, so probes are always allowed) and
    # every draft rejected: the probes back off until an idle run reaches the skipped
    # steps after which DraftKVHoles retires a request. Without the back-off a probe every
    # probe_interval steps reset the run and the request never retired.
    from vllm_specx.glue.draft_passes import DraftKVHoles

    control = CostControl(4)
    control.fixed_costs = StepCosts(1.0, 0.0, 0.05, 0.05, 0.02, draft_round=0.05)
    inner = ConfidenceStop(0.0, max_tokens=4)
    ids = ("a",)
    idle_run, longest, probes, drafted = 0, 0, 0, [0]
    for _ in range(8 * DraftKVHoles.retire_after):
        control.begin(ids, torch.tensor([1]), None)
        control.history.observe_many(ids, drafted, [0])
        plan = control.plan(ids, 4, inner, torch.device("cpu"))
        drafted = (plan.caps > 0).long().tolist()
        probes += drafted[0]
        idle_run = 0 if drafted[0] else idle_run + 1
        longest = max(longest, idle_run)
        control.end(ids, drafted, 0, 0)
    assert probes >= 2 and longest >= DraftKVHoles.retire_after


def test_nonnegative_fit_equals_a_reference_nnls():
    # The exact subset search against SciPy's NNLS on the same least-squares problem.
    optimize = pytest.importorskip("scipy.optimize")
    from vllm_specx.glue.cost_model import _nonnegative_least_squares

    rng = np.random.default_rng(0)
    for _ in range(100):
        x, y = rng.normal(size=(30, 4)), rng.normal(size=30)
        ref, _ = optimize.nnls(x, y)
        assert _nonnegative_least_squares(x.T @ x, x.T @ y) == pytest.approx(ref, abs=1e-8)
        # The last fit's free set, tried first, is kept only where it is the optimum:
        # the reference's own free set, any other, or none.
        for hint in (ref > 0, rng.random(4) < 0.5, np.zeros(4, dtype=bool)):
            assert _nonnegative_least_squares(x.T @ x, x.T @ y, hint) == pytest.approx(
                ref, abs=1e-8)


def test_fit_prices_a_verified_token_without_blowing_up_nearly_collinear_terms():
    # Batch 1: nearly every step verifies one draft token, where S and [S > 0] are the
    # same column. With noisy step times the unconstrained fit gives them large opposite
    # coefficients; dropping the negative one and keeping the other priced a verified
    # token at several times its cost. Averaged over seeds, what one verified token costs
    # (per token + any verified) must come out at its true 2.5 ms.
    sums = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        model, clock = _started()
        for _ in range(300):
            u = rng.random()
            s = 1 if u < 0.9 else (0 if u < 0.98 else 2)
            clock.now += 0.070 + 0.001 * s + 0.0015 * (s > 0) + 0.004 * rng.normal()
            model.round_begins(1, s)
            clock.now += 0.007
            model.round_ends(True, 0, 0)
        target = model.describe()["target_ms"]
        assert min(target.values()) >= 0
        sums.append(target["per_draft_token"] + target["any_verified"])
    assert np.mean(sums) == pytest.approx(2.5, abs=0.6)


def test_catch_ups_are_not_counted_as_the_steps_cost():
    # Every other round and every other interval also ran a 30 ms catch-up of skipped
    # first passes (MeasuredCosts.exclude): the fit must still be TRUE's step, since that
    # work is paid whether or not the step drafts.
    model, clock = _started()

    def catch_up(i: int, every_other: int) -> None:
        if i % 2 == every_other:
            clock.now += 0.030
            model.exclude(0.030)

    _steps(model, clock, 200, np.random.default_rng(1),
           in_interval=lambda i: catch_up(i, 1), in_round=lambda i: catch_up(i, 0))
    got = model.step_costs()
    assert got.target_base == pytest.approx(TRUE.target_base, rel=0.05)
    assert got.draft_pass == pytest.approx(TRUE.draft_pass, rel=0.05)
    assert got.draft_round == pytest.approx(TRUE.draft_round + ANY_VERIFIED, rel=0.1)


def test_a_first_step_that_compiled_kernels_sets_no_price():
    # On an H200 the first timed interval took ~400 ms (kernels compiled on first use)
    # where a step took 13 ms. Taken as the prior's scale, it priced what the steps never
    # measured while nobody drafted (verifying a token, a draft pass) at 400 ms-step
    # rates for good. Held with the next two and judged by their median, it is dropped.
    model, clock = _started()
    for i in range(300):
        clock.now += 0.400 if i == 0 else 0.013
        model.round_begins(1, 0)
        model.round_ends(False, 0, 0)
    costs = model.step_costs()
    assert model.skipped == 1
    assert costs.target(1, 0) == pytest.approx(0.013, rel=0.02)
    # Unmeasured terms stay at the prior's share of a 13 ms step: one verified token
    # (per token + verifying anything) and a round with one pass.
    assert costs.target_per_token + costs.verify_fixed < 0.1 * 0.013
    assert costs.draft_round + costs.draft_pass < 0.3 * 0.013


def test_an_interval_far_above_the_median_step_is_dropped_until_they_keep_coming():
    model, clock = _started()

    def step(seconds: float, s: int = 0) -> None:
        clock.now += seconds
        model.round_begins(2, s)
        model.round_ends(s > 0, 0, 0)

    for _ in range(50):
        step(0.010)
    # The first steps that verify drafts compile the verification's kernels: dropped,
    # and drafting keeps the price its own typical steps give it.
    for _ in range(2):
        step(0.300, 1)
    assert model.skipped == 2
    for _ in range(50):
        step(0.011, 1)
    costs = model.step_costs()
    assert costs.target(2, 1) + costs.verify_fixed == pytest.approx(0.011, rel=0.05)
    # Steps that stay six times dearer (a longer context, a loaded GPU) are not outliers:
    # after a few in a row the model follows them (as fast as its forgetting lets it).
    for _ in range(300):
        step(0.060)
    assert model.skipped == 2 + 3
    assert model.step_costs().target(2, 0) == pytest.approx(0.060, rel=0.05)


def test_a_round_far_above_its_prior_cost_is_clipped_not_dropped():
    model, clock = _started()
    for i in range(200):
        clock.now += 0.010
        model.round_begins(1, 1)
        # The first round compiles its kernels (0.5 s); the rest take 1 ms + 1 ms a pass.
        clock.now += 0.5 if i == 3 else 0.002
        model.round_ends(True, 1, 1)
    assert model.rounds_clipped == 1
    assert model.describe()["rounds_clipped"] == 1
    costs = model.step_costs()
    assert costs.draft_pass + costs.draft_row + costs.draft_round - costs.verify_fixed == (
        pytest.approx(0.002, rel=0.1))
    # A drafter dear on every round stays dear: clipped rounds still raise its price.
    for _ in range(200):
        clock.now += 0.010
        model.round_begins(1, 1)
        clock.now += 0.5
        model.round_ends(True, 1, 1)
    costs = model.step_costs()
    assert costs.draft_pass + costs.draft_round - costs.verify_fixed > 0.010


def test_what_every_round_costs_is_not_priced_as_drafting():
    # A round costs 1 ms of host work whether or not anyone drafts (the plan itself), and
    # 5 ms more when somebody does (batch 1, one token, no lookahead pass). Drafting must
    # be priced at the 5 ms it adds: without the constant term the skipped rounds' 1 ms
    # went into "anyone drafts" (real pair, batch 1: 6.97 ms for 5.8 ms measured).
    model, clock = _started()
    rng = np.random.default_rng(2)
    for _ in range(300):
        drafted = rng.random() < 0.4
        clock.now += 0.070
        model.round_begins(1, 0)
        clock.now += 0.001 + (0.005 if drafted else 0.0)
        model.round_ends(drafted, 0, 0)
    costs = model.step_costs()
    assert costs.draft_round - costs.verify_fixed == pytest.approx(0.005, rel=0.05)
    assert model.describe()["round_ms"]["always"] == pytest.approx(1.0, rel=0.1)


def test_intervals_that_measured_no_time_are_not_used():
    # An H200 (V2, adaptive) killed its engine in the first steps: intervals that came out
    # at zero or below (a catch-up left out of an interval that did not hold it) were fitted,
    # the plain step's fitted cost went to zero and the plan divided by it. Such intervals
    # are counted, not observed, and the fit stays the steps' own.
    model, clock = _started()
    # A 1 s catch-up left out of every third interval and every fifth round: more than
    # either holds.
    _steps(model, clock, 60, np.random.default_rng(3),
           in_interval=lambda i: model.exclude(1.0) if i % 3 == 0 else None,
           in_round=lambda i: model.exclude(1.0) if i % 5 == 0 else None)
    # 20 intervals and 11 timed rounds (the first round ends before the first steps set a
    # scale, and is not timed) measured less than nothing.
    assert model.not_positive == 20 + 11 and model.target.count == 60 - 20
    assert model.describe()["first_not_positive_ms"][1] == pytest.approx(1e3)
    got = model.step_costs()
    assert got.target_base == pytest.approx(TRUE.target_base, rel=0.05)
    # Every interval measured no time: the fit is never used below a positive step.
    model, clock = _started()
    for _ in range(10):
        model.exclude(1.0)
        model.round_begins(1, 0)
        model.round_ends(False, 0, 0)
    assert model.target.count == 0 and model.step_costs().target_base > 0
    control = CostControl(4, clock)
    control.costs = model
    control.plan(["a"], 4, ConfidenceStop(0.0, max_tokens=4), torch.device("cpu"))


def test_a_fit_with_no_cost_for_a_plain_step_falls_back_to_the_prior():
    model, clock = _started()
    for _ in range(5):
        clock.now += 0.01
        model.round_begins(1, 0)
        model.round_ends(False, 0, 0)
    model.target._theta = np.zeros(4)  # what a fit of zero-time steps would give
    assert model.step_costs().target_base > 0


def test_a_confidence_rule_decides_the_depth_online_at_the_plans_costs():
    # The plan from acceptance alone says who drafts; with a confidence to read, the round
    # may go up to K for those, stopped by the cost stop, whose shared-pass threshold is
    # the lookahead pass's cost at the plan's rate. Without a confidence (the history
    # signal) the planned lengths stay the caps.
    costs = StepCosts(1.0, 0.0, 0.05, 0.3, 0.02, draft_round=0.05)
    ids = ("a", "b")
    for inner, loose in ((ConfidenceStop(0.0, max_tokens=4), True), (AlwaysContinue(4), False)):
        control = CostControl(4)
        control.fixed_costs = costs
        control.history.observe_many(ids, [1, 1], [1, 0])  # "a" accepted, "b" did not
        plan = control.plan(ids, 4, inner, torch.device("cpu"))
        planned = control.stats.planned_tokens
        assert 0 < planned < 8  # the plan drafts, but not K for both
        if loose:
            assert plan.caps.tolist() == [4 if c else 0 for c in plan.caps.tolist()]
            assert plan.rule.pass_threshold == pytest.approx(plan.rate * costs.draft_pass)
        else:
            assert int(plan.caps.sum()) == planned
            assert plan.rule.pass_threshold == 0.0


def test_a_skipped_first_pass_is_priced_with_the_catch_up_it_leaves():
    # Skipping the first pass while nobody drafts does not save writing that position's
    # draft KV: a later catch-up writes it (left out of the step's time). What that costs
    # per position is what a skipped step leaves behind per request, so a plan whose
    # drafting barely loses against a free skip drafts once the skip is priced.
    model, clock = _started()
    for i in range(21):
        clock.now += 0.010
        model.round_begins(2, 0)
        model.round_ends(False, 0, 0)
        positions = (4, 8, 12)[i % 3]
        # 0.5 ms a position, left out of the interval
        model.exclude(0.0005 * positions, positions=positions)
        clock.now += 0.0005 * positions
    assert model.step_costs().skip_debt == pytest.approx(0.0005)
    assert model.describe()["round_ms"]["skip_debt_per_request"] == pytest.approx(0.5)
    gains = np.array([[0.1], [0.1]])  # two requests, one token each at 0.1 acceptance
    # Drafting: 2.2 tokens for 1.105; skipping: 2 tokens for 1 (free) or 1.02 (priced).
    free_skip = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0, draft_round=0.105)
    priced_skip = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0, draft_round=0.105, skip_debt=0.01)
    assert choose_draft_lengths(gains, free_skip).lengths.tolist() == [0, 0]
    assert choose_draft_lengths(gains, priced_skip).lengths.tolist() == [1, 1]
    # A probe is judged on its own token: the debt it would spare the batch does not make
    # it pay (counted, it set off probes every other step at batch 8).
    dear = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0, draft_round=3.0)
    assert not probe_could_pay(choose_draft_lengths(gains, dear), dear)
    indebted = StepCosts(1.0, 0.0, 0.0, 0.0, 0.0, draft_round=3.0, skip_debt=1.2)
    assert not probe_could_pay(choose_draft_lengths(gains, indebted), indebted)



def test_the_skip_debt_is_a_catch_ups_cost_per_position_not_its_passes():
    # Catch-up passes cost 3 ms each plus 0.2 ms a position, and write 1 to 16 positions:
    # one more skipped step adds positions, not a pass, so it is priced at the slope
    # (0.2 ms), not at the average (which a run of one-position catch-ups drives to 3 ms).
    model, _ = _started()
    rng = np.random.default_rng(2)
    for _ in range(200):
        positions = int(rng.choice([1, 1, 1, 8, 16]))
        model.exclude(0.003 + 0.0002 * positions, positions=positions)
    assert model.step_costs().skip_debt == pytest.approx(0.0002, rel=1e-6)
    assert model.catch_up_seconds / model.catch_up_positions > 0.0005
    # ... and the pass's fixed part (the fit's intercept) is reported, not charged.
    assert model.skip_prices() == pytest.approx((0.0002, 0.003), rel=1e-6)
    assert model.describe()["round_ms"]["catch_up_pass"] == pytest.approx(3.0, rel=1e-6)
    # Passes all of one size say nothing of the slope: the average, as before, and no
    # fixed part.
    same, _ = _started()
    for _ in range(50):
        same.exclude(0.004, positions=8)
    assert same.skip_prices() == pytest.approx((0.0005, 0.0))
    # ... unless a lookahead row is known to cost less: a catch-up's rows are such rows,
    # and the rest of a pass is its fixed part.
    assert same.skip_prices(row_cost=0.0002) == pytest.approx((0.0002, 0.0024))


def test_holes_fed_in_the_first_pass_are_priced_by_their_own_term():
    # A draft model on V1 feeds a hole's positions in front of the next first pass's
    # queries (DraftKVHoles.first_pass_with_holes): rows of a round that runs anyway, a
    # term of the round's fit of their own (not the lookahead rows', which at batch 1
    # move with the passes), and a skipped position costs that term plus its share of the
    # block-end passes that still run apart; no pass is left.
    model, clock = _started()
    rng = np.random.default_rng(5)
    for i in range(300):
        clock.now += 0.010
        model.round_begins(1, 0)
        passes = int(rng.integers(1, 4))
        rows = passes * int(rng.integers(1, 3))
        merged = int(rng.integers(0, 30)) if rng.random() < 0.2 else 0
        model.merged_catch_up(merged)
        clock.now += 0.003 + 0.001 * passes + 0.0002 * rows + 0.00005 * merged
        model.round_ends(True, passes, rows)
        if i % 50 == 0:  # a block-end catch-up pass of 4 positions, 2.4 ms
            model.exclude(0.0024, positions=4)
    costs = model.step_costs()
    assert costs.draft_row == pytest.approx(0.0002, rel=0.05)
    hole = model.describe()["round_ms"]["per_hole_position"] / 1e3
    assert hole == pytest.approx(0.00005, rel=0.1)  # its own term, not a row's
    per, fixed = model.skip_prices(row_cost=costs.draft_row, hole_cost=hole)
    # 6 block-end passes among ~900 merged positions: tens of microseconds a position.
    spread = model.catch_up_seconds / (model.catch_up_positions + model.merged_positions)
    assert 0.0 < spread < 0.0001
    assert per == pytest.approx(hole + spread) and fixed == 0.0
    assert costs.skip_debt == pytest.approx(per, rel=1e-6)
    assert model.describe()["round_ms"]["catch_up_pass"] == 0.0
    # Without merged holes the same block-end passes alone (all of one size) price a
    # position at their average (0.6 ms), or at a row where a row's cost is known.
    alone, _ = _started()
    for _ in range(6):
        alone.exclude(0.0024, positions=4)
    assert alone.skip_prices(row_cost=0.0002)[0] == pytest.approx(0.0002)
    assert alone.skip_prices()[0] == pytest.approx(0.0006)


def test_a_sure_token_pays_exactly_where_its_step_beats_the_plain_step():
    # Reference by definition: one request's one token, certainly accepted, turns a plain
    # step of B tokens into B + 1 tokens for the plain step's time plus that token's
    # verification row and the round's "anyone drafts" cost (the catch-up a skipped step
    # leaves is not counted as spared, as for probes).
    rng = np.random.default_rng(7)
    control = CostControl(4)
    seen = set()
    for _ in range(400):
        base, per_req, per_tok, rnd = rng.uniform(0.01, 2.0, 4)
        control.fixed_costs = costs = StepCosts(base, per_req, per_tok, 0.05, 0.01,
                                                draft_round=rnd,
                                                skip_debt=float(rng.uniform(0, 0.1)))
        b = int(rng.integers(1, 65))
        plain = costs.step_time([0] * b)
        pays = (b + 1) / (plain + per_tok + rnd) > b / plain
        assert control.sure_token_pays(b) == pays
        seen.add(pays)
    assert seen == {True, False}


class _Drafter:
    """What ``DraftKVHoles.admit`` reads of a drafter: its cost control, if any."""

    def __init__(self, control: CostControl | None) -> None:
        self._cost_control = control


def test_requests_arriving_where_no_sure_token_pays_retire_on_arrival():
    from vllm_specx.glue.draft_passes import DraftKVHoles

    holes = DraftKVHoles(block_size=16, prefix_caching=True)
    holes.retire_after = 5
    control = CostControl(4, retired=lambda: holes.retired)
    compute_bound = StepCosts(1.0, 0.02, 2.0, 0.02, 0.01)
    memory_bound = StepCosts(1.0, 0.02, 0.02, 0.02, 0.01)
    control.fixed_costs = compute_bound
    drafter = _Drafter(control)
    # No control yet, then a control that has drafted nothing for too few plans: admitted.
    holes.admit(_Drafter(None), ("a",))
    for _ in range(4):
        assert not control.plan_depths(("a",), 4, 1).any()
    holes.admit(drafter, ("a", "b"))
    assert holes.admitted == {"a", "b"} and not holes.retired
    control.plan_depths(("a", "b"), 4, 1)  # the fifth idle plan in a row
    # Where a sure token pays, nobody retires: new requests are admitted.
    control.fixed_costs = memory_bound
    holes.admit(drafter, ("a", "b", "e"))
    assert holes.admitted == {"a", "b", "e"} and not holes.retired
    # Where none pays, new requests retire at once, and so does the batch they join
    # (nothing could make its requests draft before the batch shrinks).
    control.fixed_costs = compute_bound
    holes.admit(drafter, ("a", "b", "c", "d"))
    assert holes.retired == {"a", "b", "c", "d"}
    assert holes.retired_on_arrival == 2 and holes.retired_idle_batch == 2
    assert holes.as_dict()["retired_on_arrival"] == 2
    assert holes.as_dict()["retired_idle_batch"] == 2
    assert not control.plan_depths(("a", "b", "c", "d"), 4, 1).any()
    # While the plan drafts for someone (cheap drafts here), new requests are admitted
    # whatever a lone sure token would earn; after five idle plans again, retired.
    control.fixed_costs = memory_bound
    assert control.plan_depths(("e",), 4, 1).any()
    control.fixed_costs = compute_bound
    holes.admit(drafter, ("e", "f"))
    assert "f" in holes.admitted and not {"e", "f"} & holes.retired
    for _ in range(5):
        control.plan_depths(("e", "f"), 4, 1)
    holes.admit(drafter, ("e", "f", "g"))
    assert {"e", "f", "g"} <= holes.retired and holes.retired_on_arrival == 3
    assert holes.retired_idle_batch == 4


def test_a_fit_solved_every_few_steps_is_the_every_step_fit_at_those_steps():
    # The engine's controls solve their fits every REFIT_EVERY observations (the solve is
    # the plan's dearest part in a running engine): between solves the last solution is
    # read; at a solve it is exactly the fit of every observation so far.
    from vllm_specx.glue.cost_model import REFIT_EVERY, _Regression

    every, sparse = _Regression(4), _Regression(4, refit_every=REFIT_EVERY)
    prior = np.array([1.0, 0.1, 0.1, 0.1])
    rng = np.random.default_rng(3)
    seen, last = [], prior
    for step in range(1, 4 * REFIT_EVERY + 1):
        x = np.array([1.0, rng.integers(1, 9), rng.integers(0, 5), 1.0])
        y = float(x @ np.array([2.0, 0.3, 0.5, 0.1]) + rng.normal(0, 0.01))
        every.observe(x, y)
        sparse.observe(x, y)
        got = sparse.theta(prior).copy()
        if step == 1 or step % REFIT_EVERY == 1:
            assert np.allclose(got, every.theta(prior))  # solved at this step
            seen.append(step)
        else:
            assert np.array_equal(got, last)  # the last solution, not re-solved
            assert not np.allclose(got, every.theta(prior))
        last = got
    assert len(seen) == 4


def test_the_hosts_drift_is_not_priced_as_verifying():
    # The host's speed drifts over minutes, and where drafting stops and starts in runs
    # (batch 1 near the break-even) the steps that verify drafts fall in other minutes
    # than the plain ones. Real pair, batch 1: a four-term fit with forgetting priced
    # verifying one token at 0 to 4.6 ms as the regimes came and went, where neighbouring
    # steps differed by about 0.4 ms. Here the step's base drifts by +-10% over 600 steps,
    # drafting comes in runs of about 15 steps and only while the host is slow, and
    # verifying one token costs 1.5 ms: the price of verifying must stay near 1.5 ms
    # throughout, and the plain step must read the current speed.
    model, clock = _started()
    rng = np.random.default_rng(7)
    s = 0
    for i in range(1500):
        base = 0.048 * (1.0 + 0.1 * np.sin(2 * np.pi * i / 600))
        if rng.random() < 1 / 15:
            s = 1 - s
        drafts = s if base > 0.048 else 0
        clock.now += base + 0.0015 * drafts + 0.001 * rng.normal()
        model.round_begins(1, drafts)
        clock.now += 0.0005 + 0.0055 * drafts
        model.round_ends(bool(drafts), 0, 0)
        if i >= 300 and i % 50 == 49:
            target = model.describe()["target_ms"]
            verify = target["per_draft_token"] + target["any_verified"]
            assert verify == pytest.approx(1.5, abs=0.5), (i, target)
            assert model.step_costs().target(1, 0) == pytest.approx(base, rel=0.03)


def test_the_slopes_follow_every_block_at_the_engines_refit_cadence():
    # In an engine the fits are solved every REFIT_EVERY steps; the target's slopes learn
    # once per block of steps whose shape changed, and must take each such block when the
    # fit is next solved, not every REFIT_EVERY blocks (hundreds of steps where drafting
    # is sparse): at the same steps the engine's fit equals a fit solved every step.
    from vllm_specx.glue.cost_model import REFIT_EVERY

    clock_a, clock_b = Clock(), Clock()
    sparse, every = MeasuredCosts(clock_a, REFIT_EVERY), MeasuredCosts(clock_b, 1)
    for model in (sparse, every):
        model.round_ends(False, 0, 0)
    rng = np.random.default_rng(11)
    for i in range(400):
        drafts = int(i % 40 == 7)  # one drafting step in every 40: sparse blocks
        seconds = 0.048 + 0.002 * drafts + 0.0005 * rng.normal()
        for model, clock in ((sparse, clock_a), (every, clock_b)):
            clock.now += seconds
            model.round_begins(1, drafts)
            clock.now += 0.0005
            model.round_ends(bool(drafts), 0, 0)
        if i % REFIT_EVERY == REFIT_EVERY - 1:
            got = sparse.target.theta(sparse._prior_target())
            np.testing.assert_allclose(got[1:], every.target.theta(every._prior_target())[1:])


def _idle_regime_verify_price(model: MeasuredCosts, clock: Clock, seed: int) -> float:
    """Batch 1 where the plan is idle: one step in 16 verifies one token (a probe), which
    costs 1 ms more than a plain 43 ms step; the steps' noise is 0.4 ms, and every 50
    steps or so the host slows by 30 ms for 4 steps (on the real pair a CPU-time step of
    43 ms took 50-105 ms for 1-20 steps at a time). The fit's price of verifying one
    token after 1600 steps."""
    rng = np.random.default_rng(seed)
    slow_until = -1
    for i in range(1600):
        if rng.random() < 1 / 50:
            slow_until = i + 4
        drafts = int(i % 16 == 5)
        clock.now += (0.043 + 0.001 * drafts + 0.0004 * rng.normal()
                      + (0.030 if i < slow_until else 0.0))
        model.round_begins(1, drafts)
        clock.now += 0.0005
        model.round_ends(bool(drafts), 0, 0)
    target = model.describe()["target_ms"]
    return target["per_draft_token"] + target["any_verified"]


def test_a_slow_stretch_of_the_host_is_not_priced_as_verifying():
    # Where only probes verify, a least squares over them follows their tail: a slow
    # stretch of the host that takes in a probe priced verifying one token at several
    # times its cost (real pair, batch 1: 3.87 ms for about 1 ms), and the plan stayed
    # idle where drafting paid. Each interval's pull on the slopes is bounded by the
    # steps' noise: the price stays near 1 ms for every seed (a least squares read 0 to
    # 1.98 ms on these seeds).
    for seed in range(12):
        model, clock = _started()
        price = _idle_regime_verify_price(model, clock, seed)
        assert price == pytest.approx(1.0, abs=0.4), (seed, price)


def test_a_price_that_changed_is_learnt_once_the_new_steps_outweigh_the_old():
    # Bounding each interval's pull must not hold back what the steps all say: at batch 1
    # verifying one token costs 1 ms for 640 steps and then 4 ms (noise 0.4 ms). Once the
    # new steps' blocks outweigh the old (the old ones fade by 5% a block), the fit reads
    # the new price: a fit that only moved a bounded amount per block from its last
    # answer would still be creeping towards it.
    model, clock = _started()
    rng = np.random.default_rng(5)
    for i in range(640 + 480):
        drafts = int(rng.random() < 0.5)
        cost = 0.001 if i < 640 else 0.004
        clock.now += 0.043 + cost * drafts + 0.0004 * rng.normal()
        model.round_begins(1, drafts)
        clock.now += 0.0005
        model.round_ends(bool(drafts), 0, 0)
        if i == 639:
            target = model.describe()["target_ms"]
            assert target["per_draft_token"] + target["any_verified"] == pytest.approx(
                1.0, abs=0.2)
    target = model.describe()["target_ms"]
    assert target["per_draft_token"] + target["any_verified"] == pytest.approx(4.0, abs=0.3)
