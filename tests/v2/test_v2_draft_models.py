"""``adaptive`` and ``mtad`` on Model Runner V2 (CPU platform, Triton interpreter), on the
fixture pair: greedy output equals no speculation on V2, and the scheduler receives each
request's real (ragged) draft length.

One engine per method, shared by the module. V2 without speculation gives V1's tokens
(``test_v2_harness.py``) and each method on V1 gives V1's no-speculation tokens
(``tests/adaptive``, ``tests/mtad``), so V1 and V2 give the same tokens for these
requests wherever these tests pass.

The ``adaptive`` engine has KV for about 12 blocks of 16 tokens: nine requests (the three
shared prompts, each with three output lengths, so requests end in the middle of an
accepted draft) do not fit at once and the scheduler preempts; the test counts it.
"""

from __future__ import annotations

from typing import Any

import pytest
from v2_cases import DRAFT, GREEDY, PROMPTS

pytestmark = pytest.mark.engine

ADAPTIVE_K = 6
ADAPTIVE = {"method": "adaptive", "model": DRAFT, "num_speculative_tokens": ADAPTIVE_K,
            "confidence_threshold": 0.4, "cost_control": False}  # lengths not from timings
# "cost_control": true (mtad's per-step depth, issue 32) as a user starts it: the runner
# schedules synchronously; the control is off for mtad_run (K every step) and on, with a
# fixed cost model and scripted acceptance, in test_mtad_depth_control_on_v2.
MTAD = {"method": "mtad", "model": DRAFT, "num_speculative_tokens": 3, "num_beams": 2,
        "cost_control": True}
# KV for 4 blocks of 32 tokens (target 4096 + draft 1024 bytes a token in float32): the
# 70-token prompt's request still fits alone (max_model_len); five copies of the 17-token
# prompt start in one block each and need a second one near their 10th output token
# (17 + 10 + K lookahead slots > 32), which four of them cannot all have: preemption.
SMALL_KV = {"kv_cache_memory_bytes": 660_000, "max_model_len": 96,
            "enable_prefix_caching": False}
OUTPUT_LENGTHS = (12, 7, 9)  # 7 and 9: requests end inside a draft (K = 6)


def run_recorded(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]],
                 structured: bool = False) -> dict[str, Any]:
    """Runs in the V2 host: generate, recording every round's draft lengths (the
    speculator's) and the lengths the scheduler received (``take_draft_token_ids``), and
    counting preemptions. ``structured``: generate ``v2_cases.generate_structured``'s
    requests instead (``prompts`` and ``samplings`` unused)."""
    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of

    runner = runner_of(llm)
    speculator = runner.speculator
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    drafted: list[dict[str, int]] = []
    received: list[dict[str, int]] = []
    preemptions = 0
    take_lengths, take_ids = speculator.take_draft_lengths, runner.take_draft_token_ids
    preempt = scheduler._preempt_request

    def lengths_hook() -> Any:
        lengths = take_lengths()
        drafted.append(dict(lengths or {}))
        return lengths

    def ids_hook() -> Any:
        out = take_ids()
        if out is not None:
            received.append({r: len(ids) for r, ids in zip(out.req_ids, out.draft_token_ids)})
        return out

    def preempt_hook(*args: Any, **kwargs: Any) -> Any:
        nonlocal preemptions
        preemptions += 1
        return preempt(*args, **kwargs)

    speculator.take_draft_lengths = lengths_hook
    runner.take_draft_token_ids = ids_hook
    scheduler._preempt_request = preempt_hook
    try:
        if structured:
            from v2_cases import STRUCTURED_MAX_TOKENS, generate_structured

            outputs = generate_structured(llm, STRUCTURED_MAX_TOKENS)
        else:
            outputs = generate_token_ids(llm, prompts, samplings)
    finally:
        del speculator.take_draft_lengths, runner.take_draft_token_ids
        scheduler._preempt_request = preempt
    return {"outputs": outputs, "drafted": drafted, "received": received,
            "preemptions": preemptions, "stats": speculator.specx_stats(),
            "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling}


@pytest.fixture(scope="module")
def adaptive_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("adaptive", speculative_config=ADAPTIVE, **SMALL_KV)
    assert description["speculator"].endswith("AdaptiveV2Speculator"), description
    return v2_host.call("adaptive", f"{__name__}:run_recorded", *_ragged_requests())


def test_adaptive_greedy_equals_no_speculation_on_v2(adaptive_run, v2_reference):
    expected = [v2_reference[1]] * 5 + [ref[:n] for ref in v2_reference for n in OUTPUT_LENGTHS]
    assert adaptive_run["outputs"] == expected
    # The small KV cache really preempted requests in the middle of drafting rounds.
    assert adaptive_run["preemptions"] > 0


def test_adaptive_scheduler_receives_the_ragged_lengths_on_v2(adaptive_run):
    # V2 schedules asynchronously by default; ragged drafts need the scheduler to see
    # each step's drafts before the next step (glue/v2_patches.py).
    assert adaptive_run["async_scheduling"] is False
    drafted, received = adaptive_run["drafted"], adaptive_run["received"]
    assert len(drafted) == len(received) > 0
    # Every step, each request's list as the scheduler got it has the drafted length
    # (V2 alone would give K placeholders to every request).
    assert all(got == lengths for got, lengths in zip(received, drafted) if lengths)
    lengths = [n for step in drafted for n in step.values()]
    assert set(lengths) - {ADAPTIVE_K}, "no round stopped early"
    # Lengths differ inside one batch, not only from round to round.
    assert any(len(set(step.values())) > 1 for step in drafted)
    histogram = adaptive_run["stats"]["length_histogram"]
    assert sum(int(n) * c for n, c in histogram.items()) == sum(lengths)


def run_cost_controlled(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]],
                        structured: bool = False) -> dict[str, Any]:
    """Runs in the V2 host: :func:`run_recorded` with the speculator's cost control on, a
    fixed cost model and scripted acceptance (request ``i`` looks good on the steps where
    ``(step + i) % 3 == 0``, every request hopeless on each fourth step), so lengths
    change step to step, with steps where some or all requests draft zero, whatever the
    timing. ``structured``: :func:`run_recorded`'s structured-output requests."""
    import numpy as np

    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.testing.v2_engine import runner_of

    speculator = runner_of(llm).speculator
    speculator.settings["cost_control"] = True
    control = speculator.cost_control(ADAPTIVE_K)
    control.fixed_costs = StepCosts(1.0, 0.02, 0.02, 0.02, 0.01)
    control.history.probe_interval = 10**9
    step = 0

    def rates(req_ids: list[str]) -> Any:
        nonlocal step
        step += 1
        out = np.full((len(req_ids), ADAPTIVE_K), 0.02)
        for row, rid in enumerate(req_ids):
            if step % 4 != 3 and (step + int(rid.rsplit("-", 1)[0])) % 3 == 0:
                out[row] = 0.95
        return out

    control.history.rates = rates
    try:
        return run_recorded(llm, prompts, samplings, structured)
    finally:
        speculator.settings["cost_control"] = False


def test_adaptive_cost_control_on_v2(adaptive_run, v2_engine, v2_host, v2_reference):
    """Cost control on V2 (the same round as V1): greedy output equals no speculation
    while lengths change step to step, zeros included, the scheduler receives each
    request's real length (zero: no draft), and the steps where nobody drafts skip the
    draft model's first pass (its KV caught up later)."""
    run = v2_host.call("adaptive", f"{__name__}:run_cost_controlled", *_ragged_requests())
    expected = [v2_reference[1]] * 5 + [ref[:n] for ref in v2_reference for n in OUTPUT_LENGTHS]
    assert run["outputs"] == expected
    drafted, received = run["drafted"], run["received"]
    assert all(got == lengths for got, lengths in zip(received, drafted) if lengths)
    steps = [step for step in drafted if len(step) > 1]
    assert any(not any(step.values()) for step in steps)  # nobody drafts
    assert any(0 in step.values() and any(step.values()) for step in steps)  # some do
    assert run["stats"]["cost_control"]["all_zero_steps"] > 0
    # Those steps skipped V2's first pass; the draft KV was caught up (greedy equal above).
    holes = run["stats"]["cost_control"]["idle_first_pass"]
    assert holes["skipped_first_passes"] > 0 and holes["catch_up_tokens"] > 0
    assert run["preemptions"] > 0, run["preemptions"]


def test_adaptive_structured_outputs_on_v2(adaptive_run, v2_host, v2_structured_reference):
    """vLLM's structured outputs (a JSON schema, JSON mode, and an unconstrained request
    per prompt, one batch) under the cost control's ragged lengths on V2: greedy output
    equals no speculation's under the same constraints, token for token. V2 masks the
    logits of every scheduled draft row by the request's grammar and maps the rows through
    the ragged draft counts the scheduler received (V2's grammar kernel runs as the same
    arithmetic in torch here: ``v2_cases.install_grammar_bitmask_stand_in``)."""
    from engine_requests import STRUCTURED_KINDS
    from transformers import AutoTokenizer
    from v2_cases import TARGET

    run = v2_host.call("adaptive", f"{__name__}:run_cost_controlled", [], [], True)
    assert run["outputs"] == v2_structured_reference
    # The grammar reached the reference too: its constrained requests write JSON, which
    # the same prompt unconstrained does not.
    tok = AutoTokenizer.from_pretrained(TARGET)
    n = len(STRUCTURED_KINDS)
    for i in range(len(PROMPTS)):
        rows = dict(zip(STRUCTURED_KINDS, v2_structured_reference[i * n:(i + 1) * n]))
        assert not tok.decode(rows["none"]).lstrip().startswith("{")
        for kind in ("json_schema", "json_object"):
            assert tok.decode(rows[kind]).lstrip().startswith("{"), (kind, tok.decode(rows[kind]))
    drafted, received = run["drafted"], run["received"]
    assert all(got == lengths for got, lengths in zip(received, drafted) if lengths)
    steps = [step for step in drafted if len(step) > 1]
    assert any(not any(step.values()) for step in steps)  # nobody drafts
    assert any(0 in step.values() and any(step.values()) for step in steps)  # some do


def run_idle_preempted(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]]
                       ) -> dict[str, Any]:
    """Runs in the V2 host: tests/idle_steps.py's two runs (the draft model's first pass
    skipped on all-zero steps and caught up later, then every first pass run) under
    runs of seven all-zero steps, on the small KV cache: requests are preempted with a
    hole open and usually resume on a skipped step. Also counts the preemptions."""
    from engine_requests import run_counting_preemptions
    from idle_steps import ScriptedMostlyIdleRates, run_idle_steps
    from vllm import SamplingParams

    from vllm_specx.testing.v2_engine import runner_of

    params = [SamplingParams(**s) for s in samplings]
    idle, preemptions = run_counting_preemptions(llm, lambda: run_idle_steps(
        llm, runner_of(llm).speculator, ADAPTIVE_K, prompts, params,
        rates=ScriptedMostlyIdleRates))
    return {**idle, "preemptions": preemptions}


def test_adaptive_skipped_first_passes_under_preemption_on_v2(adaptive_run, v2_host,
                                                               v2_reference):
    """The draft model's skipped first passes on V2 while the scheduler preempts: every
    round's drafts and first-pass output equal those of the same plans with every first
    pass run, and greedy output equals no speculation."""
    from idle_steps import check_idle_steps

    idle = v2_host.call("adaptive", f"{__name__}:run_idle_preempted", *_ragged_requests())
    assert idle["preemptions"] > 0
    expected = [v2_reference[1]] * 5 + [ref[:n] for ref in v2_reference for n in OUTPUT_LENGTHS]
    check_idle_steps(idle, expected)


def _scripted_depth_control(speculator: Any) -> Any:
    """The mtad speculator's depth control, on afresh, with a fixed cost model and
    scripted acceptance (see :func:`run_mtad`)."""
    import numpy as np

    from vllm_specx.algorithms.draft_length import StepCosts

    k = speculator.num_speculative_tokens
    speculator.settings = {**speculator.settings, "cost_control": True}
    speculator._cost_control = None
    control = speculator.cost_control(k)
    control.fixed_costs = StepCosts(1.0, 0.02, 0.02, 0.02, 0.01)
    control.history.probe_interval = 10**9  # no probes: zero means zero
    step = 0
    first: list[int] = []

    def rates(req_ids: list[str]) -> Any:
        nonlocal step
        step += 1
        phase = step % 5
        if phase in (1, 2):
            return np.full((len(req_ids), k), 0.02)
        # Otherwise each request its own: requests alternate between middling (a depth
        # between 1 and K - 1) and good (depth K), so one step's depths differ.
        ids = np.array([int(str(r).rsplit("-", 1)[0]) for r in req_ids])
        first.append(int(ids.min()))  # ids count on from run to run: relative to the first
        return np.where(((ids - first[0] + step) % 2 == 0)[:, None], 0.97, 0.3) * np.ones(
            (1, k))

    control.history.rates = rates
    return control


def run_mtad(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]],
             depth_control: bool) -> dict[str, Any]:
    """Runs in the V2 host: :func:`run_recorded` on the mtad engine, its depth control off
    (every step drafts K) or on with a fixed cost model and scripted acceptance: every
    request looks hopeless on two steps of each five (depth 0: runs of all-zero steps),
    and on the others every other request (by id, alternating step to step) middling (a
    depth between 1 and K - 1) and the rest good (depth K), whatever the clock does.
    Also returns the control's request-rounds per depth."""
    from vllm_specx.testing.v2_engine import runner_of

    speculator = runner_of(llm).speculator
    configured = speculator.settings["cost_control"]
    control = _scripted_depth_control(speculator) if depth_control else None
    if control is None:
        speculator.settings = {**speculator.settings, "cost_control": False}
        speculator._cost_control = None
    try:
        run = run_recorded(llm, prompts, samplings)
    finally:
        speculator.settings = {**speculator.settings, "cost_control": configured}
        speculator._cost_control = None
    run["configured_cost_control"] = configured
    run["depths"] = {} if control is None else dict(control.stats.depths)
    return run


def run_skipping(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """Runs in the V2 host, on the mtad engine (prefix caching on): the scripted depth
    control of :func:`run_mtad` three times over the same requests, recording every
    drafted round (request index, drafts): with every first pass run
    (``skips_idle_first_pass`` off), skipping the first pass at depth 0 with the draft-KV
    catch-up, and skipping it with a catch-up that writes nothing. Each run's outputs and
    catch-up counters. The prefix cache is reset before each run and after the last
    (whose draft KV is wrong)."""
    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of

    speculator = runner_of(llm).speculator
    configured = speculator.settings["cost_control"]
    draft_round = speculator.draft_round
    holes = speculator.kv_holes()
    rounds: list[Any] = []

    def recorded(start: Any, sampling: Any) -> Any:
        drafts = draft_round(start, sampling)
        first = min(int(r.rsplit("-", 1)[0]) for r in start.req_ids)
        ids = [int(r.rsplit("-", 1)[0]) - first for r in start.req_ids]
        rounds.append((ids, drafts if isinstance(drafts, list) else drafts.tolist()))
        return drafts

    runs: dict[str, Any] = {}
    speculator.draft_round = recorded
    try:
        for mode in ("no_skip", "skip", "skip_no_catch_up"):
            # Every run computes the prompts afresh (no prefix-cache hits): the same
            # steps, and prefill chunks that complete blocks on skipped steps.
            llm.reset_prefix_cache()
            rounds.clear()
            _scripted_depth_control(speculator)
            speculator.skips_idle_first_pass = mode != "no_skip"
            if mode == "skip_no_catch_up":
                holes._catch_up_spans = lambda *args, **kwargs: None
            before = holes.as_dict()
            outputs = generate_token_ids(llm, prompts, samplings)
            after = holes.as_dict()
            runs[mode] = {"outputs": outputs, "rounds": list(rounds),
                          "holes": {k: after[k] - before[k] for k in after}}
    finally:
        del speculator.draft_round, speculator.skips_idle_first_pass
        holes.__dict__.pop("_catch_up_spans", None)
        speculator.settings = {**speculator.settings, "cost_control": configured}
        speculator._cost_control = None
        llm.reset_prefix_cache()
    return runs


@pytest.fixture(scope="module")
def mtad_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("mtad", speculative_config=MTAD)
    assert description["speculator"].endswith("MTADV2Speculator"), description
    return v2_host.call("mtad", f"{__name__}:run_mtad", PROMPTS, [GREEDY] * len(PROMPTS),
                        False)


def _ragged_requests() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Five copies of one prompt (they outgrow the small KV cache: preemption) and each
    shared prompt at each of OUTPUT_LENGTHS (requests end inside a draft)."""
    prompts = [PROMPTS[1]] * 5 + [p for p in PROMPTS for _ in OUTPUT_LENGTHS]
    samplings = [GREEDY] * 5 + [{**GREEDY, "max_tokens": n} for _ in PROMPTS
                                for n in OUTPUT_LENGTHS]
    return prompts, samplings


def test_mtad_greedy_equals_no_speculation_on_v2(mtad_run, v2_reference):
    assert mtad_run["outputs"] == v2_reference
    stats = mtad_run["stats"]
    # Beam search ran with every beam of a depth in one pass (the beams' own KV slots in
    # the scratch region, as on V1) and drafted K for every request.
    assert stats["rounds"] > 0 and stats["sequential_rounds"] == 0
    assert stats["tail_forward_passes"] == (MTAD["num_speculative_tokens"] - 1) * stats["rounds"]
    assert stats["drafted_tokens"] == 3 * stats["requests"]
    assert all(not step for step in mtad_run["drafted"])  # not ragged: K placeholders


def test_mtad_depth_control_on_v2(mtad_run, v2_host, v2_reference):
    """mtad's depth control on Model Runner V2 as on V1 (issue 32): "cost_control": true
    reached the V2 speculator and made the runner schedule synchronously; on, the depth
    changes step to step and request to request in one step (0, between, K), greedy
    output equals no speculation, the scheduler receives every request's own planned
    depth (0: no drafts), and a seeded sampled request in the batch (its q_j rows as deep
    as its depth) completes."""
    assert mtad_run["configured_cost_control"] is True
    assert mtad_run["async_scheduling"] is False
    sampled = {"temperature": 1.0, "top_k": 8, "seed": 3, "max_tokens": 12, "ignore_eos": True}
    prompts = [*PROMPTS, PROMPTS[1]]
    run = v2_host.call("mtad", f"{__name__}:run_mtad", prompts,
                       [GREEDY] * len(PROMPTS) + [sampled], True)
    assert run["outputs"][:len(PROMPTS)] == v2_reference
    assert len(run["outputs"][-1]) == 12
    k = MTAD["num_speculative_tokens"]
    depths = {int(d) for d in run["depths"]}
    assert {0, k} <= depths and depths - {0, k}, run["depths"]
    drafted, received = run["drafted"], run["received"]
    assert len(drafted) == len(received) > 0
    assert all(got == lengths for got, lengths in zip(received, drafted) if lengths)
    # Each request its own depth (several in one step); all-zero steps reach the
    # scheduler as such.
    decode = [step for step in drafted if len(step) == len(prompts)]
    assert sum(len(set(step.values())) >= 2 for step in decode) >= 3, decode
    assert any(not any(step.values()) for step in decode)
    assert {0, k} <= {n for step in decode for n in step.values()} <= depths


# MTAD under preemption with requests ending inside a draft: test_v2_trees.py runs these
# requests on the small KV cache with MTAD's beams verified as a tree (the same V2
# speculator and beam passes; one V2 engine instead of two, for the suite's time budget).


# Sampled drafts: 2-token seeded samples at T = 1, top-k 3 (9 outcomes); the second token
# is verified against the adaptive draft drawn from its warped q (full q rows reach the
# specx sampler by request-state row).
N_STAT = 160
STAT_TOP_K = 3


def sampled_run(llm: Any, prompt: list[int], n: int) -> dict[str, Any]:
    """Runs in the V2 host: seeded samples, the same seeds again, the spec-decode
    counters, and the shape of the draft q the specx sampler read."""
    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of, spec_decode_counters

    params = [dict(temperature=1.0, top_k=STAT_TOP_K, seed=i, max_tokens=2, ignore_eos=True)
              for i in range(n)]
    before = spec_decode_counters(llm)
    samples = generate_token_ids(llm, [prompt] * n, params)
    after = spec_decode_counters(llm)
    q = getattr(runner_of(llm).speculator, "draft_q_by_state", None)
    return {"samples": samples, "again": generate_token_ids(llm, [prompt] * 16, params[:16]),
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "q_shape": None if q is None else list(q.shape)}


def test_adaptive_sampled_drafts_keep_the_target_distribution_on_v2(v2_engine, v2_host):
    from scipy.stats import chisquare
    from test_v2_eagle_family import _exact_two_token_distribution
    from v2_cases import TARGET

    v2_engine("adaptive_stat", speculative_config=ADAPTIVE, max_num_seqs=16)
    prompt = PROMPTS[0]
    run = v2_host.call("adaptive_stat", f"{__name__}:sampled_run", prompt, N_STAT)
    samples = [tuple(t) for t in run["samples"]]
    c = run["counters"]
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"]
    assert run["q_shape"] is not None and len(run["q_shape"]) == 3  # full q per position
    dist = _exact_two_token_distribution(TARGET, prompt)
    assert set(samples) <= set(dist)
    big = [k for k in dist if dist[k] * len(samples) >= 5]
    small = [k for k in dist if k not in big]
    observed = [samples.count(k) for k in big] + (
        [sum(samples.count(k) for k in small)] if small else [])
    expected = [dist[k] * len(samples) for k in big] + (
        [sum(dist[k] for k in small) * len(samples)] if small else [])
    scale = sum(observed) / sum(expected)
    _, p_value = chisquare(observed, [e * scale for e in expected])
    assert p_value > 1e-3, (p_value, observed, expected)
    assert [tuple(t) for t in run["again"]] == samples[:16]  # seeded drafts reproduce


def test_mtad_depth_zero_steps_skip_the_first_pass_on_v2(mtad_run, v2_host, v2_reference):
    """A step whose plan drafts nothing skips V2's first pass (StandaloneARSpeculator's
    pass over the draft model), and the draft KV it did not write is caught up before the
    next first pass that runs, as on V1 (DraftKVHoles over V2's lookahead passes): with
    runs of two all-zero steps (the first two: the 70-token prompt's prefill chunks
    complete 32-token blocks on skipped steps, prefix caching's block-end catch-up) and
    30-token outputs, every drafted round
    equals the round of the same plans with every first pass run, and greedy output
    equals no speculation; with a catch-up that writes nothing the drafts differ."""
    n = 30
    runs = v2_host.call("mtad", f"{__name__}:run_skipping", PROMPTS,
                        [{**GREEDY, "max_tokens": n}] * len(PROMPTS))
    no_skip, skip, broken = runs["no_skip"], runs["skip"], runs["skip_no_catch_up"]
    assert no_skip["holes"]["skipped_first_passes"] == 0
    holes = skip["holes"]
    assert holes["skipped_first_passes"] >= 4
    assert holes["catch_up_tokens"] >= holes["catch_up_passes"] >= holes["catch_up_steps"] > 0
    assert holes["block_end_catch_ups"] > 0
    assert [out[:len(ref)] for out, ref in zip(skip["outputs"], v2_reference)] == v2_reference
    assert skip["outputs"] == no_skip["outputs"] == broken["outputs"]
    assert len(skip["rounds"]) >= 5
    assert skip["rounds"] == no_skip["rounds"]
    assert broken["rounds"] != no_skip["rounds"]
