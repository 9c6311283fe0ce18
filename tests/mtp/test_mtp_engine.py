"""`specx_mtp` in the real vLLM CPU engine on the MTP fixture (DeepSeek-V3 with MLA).

One plain engine gives the no-speculation outputs, then ONE specx_mtp engine (K = 4) runs
every scenario, with the adaptive stop (training-free confidence on the MTP layer's own
distribution) and, for one scenario, with fixed K. The drafter's ``propose`` is wrapped to
record each round's per-request draft lengths.

MLA on vLLM's CPU platform runs without chunked prefill and prefix caching (vLLM turns both
off for MLA models on CPU); those two conditions are covered with the same model as plain
attention in ``test_mtp_engine_plain_attention.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_requests import (
    DraftRoundRecorder,
    counter,
    generate,
    greedy,
    mixed,
    output_ids,
    run_counting_preemptions,
)
from idle_steps import check_idle_steps, run_idle_steps

pytestmark = pytest.mark.engine

K = 4
NEW_TOKENS = 24
# MLA KV: 576 floats per token and layer (3 target layers + the MTP layer): 9 KiB per
# token, so 3 MiB holds about 340 tokens: the "many" prompts (8 x (24 + 64)) do not fit
# at once and the scheduler preempts.
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256,
    max_num_seqs=16,
    kv_cache_memory_bytes=3 * 2**20,
    skip_tokenizer_init=True,
    disable_log_stats=False,
)
SPEC: dict[str, Any] = {
    "method": "specx_mtp",
    "num_speculative_tokens": K,
    "adaptive": True,
    # Exact draft counts are asserted: lengths must not follow measured timings.
    "cost_control": False,
    # confidence_threshold: specx_mtp's default (0.2). The fixture's MTP layer is mostly
    # right but as flat as its target (top probability ~0.25), so at 0.2 some drafts stop
    # after one token and others run to K.
}
N_STAT = 500
STAT_TOP_K = 3


def _prompts() -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import fixtures_root, heldout_prompts

    tok = AutoTokenizer.from_pretrained(str(fixtures_root() / "mtp_target"))
    texts = heldout_prompts(10)
    enc = [tok(t)["input_ids"][:48] for t in texts]
    return {
        "ragged": [enc[0][:5], enc[1][:33], enc[2][:48], enc[3][:17]],
        "short": [e[:12] for e in enc[4:8]],
        "many": [e[:24] for e in enc[:8]],
        "stat": [enc[9][:6]],
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm import SamplingParams

    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixtures_root

    target = str(fixtures_root() / "mtp_target")
    prompts = _prompts()
    out: dict[str, Any] = {"prompts": prompts}
    with running_llm(target, **ENGINE_KW) as llm:
        out["plain_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["plain_short"] = output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS)))
        out["plain_many"] = output_ids(generate(llm, prompts["many"], greedy(64)))
        out["plain_stops"] = output_ids(generate(llm, prompts["short"], [
            greedy(1), greedy(2), greedy(3), greedy(K + 1)]))

    llm = make_llm(target, speculative_config=SPEC, **ENGINE_KW)
    try:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        out["vllm_method"] = config.speculative_config.method
        out["drafter"] = type(runner.drafter).__name__
        out["sampler"] = type(runner.rejection_sampler).__name__
        out["async_scheduling"] = config.scheduler_config.async_scheduling
        out["attention"] = sorted({type(m.impl).__name__ for m in runner.drafter.model.modules()
                                   if hasattr(m, "impl")})
        rec = DraftRoundRecorder(runner)
        rec.install()

        def counted(name: str, fn: Any) -> Any:
            keys = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                    "vllm:spec_decode_num_drafts")
            before = [counter(llm, k) for k in keys]
            rec.rounds.clear()
            rec.req_ids.clear()
            result = fn()
            after = [counter(llm, k) for k in keys]
            out[name + "_counts"] = dict(drafted=after[0] - before[0],
                                         accepted=after[1] - before[1],
                                         drafts=after[2] - before[2])
            out[name + "_rounds"] = [list(r) for r in rec.rounds]
            out[name + "_req_ids"] = [list(r) for r in rec.req_ids]
            return result

        out["ragged"] = counted(
            "ragged", lambda: output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS))))
        out["short"] = counted(
            "short", lambda: output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS))))
        out["stops"] = output_ids(generate(llm, prompts["short"], [
            greedy(1), greedy(2), greedy(3), greedy(K + 1)]))
        out["mixed"] = output_ids(generate(llm, prompts["short"], mixed(NEW_TOKENS)))
        out["mixed_again"] = output_ids(generate(llm, prompts["short"], mixed(NEW_TOKENS)))
        params = [SamplingParams(temperature=1.0, top_k=STAT_TOP_K, seed=i, max_tokens=2)
                  for i in range(N_STAT)]
        out["stat"] = counted("stat", lambda: [
            tuple(x) for x in output_ids(generate(llm, prompts["stat"] * N_STAT, params))])
        out["many"], out["preemptions"] = run_counting_preemptions(
            llm, lambda: output_ids(generate(llm, prompts["many"], greedy(64))))
        out["stats"] = runner.drafter.specx_stats()
        # Cost control forced to plan zero for everyone on runs of steps (issue 32): the
        # MTP layer's first pass is skipped there and caught up later.
        out["idle"] = run_idle_steps(llm, runner.drafter, K, prompts["short"],
                                     greedy(NEW_TOKENS))
        # Holes bounded at 3 positions: steps that would pass it run their first pass.
        out["idle_bounded"] = run_idle_steps(llm, runner.drafter, K, prompts["short"],
                                             greedy(NEW_TOKENS), max_hole=3)
        # Fixed K: the same engine with the adaptive stop switched off.
        runner.drafter.settings["adaptive"] = False
        out["fixed"] = counted(
            "fixed", lambda: output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS))))
    finally:
        shutdown_llm(llm)
    return out


def test_engine_runs_vllm_mtp_drafting_with_the_specx_components(runs):
    assert runs["vllm_method"] == "mtp"
    assert runs["drafter"] == "MtpProposer"
    assert runs["sampler"] == "SpecxRejectionSampler"
    assert runs["async_scheduling"] is False  # ragged drafts reach the scheduler
    assert runs["attention"] == ["CPUMLAImpl"]  # MLA, through the reference MLA decode op


def test_greedy_equals_no_speculation_on_ragged_prompts(runs):
    assert runs["ragged"] == runs["plain_ragged"]
    assert runs["short"] == runs["plain_short"]
    c = runs["ragged_counts"]
    assert 0 < c["accepted"] < c["drafted"]  # the MTP layer is right sometimes, not always


def test_adaptive_stop_drafts_ragged_lengths_and_the_scheduler_sees_them(runs):
    rounds = runs["short_rounds"]
    lengths = [n for r in rounds + runs["ragged_rounds"] for n in r]
    assert all(1 <= n <= K for n in lengths)
    assert len(set(lengths)) > 1  # the stop cuts some drafts short, not others
    # One batch, several lengths:
    assert any(len(set(r)) > 1 for r in rounds + runs["ragged_rounds"] if len(r) > 1)
    c = runs["short_counts"]
    # Every round but each request's last (drafted after its final token) is scheduled.
    last: dict[str, int] = {}
    for i, ids in enumerate(runs["short_req_ids"]):
        for rid in ids:
            last[rid] = i
    scheduled = [n for i, (r, ids) in enumerate(zip(rounds, runs["short_req_ids"]))
                 for n, rid in zip(r, ids) if last[rid] != i]
    assert c["drafted"] == sum(scheduled)
    assert c["drafts"] == len(scheduled)
    assert c["drafted"] < K * c["drafts"]  # not padded to K


def test_steps_where_nobody_drafts_skip_the_mtp_first_pass_and_catch_its_kv_up(runs):
    """specx_mtp with cost control planning zero drafts for every request on runs of
    steps: those steps skip the MTP layer's first pass (keeping the target's final hidden
    states and the tokens it would have read); the next first pass that runs is preceded
    by a catch-up of the layer's KV. Greedy output equals no speculation and every round's
    drafts equal those of the same plans with every first pass run."""
    check_idle_steps(runs["idle"], runs["plain_short"])
    # A bounded hole: some steps were not allowed to skip, the drafts are the same.
    check_idle_steps(runs["idle_bounded"], runs["plain_short"])
    assert runs["idle_bounded"]["holes"]["refused_skips"] > 0
    assert runs["idle_bounded"]["holes"]["skipped_first_passes"] < (
        runs["idle"]["holes"]["skipped_first_passes"])


def test_fixed_k_drafts_k_for_every_request(runs):
    assert runs["fixed"] == runs["plain_ragged"]
    assert {n for r in runs["fixed_rounds"] for n in r} == {K}


def test_requests_ending_mid_draft(runs):
    assert runs["stops"] == runs["plain_stops"]
    assert [len(x) for x in runs["stops"]] == [1, 2, 3, K + 1]


def test_preemption_keeps_greedy_output(runs):
    assert runs["preemptions"] > 0
    for i, (got, want) in enumerate(zip(runs["many"], runs["plain_many"])):
        assert got == want, (i, got, want)


def test_mixed_batch_greedy_rows_exact_and_seeds_reproduce(runs):
    for i in (0, 2):
        assert runs["mixed"][i] == runs["plain_short"][i]
    assert runs["mixed"] == runs["mixed_again"]


def test_drafter_stats_report_a_shrinking_batch(runs):
    s = runs["stats"]
    assert s["drafted_tokens"] == s["scheduled_tokens"] > 0
    assert 0 < s["lookahead_rows"] < s["padded_lookahead_rows"]


def _exact_two_token_distribution(prompt: list[int]) -> dict[tuple[int, int], float]:
    """p(t1, t2 | prompt) of the target at temperature 1, top-k STAT_TOP_K, enumerated
    with the Hugging Face model (9 sequences)."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specx.fixtures import fixtures_root

    model = AutoModelForCausalLM.from_pretrained(
        str(fixtures_root() / "mtp_target"), dtype=torch.float32).eval()

    def top(ctx: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        vals, idx = logits.topk(STAT_TOP_K)
        return list(zip(idx.tolist(), vals.softmax(-1).tolist()))

    return {(a, b): pa * pb for a, pa in top(prompt) for b, pb in top(prompt + [a])}


def test_sampled_output_is_distributed_as_the_target(runs):
    """Chi-square of the engine's seeded 2-token samples against the target's exact
    distribution: one-hot MTP drafts, verified by accept-with-p(x) and the residual
    p without x. Both verification outcomes must have happened."""
    from scipy.stats import chisquare

    c = runs["stat_counts"]
    assert 0 < c["accepted"] < c["drafted"]
    dist = _exact_two_token_distribution(runs["prompts"]["stat"][0])
    samples = runs["stat"]
    assert set(samples) <= set(dist)
    counts = {k: 0 for k in dist}
    for s in samples:
        counts[s] += 1
    big = [k for k in dist if dist[k] * len(samples) >= 5]
    small = [k for k in dist if k not in big]
    observed = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    expected = [dist[k] * len(samples) for k in big] + (
        [sum(dist[k] for k in small) * len(samples)] if small else [])
    scale = sum(observed) / sum(expected)
    _, p_value = chisquare(observed, [e * scale for e in expected])
    assert p_value > 1e-3, (p_value, observed, expected)
