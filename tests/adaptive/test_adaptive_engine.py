"""`adaptive` in the real vLLM engine (CPU) on the fixture pair.

One plain engine gives the no-speculation outputs, then ONE adaptive engine (K_max = 6,
training-free confidence stop) runs every scenario; the tests assert on the recorded
results. The drafter is wrapped to record, per drafting round, which requests drafted
how many tokens, so the tests can show that lengths really differ inside one batch and
across rounds, and that vLLM's scheduler and metrics saw exactly those lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from engine_requests import (
    counter,
    generate,
    greedy,
    mixed,
    output_ids,
    run_counting_preemptions,
)
from idle_steps import (
    ScriptedMostlyIdleRates,
    check_idle_steps,
    check_retirement,
    run_idle_steps,
    run_retirement,
)

from vllm_specx.algorithms.draft_length import ConfidenceCalibration

pytestmark = pytest.mark.engine

K_MAX = 6
NEW_TOKENS = 40
# KV for about 1000 tokens (target + draft, float32): four requests fit, eight long ones
# do not, so the preemption scenario really preempts.
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=384,
    max_num_seqs=16,
    # The long prompt is prefilled in chunks; 16 short seeded prompts are not (a seeded
    # request prefilled in chunks hits vLLM's CPU generator defect).
    max_num_batched_tokens=128,
    kv_cache_memory_bytes=5 * 2**20,
    skip_tokenizer_init=True,
    disable_log_stats=False,
)
# Statistical check: N_STAT seeded samples of 3 tokens with top-k 3 (27 outcomes).
N_STAT = 800
STAT_TOP_K = 3
STAT_TEMPERATURE = 1.0
HEAD_THRESHOLD = 0.9
SPEC: dict[str, Any] = {
    "method": "adaptive",
    "num_speculative_tokens": K_MAX,
    "confidence_threshold": 0.4,
    # Exact draft counts are asserted: lengths must not follow measured timings. The cost
    # control runs in its own scenarios below, with an injected cost model.
    "cost_control": False,
}
N_STAT_COST = 400


class ScriptedRates:
    """Stands in for the cost control's acceptance history (``history.rates``): request
    ``i`` (by prompt order) looks good on the steps where ``(step + i) % 3 == 0`` and
    hopeless otherwise, and every request looks hopeless on each fourth step and on runs of
    four steps (8-11 of every 16): lengths then change from step to step, some steps draft
    for only some requests and some for none (one, or several in a row: the drafter's
    skipped first passes leave draft KV to catch up), whatever the timing."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.step = 0

    def __call__(self, req_ids: list[str]) -> Any:
        import numpy as np

        self.step += 1
        out = np.full((len(req_ids), self.k), 0.02)
        for row, rid in enumerate(req_ids):
            i = int(rid.rsplit("-", 1)[0]) % 4
            idle = self.step % 4 == 3 or 8 <= self.step % 16 <= 11
            if not idle and (self.step + i) % 3 == 0:
                out[row] = 0.95
        return out


def _inject_cost_control(drafter: Any) -> Any:
    """Turn the drafter's cost control on with a fixed cost model and scripted rates: the
    lengths it picks are then a function of the step count, never of the clock."""
    from vllm_specx.algorithms.draft_length import StepCosts

    drafter.settings["cost_control"] = True
    control = drafter.cost_control(K_MAX)
    # A memory-bound target (a verified draft token costs 2% of a step): a good request's
    # drafts pay up to K at batch 4 and 16, a hopeless one's never.
    control.fixed_costs = StepCosts(target_base=1.0, target_per_request=0.02,
                                    target_per_token=0.02, draft_pass=0.02, draft_row=0.01)
    control.history.rates = ScriptedRates(K_MAX)
    control.history.probe_interval = 10**9  # no probes: zero means zero
    control.calibration = ConfidenceCalibration()  # nothing learnt by earlier runs
    return control


@dataclass
class Round:
    req_ids: list[str]
    lengths: list[int]
    drafts: list[list[int]] = field(default_factory=list)


@dataclass
class Recorder:
    """Wraps the runner's drafter: every round's request ids and draft lengths."""

    runner: Any
    rounds: list[Round] = field(default_factory=list)

    def install(self) -> None:
        drafter = self.runner.drafter
        original = drafter.propose

        def propose(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            ids = [r.rsplit("-", 1)[0] for r in self.runner.input_batch.req_ids[: len(out)]]
            self.rounds.append(Round(ids, [len(d) for d in out],
                                     [[int(t) for t in d] for d in out]))
            return out

        drafter.propose = propose


def _per_pos(llm: Any) -> list[float]:
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return list(m.values)
    return []


def _prompts() -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts

    tok = AutoTokenizer.from_pretrained(str(fixture_model_dirs()[0]))
    texts = heldout_prompts(10)
    enc = [tok(t)["input_ids"][:48] for t in texts]
    long = tok("\n".join(texts[:4]))["input_ids"][:200]  # > 128: chunked prefill
    return {
        "ragged": [enc[0][:7], enc[1][:31], long, enc[2][:15]],
        "short": [e[:12] for e in enc[3:7]],
        "many": [e[:40] for e in enc],  # 10 x (40 + 150) tokens: more than the KV holds
        "stat": [enc[8][:6]],
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixture_model_dirs, fixtures_root

    target, draft = (str(p) for p in fixture_model_dirs())
    prompts = _prompts()
    out: dict[str, Any] = {"prompts": prompts}
    with running_llm(target, **ENGINE_KW) as llm:
        out["plain_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["plain_short"] = output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS)))
        out["plain_many"] = output_ids(generate(llm, prompts["many"], greedy(150)))
        out["plain_stops"] = output_ids(generate(llm, prompts["short"], [
            greedy(1), greedy(2), greedy(5), greedy(K_MAX + 1)]))

    head = str(fixtures_root() / "head")
    spec = {**SPEC, "model": draft, "acceptance_head": head, "stop_threshold": HEAD_THRESHOLD}
    llm = make_llm(target, speculative_config=spec, **ENGINE_KW)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        out["drafter"] = type(runner.drafter).__name__
        out["sampler"] = type(runner.rejection_sampler).__name__
        out["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        out["head_loaded"] = runner.drafter.head is not None
        rec = Recorder(runner)
        rec.install()

        def counted(name: str, fn: Any) -> Any:
            keys = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                    "vllm:spec_decode_num_drafts")
            before = [counter(llm, k) for k in keys]
            pos_before = _per_pos(llm)
            rec.rounds.clear()
            t0 = time.perf_counter()
            result = fn()
            after = [counter(llm, k) for k in keys]
            pos_after = _per_pos(llm)
            pos_before += [0.0] * (len(pos_after) - len(pos_before))
            out[name + "_counts"] = dict(
                drafted=after[0] - before[0], accepted=after[1] - before[1],
                drafts=after[2] - before[2],
                per_pos=[a - b for a, b in zip(pos_after, pos_before)],
            )
            out[name + "_rounds"] = list(rec.rounds)
            out.setdefault("timing", {})[name] = time.perf_counter() - t0
            return result

        # With the acceptance head given in the config (SpecDec++ stop) ...
        out["ragged"] = counted(
            "ragged", lambda: output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS))))
        # ... and from here on with the training-free confidence stop.
        runner.drafter.head = None
        runner.drafter.settings["acceptance_head"] = None
        out["short"] = counted(
            "short", lambda: output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS))))
        # Prefix caching: the same prompts again hit the cache (whole 32-token blocks:
        # the long ragged prompt has several).
        hits = counter(llm, "vllm:prefix_cache_hits")
        out["ragged_again"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["prefix_hits"] = counter(llm, "vllm:prefix_cache_hits") - hits
        out["stops"] = output_ids(generate(llm, prompts["short"], [
            greedy(1), greedy(2), greedy(5), greedy(K_MAX + 1)]))
        out["mixed"] = output_ids(generate(llm, prompts["short"], mixed(NEW_TOKENS)))
        out["mixed_again"] = output_ids(generate(llm, prompts["short"], mixed(NEW_TOKENS)))
        n3 = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16)
        # One prompt: its three children prefill in one step (a seeded request prefilled
        # in chunks hits vLLM's CPU generator defect, docs/upstream-vllm-cpu-adapter-defects.md).
        out["n3"] = [[list(c.token_ids) for c in o.outputs]
                     for o in generate(llm, prompts["short"][:1], n3)]
        out["n3_again"] = [[list(c.token_ids) for c in o.outputs]
                           for o in generate(llm, prompts["short"][:1], n3)]
        for mode in ("sampled", "greedy"):
            runner.drafter.settings["draft_sampling"] = mode
            params = [SamplingParams(temperature=STAT_TEMPERATURE, top_k=STAT_TOP_K,
                                     seed=10_000 * (mode == "greedy") + i, max_tokens=3)
                      for i in range(N_STAT)]
            out["stat_" + mode] = counted("stat_" + mode, lambda params=params: [
                tuple(x) for x in output_ids(generate(llm, prompts["stat"] * N_STAT, params))])
        runner.drafter.settings["draft_sampling"] = "sampled"
        out["many"], out["preemptions"] = run_counting_preemptions(
            llm, lambda: output_ids(generate(llm, prompts["many"], greedy(150))))
        out["stats"] = runner.drafter.specx_stats()
        # Cost control (issue 32) with an injected cost model: lengths change step to
        # step, including steps where nobody drafts and steps where only some do.
        control = _inject_cost_control(runner.drafter)
        # Catch-up passes of at most 3 tokens: longer holes take several passes. Blocks of
        # 4 positions for the hole bookkeeping (the cache's are 32): skipped steps then
        # also catch up the blocks vLLM would cache (more catch-ups, never fewer: the
        # drafts must stay the same).
        runner.drafter.kv_holes().pass_tokens = 3
        # ... in passes of their own (V1 feeds holes inside the next first pass by
        # default: the idle-steps run below checks that way).
        runner.drafter.kv_holes().merge_catch_ups = False
        runner.drafter.kv_holes().block_size = 4
        out["cost_short"] = counted(
            "cost_short", lambda: output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS))))
        out["idle_first_pass"] = dict(runner.drafter.kv_holes().as_dict())
        # The same steps again with every first pass run (the same scripted plans): the
        # drafts must be the same token for token, i.e. the catch-up restored the draft KV
        # the skipped first passes did not write.
        control.history.rates = ScriptedRates(K_MAX)
        # The stop reads confidences through what the first run learnt: start afresh.
        control.calibration = ConfidenceCalibration()
        runner.drafter.skips_idle_first_pass = False
        out["cost_short_no_skip"] = counted(
            "cost_short_no_skip",
            lambda: output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS))))
        del runner.drafter.skips_idle_first_pass
        # Skipped first passes under preemption (the default configuration's draft-KV
        # holes): the same scripted plans with and without skipping, each on an empty
        # prefix cache, on a KV cache too small for the ten requests. Runs of seven
        # all-zero steps, so requests are preempted with a hole open and resume on a
        # skipped step: the resumed request lacks draft KV from where its recomputation
        # starts, which may be before its old hole; and a block cached by a skipped step
        # must hold its draft KV when a resumed request reads it.
        out["idle_many"], out["idle_preemptions"] = run_counting_preemptions(
            llm, lambda: run_idle_steps(llm, runner.drafter, K_MAX, prompts["many"],
                                        greedy(150), fresh_prefix_cache=True,
                                        rates=ScriptedMostlyIdleRates))
        out["retire"] = run_retirement(llm, runner.drafter, K_MAX, prompts["short"],
                                       greedy(NEW_TOKENS))
        out["cost_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["cost_stops"] = output_ids(generate(llm, prompts["short"], [
            greedy(1), greedy(2), greedy(5), greedy(K_MAX + 1)]))
        params = [SamplingParams(temperature=STAT_TEMPERATURE, top_k=STAT_TOP_K,
                                 seed=20_000 + i, max_tokens=3) for i in range(N_STAT_COST)]
        out["stat_cost"] = counted("stat_cost", lambda: [
            tuple(x) for x in output_ids(generate(llm, prompts["stat"] * N_STAT_COST, params))])
        out["cost_stats"] = control.describe()
        # The knob off: the stop rule alone decides again (the injected model would draft
        # nothing on most steps).
        runner.drafter.settings["cost_control"] = False
        out["cost_off"] = counted(
            "cost_off", lambda: output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS))))
    finally:
        shutdown_llm(llm)
    return out


def test_engine_runs_the_specx_components_synchronously(runs):
    assert runs["drafter"] == "AdaptiveProposer"
    assert runs["sampler"] == "SpecxRejectionSampler"
    # Ragged drafts reach the scheduler only with synchronous scheduling.
    assert runs["async_scheduling"] is False


def test_greedy_equals_no_speculation_ragged_prompts_and_chunked_prefill(runs):
    """With the fixture's acceptance head loaded from the config (SpecDec++ stop)."""
    assert runs["head_loaded"]
    assert runs["ragged"] == runs["plain_ragged"]
    c = runs["ragged_counts"]
    assert 0 < c["accepted"] < c["drafted"]  # drafts both accepted and rejected
    lengths = [n for r in runs["ragged_rounds"] for n in r.lengths]
    assert len(set(lengths)) > 1  # the head stops some drafts early, not others


def test_draft_lengths_differ_within_a_batch_and_across_rounds(runs):
    rounds = [r for r in runs["short_rounds"] if len(r.lengths) > 1]
    assert any(len(set(r.lengths)) > 1 for r in rounds)  # one batch, several lengths
    per_request: dict[str, set[int]] = {}
    for r in runs["short_rounds"]:
        for rid, n in zip(r.req_ids, r.lengths):
            per_request.setdefault(rid, set()).add(n)
    # Across rounds, lengths vary for (nearly) every request; a very predictable prompt
    # may keep drafting K_MAX.
    varying = sum(len(v) > 1 for v in per_request.values())
    assert varying >= len(per_request) - 1, per_request
    assert all(1 <= n <= K_MAX for r in runs["short_rounds"] for n in r.lengths)


def test_scheduler_and_metrics_count_exactly_the_drafted_tokens(runs):
    """The four short prompts prefill in one step, so every round's drafts are scheduled
    except each request's last round (drafted after its final token): vLLM's counters
    must equal the recorded ragged lengths, not K_MAX per draft."""
    rounds = runs["short_rounds"]
    last: dict[str, int] = {}
    for i, r in enumerate(rounds):
        for rid in r.req_ids:
            last[rid] = i
    scheduled = [
        n for i, r in enumerate(rounds) for rid, n in zip(r.req_ids, r.lengths)
        if i != last[rid]
    ]
    c = runs["short_counts"]
    assert c["drafted"] == sum(scheduled)
    assert c["drafts"] == len(scheduled)
    assert c["drafted"] < K_MAX * c["drafts"]  # not padded to K_max
    assert sum(c["per_pos"]) == c["accepted"]
    assert len(c["per_pos"]) == K_MAX
    # Acceptance is a prefix: position i+1 is accepted at most as often as position i.
    assert all(a >= b for a, b in zip(c["per_pos"], c["per_pos"][1:]))


def test_prefix_caching_and_preemption_keep_greedy_output(runs):
    assert runs["short"] == runs["plain_short"]
    assert runs["ragged_again"] == runs["plain_ragged"]
    assert runs["prefix_hits"] > 0
    assert runs["preemptions"] > 0, runs["timing"]
    for i, (got, want) in enumerate(zip(runs["many"], runs["plain_many"])):
        assert got == want, (i, got, want)


def test_requests_ending_mid_draft(runs):
    assert runs["stops"] == runs["plain_stops"]
    assert [len(x) for x in runs["stops"]] == [1, 2, 5, K_MAX + 1]


def test_mixed_batch_seeds_and_n(runs):
    greedy_rows = [0, 2]
    for i in greedy_rows:
        assert runs["mixed"][i] == runs["plain_short"][i]
    assert runs["mixed"] == runs["mixed_again"]  # seeded sampled rows reproduce
    assert runs["n3"] == runs["n3_again"]
    for completions in runs["n3"]:
        assert len(completions) == 3 and all(len(c) == 16 for c in completions)
        assert len({tuple(c) for c in completions}) > 1


def test_drafter_stats_report_unpadded_work(runs):
    s = runs["stats"]
    assert s["drafted_tokens"] == s["scheduled_tokens"] > 0
    # The batch shrinks: fewer lookahead rows than a padded batch would run.
    assert 0 < s["lookahead_rows"] < s["padded_lookahead_rows"]
    hist = {int(k): v for k, v in s["length_histogram"].items()}
    assert sum(hist.values()) == s["requests"]
    assert sum(k * v for k, v in hist.items()) == s["drafted_tokens"]


def _exact_three_token_distribution(prompt: list[int]) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3 | prompt) of the target under temperature STAT_TEMPERATURE and top-k
    STAT_TOP_K, enumerated exactly with the Hugging Face model (27 sequences)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specx.fixtures import fixture_model_dirs

    model = AutoModelForCausalLM.from_pretrained(
        str(fixture_model_dirs()[0]), dtype=torch.float32).eval()

    def top(ctx: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        vals, idx = (logits / STAT_TEMPERATURE).topk(STAT_TOP_K)
        probs = vals.softmax(-1)
        return list(zip(idx.tolist(), probs.tolist()))

    dist: dict[tuple[int, ...], float] = {}
    for a, pa in top(prompt):
        for b, pb in top(prompt + [a]):
            for c, pc in top(prompt + [a, b]):
                dist[(a, b, c)] = pa * pb * pc
    return dist


def _chi_square(samples: list, dist: dict) -> tuple[float, list, list]:
    """Pearson chi-square of ``samples`` against the exact ``dist`` (outcomes expected
    fewer than 5 times merged into one cell): (p-value, observed, expected)."""
    from scipy.stats import chisquare

    counts = {k: 0 for k in dist}
    for x in samples:
        counts[x] += 1
    big = [k for k in dist if dist[k] * len(samples) >= 5]
    small = [k for k in dist if k not in big]
    observed = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    expected = [dist[k] * len(samples) for k in big] + (
        [sum(dist[k] for k in small) * len(samples)] if small else [])
    scale = sum(observed) / sum(expected)
    _, p_value = chisquare(observed, [e * scale for e in expected])
    return p_value, observed, expected


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_sampled_output_is_distributed_as_the_target(runs, mode):
    """Chi-square goodness of fit of the engine's 3-token samples against the target's
    exact distribution, with drafts sampled from q (full-q residual) and with greedy
    drafts (one-hot residual). Both verification outcomes must have happened."""
    samples = runs["stat_" + mode]
    c = runs[f"stat_{mode}_counts"]
    assert 0 < c["accepted"] < c["drafted"]
    dist = _exact_three_token_distribution(runs["prompts"]["stat"][0])
    assert set(samples) <= set(dist)  # top-k respected
    p_value, observed, expected = _chi_square(samples, dist)
    assert p_value > 1e-3, (mode, p_value, observed, expected)


def test_cost_control_keeps_greedy_output_while_lengths_change(runs):
    """Cost control on, lengths from an injected cost model and scripted acceptance: steps
    where nobody drafts (plain decode steps), where only some requests draft, lengths that
    change step to step; greedy output equals no speculation, and the scheduler and
    vLLM's counters saw exactly the lengths drafted (zeros included)."""
    assert runs["cost_short"] == runs["plain_short"]
    assert runs["cost_ragged"] == runs["plain_ragged"]
    assert runs["cost_stops"] == runs["plain_stops"]
    rounds = runs["cost_short_rounds"]
    full = [r for r in rounds if len(r.lengths) == 4]
    assert any(not any(r.lengths) for r in full)  # nobody drafts
    assert any(0 in r.lengths and any(r.lengths) for r in full)  # only some do
    assert len({n for r in full for n in r.lengths} - {0}) > 1  # and not one fixed K
    per_request: dict[str, set[int]] = {}
    for r in rounds:
        for rid, n in zip(r.req_ids, r.lengths):
            per_request.setdefault(rid, set()).add(n)
    assert all(len(v) > 1 for v in per_request.values())
    last: dict[str, int] = {}
    for i, r in enumerate(rounds):
        for rid in r.req_ids:
            last[rid] = i
    scheduled = [n for i, r in enumerate(rounds) for rid, n in zip(r.req_ids, r.lengths)
                 if i != last[rid]]
    c = runs["cost_short_counts"]
    assert c["drafted"] == sum(scheduled)
    assert c["drafts"] == sum(n > 0 for n in scheduled)  # a zero-length draft is no draft
    s = runs["cost_stats"]
    assert s["steps"] > 0 and s["all_zero_steps"] > 0 and s["partial_zero_steps"] > 0


def test_steps_where_nobody_drafts_skip_the_drafter_and_catch_its_kv_up(runs):
    """A step where cost control plans no drafts for anyone skips the drafter's first pass
    (a plain decode step); the draft KV it did not write is fed before the next first pass
    that runs. Proof: the drafts of every round, with runs of several skipped steps in
    between, equal token for token those of the same plans with every first pass run
    (without the catch-up they differ), and greedy output equals no speculation."""
    holes = runs["idle_first_pass"]
    assert holes["skipped_first_passes"] > 0
    # Holes of several positions (runs of skipped steps), caught up in passes of at most
    # 3 tokens (pass_tokens), so some holes over several passes.
    assert holes["catch_up_tokens"] > holes["catch_up_passes"] > 0
    assert holes["catch_up_passes"] > holes["catch_up_steps"] > 0
    assert holes["block_end_catch_ups"] > 0
    assert runs["cost_short_no_skip"] == runs["cost_short"] == runs["plain_short"]

    def rounds(name: str) -> list[tuple[list[int], list[list[int]]]]:
        # Request ids relative to the run's first (each generate call numbers afresh).
        first = min(int(i) for r in runs[name] for i in r.req_ids)
        return [([int(i) - first for i in r.req_ids], r.drafts) for r in runs[name]]

    skip, no_skip = rounds("cost_short_rounds"), rounds("cost_short_no_skip_rounds")
    assert sum(not any(d) for _, d in skip) > 1
    assert skip == no_skip


def test_skipped_first_passes_under_preemption(runs):
    """Cost control's all-zero steps (the draft model's first pass skipped, its KV caught
    up by the next first pass that runs, which feeds each hole in front of its request's
    query) while the scheduler preempts: every round's drafts and first-pass output equal
    those of the same plans with every first pass run, and greedy output equals no
    speculation."""
    assert runs["idle_preemptions"] > 0
    check_idle_steps(runs["idle_many"], runs["plain_many"])
    holes = runs["idle_many"]["holes"]
    # First passes that found holes fed them themselves (V1's default), but where the
    # step's tokens left their buffers no room (a recomputation after preemption fills
    # the batch's token budget); the blocks vLLM caches during a run of skips
    # (4-position blocks here) are still caught up by passes of their own.
    assert 2 * holes["merged_catch_ups"] > holes["catch_up_steps"] > 0, holes
    assert holes["block_end_catch_ups"] > 0, holes


def test_a_request_idle_for_long_retires_from_drafting(runs):
    """After ``retire_after`` skipped steps in a row (here 3) a request's draft KV upkeep
    stops and it is planned nothing from then on, though its acceptance says drafting
    would pay again; output equals no speculation, and new requests draft as usual."""
    check_retirement(runs["retire"], runs["plain_short"])


def test_cost_control_keeps_the_sampled_distribution(runs):
    """Chi-square as above, the sampled drafts under the cost control's changing lengths."""
    samples = runs["stat_cost"]
    c = runs["stat_cost_counts"]
    assert 0 < c["accepted"] < c["drafted"]
    dist = _exact_three_token_distribution(runs["prompts"]["stat"][0])
    assert set(samples) <= set(dist)
    p_value, observed, expected = _chi_square(samples, dist)
    assert p_value > 1e-3, (p_value, observed, expected)


def test_cost_control_off_knob(runs):
    """``cost_control: false``: every round drafts at least one token again."""
    assert runs["cost_off"] == runs["plain_short"]
    lengths = [n for r in runs["cost_off_rounds"] for n in r.lengths]
    assert lengths and all(1 <= n <= K_MAX for n in lengths)
