"""EAGLE-3 in the real vLLM CPU engine on the fixture target, with the test head of
``scripts/build_eagle3_fixture.py``.

Three engines: no speculation (the reference outputs), vLLM's own ``eagle3`` (must stay
vLLM's: its drafter and sampler, output equal to no speculation), and ONE
``{"method": "eagle3", "adaptive": true}`` engine (read as ``specx_eagle3``: the chain
drafter over vLLM's ``EagleProposer`` with the specx sampler) that runs every scenario
with chunked prefill (a 150-token prompt in 64-token chunks), prefix caching (a repeated
batch) and a KV cache small enough that the scheduler preempts. The engine is configured
with a seeded untrained ``acceptance_head`` on the EAGLE head's hidden state (loaded by the
drafter at start; exactness cannot depend on its quality), used for one scenario; then the
same drafter switches to the default training-free confidence rule for the rest.
"""

from __future__ import annotations

import dataclasses
import time
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
from idle_steps import check_idle_steps, check_retirement, run_idle_steps, run_retirement

pytestmark = pytest.mark.engine

K = 4
NEW_TOKENS = 24
# Fixture KV: (4 target layers + the head's layer) x K and V x 2 KV heads x 64 x 4 bytes
# = 5 KiB per token, so 2 MiB holds about 400 tokens: the "many" batch (8 x (24 + 64))
# does not fit at once and the scheduler preempts.
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256,
    max_num_seqs=16,
    max_num_batched_tokens=64,  # the 150-token prompt is prefilled in 3 chunks
    enable_prefix_caching=True,
    kv_cache_memory_bytes=2 * 2**20,
    skip_tokenizer_init=True,
    disable_log_stats=False,
)
N_STAT = 400
# The preemption scenario under forced all-zero steps: 8 x (24 + 100) tokens > the KV.
IDLE_MANY_TOKENS = 100
STAT_TOP_K = 3
# The trees: 8 nodes (vLLM's K = 8); a static tree whose rank-0 path is 4 deep, with a
# rank-1 branch fed along with it (so a node seeing a wrong ancestor, or sitting at a wrong
# position, drafts another token than the chain).
DYNAMIC_TREE = {"max_nodes": 8, "max_depth": 4, "branching": 2}
STATIC_PATHS = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]
COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_drafts")


def _prompts(target: str) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts

    tok = AutoTokenizer.from_pretrained(target)
    texts = heldout_prompts(12)
    enc = [tok(t)["input_ids"][:48] for t in texts]
    return {
        "ragged": [enc[0][:5], enc[1][:33], enc[2][:48], enc[3][:17]],
        "long": [tok("\n".join(texts[:4]))["input_ids"][:150], enc[4][:40], enc[5][:40]],
        "short": [e[:12] for e in enc[6:10]],
        "many": [e[:24] for e in enc[:8]],
        # Very different lengths in one batch (3 tokens next to 200): batch-invariant
        # attention keeps each request's rows what they are alone.
        "lengths": [tok("\n".join(texts[4:10]))["input_ids"][:200], enc[6][:3],
                    enc[7], enc[8][:12]],
        # A prompt whose 2nd token the test head drafts within the target's top 3 about
        # 70% of the time (both verification outcomes happen).
        "stat": [enc[4][:6]],
    }


@pytest.fixture(scope="module")
def runs(target: str, eagle3_head: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch
    from vllm import SamplingParams

    from vllm_specx.algorithms.acceptance_head import AcceptanceHead, save_head
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm

    prompts = _prompts(target)
    out: dict[str, Any] = {"prompts": prompts}
    with running_llm(target, **ENGINE_KW) as llm:
        out["plain_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["plain_long"] = output_ids(generate(llm, prompts["long"], greedy(NEW_TOKENS)))
        out["plain_short"] = output_ids(generate(llm, prompts["short"], greedy(NEW_TOKENS)))
        out["plain_many"] = output_ids(generate(llm, prompts["many"], greedy(64)))
        out["plain_many_idle"] = output_ids(generate(llm, prompts["many"],
                                                     greedy(IDLE_MANY_TOKENS)))
        out["plain_lengths"] = output_ids(generate(llm, prompts["lengths"], greedy(NEW_TOKENS)))

    vllm_spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K}
    with running_llm(target, speculative_config=vllm_spec, **ENGINE_KW) as llm:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        config = llm.llm_engine.vllm_config
        out["vllm_components"] = (type(runner.drafter).__module__,
                                  type(runner.drafter).__name__,
                                  type(runner.rejection_sampler).__name__)
        out["vllm_additional_config"] = dict(config.additional_config or {})
        out["vllm_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["vllm_drafted"] = counter(llm, COUNTERS[0])

    torch.manual_seed(0)
    head_dir = save_head(AcceptanceHead(256, num_blocks=1),  # the fixture's hidden size
                         tmp_path_factory.mktemp("acceptance_head"))
    # cost_control off: exact draft counts are asserted (lengths must not follow timings).
    spec = {**vllm_spec, "adaptive": True, "acceptance_head": str(head_dir),
            "cost_control": False}
    llm = make_llm(target, speculative_config=spec, **ENGINE_KW)
    try:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        out["method"] = (config.speculative_config.method,
                         config.additional_config["specx"]["method"])
        out["components"] = (type(runner.drafter).__name__,
                             type(runner.rejection_sampler).__name__)
        out["chunked"] = config.scheduler_config.enable_chunked_prefill
        out["async_scheduling"] = config.scheduler_config.async_scheduling
        out["aux_layers"] = runner.use_aux_hidden_state_outputs
        rec = DraftRoundRecorder(runner)
        rec.install()
        drafter = runner.drafter

        def counted(name: str, fn: Any) -> Any:
            before = [counter(llm, k) for k in COUNTERS]
            rec.rounds.clear()
            result = fn()
            after = [counter(llm, k) for k in COUNTERS]
            out[name + "_counts"] = dict(drafted=after[0] - before[0],
                                         accepted=after[1] - before[1],
                                         drafts=after[2] - before[2])
            out[name + "_rounds"] = [list(r) for r in rec.rounds]
            return result

        out["head_stop_rule"] = type(drafter.stop_rule(K)).__name__
        out["head_ragged"] = counted(
            "head_ragged",
            lambda: output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS))))
        # The default stop from here on: the confidence rule.
        drafter.settings.pop("acceptance_head")
        drafter.head = None
        out["confidence_stop_rule"] = type(drafter.stop_rule(K)).__name__
        out["ragged"] = counted(
            "ragged", lambda: output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS))))
        out["long"] = counted(
            "long", lambda: output_ids(generate(llm, prompts["long"], greedy(NEW_TOKENS))))
        hits = counter(llm, "vllm:prefix_cache_hits")
        out["long_again"] = counted(
            "long_again",
            lambda: output_ids(generate(llm, prompts["long"], greedy(NEW_TOKENS))))
        out["prefix_hits"] = counter(llm, "vllm:prefix_cache_hits") - hits
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
        # head's first pass is skipped there and caught up later.
        out["idle"] = run_idle_steps(llm, drafter, K, prompts["short"], greedy(NEW_TOKENS))
        # The same with chunked prefill (the 150-token prompt, its blocks already in the
        # prefix cache for both runs) and with preemption (fewer drafts reserve fewer
        # slots than above, so longer outputs).
        generate(llm, prompts["long"], greedy(NEW_TOKENS))  # the same cache for both runs
        out["idle_long"] = run_idle_steps(llm, drafter, K, prompts["long"], greedy(NEW_TOKENS))
        out["idle_many"], out["idle_preemptions"] = run_counting_preemptions(
            llm, lambda: run_idle_steps(llm, drafter, K, prompts["many"],
                                        greedy(IDLE_MANY_TOKENS)))
        out["retire"] = run_retirement(llm, drafter, K, prompts["short"], greedy(NEW_TOKENS))
    finally:
        shutdown_llm(llm)

    # Draft trees over the head (the knob-only rule: vLLM's eagle3 + draft_tree). One
    # engine: a dynamic EAGLE-2 tree, then a static paths tree on the same drafter.
    # cost_control false: tree sizes are asserted (they must not follow timings); the
    # control's pruning is switched on below with a fixed cost model.
    tree_spec = {**vllm_spec, "draft_tree": DYNAMIC_TREE, "cost_control": False}
    with running_llm(target, speculative_config=tree_spec, **ENGINE_KW) as llm:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        drafter = runner.drafter
        out["tree_method"] = (config.speculative_config.method,
                              config.additional_config["specx"]["method"],
                              config.speculative_config.num_speculative_tokens,
                              type(drafter).__name__)
        out["tree_ragged"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["tree_long"] = output_ids(generate(llm, prompts["long"], greedy(NEW_TOKENS)))
        out["tree_lengths"] = output_ids(generate(llm, prompts["lengths"], greedy(NEW_TOKENS)))
        # Requests that end while a tree is in flight (a few tokens each).
        ends = [greedy(n) for n in (2, 3, 5, 7)]
        out["tree_ends"] = output_ids(generate(llm, prompts["short"], ends))
        out["tree_dynamic_stats"] = dataclasses.replace(runner.specx_tree_state.stats)
        params = [SamplingParams(temperature=1.0, top_k=STAT_TOP_K, seed=i, max_tokens=2)
                  for i in range(N_STAT)]
        out["tree_stat"] = [tuple(x) for x in output_ids(
            generate(llm, prompts["stat"] * N_STAT, params))]
        stats = runner.specx_tree_state.stats
        out["tree_stat_nodes"] = (stats.tree_requests - out["tree_dynamic_stats"].tree_requests,
                                  stats.accepted - out["tree_dynamic_stats"].accepted)
        # Cost control over the same dynamic tree (glue/tree_cost.py), with a fixed cost
        # model under which a node pays only when its path's value exceeds ~0.3 of the
        # step's rate: trees are cut per request, to zero nodes where nothing pays.
        from vllm_specx.algorithms.draft_length import StepCosts
        from vllm_specx.glue.tree_cost import tree_cost_control_for

        drafter.settings = {**drafter.settings, "cost_control": True}
        control = tree_cost_control_for(drafter)
        assert control is not None
        control.fixed_costs = StepCosts(target_base=0.0, target_per_request=1.0,
                                        target_per_token=0.3, draft_pass=0.0, draft_row=0.0)
        began = time.perf_counter()
        out["tree_cost"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["tree_cost_seconds"] = time.perf_counter() - began
        out["tree_cost_control"] = drafter.specx_stats().get("tree_cost_control")
        # Depth 0 on runs of rounds (scripted): those steps skip the head's first pass, and
        # its KV is caught up after tree steps as after chain steps.
        out["tree_idle"] = run_idle_steps(llm, drafter, K, prompts["short"],
                                          greedy(NEW_TOKENS), tree=True)
        # Holes bounded at 3 positions: a step that would pass it runs its first pass and
        # the round chooses its depth after it, as before the skip existed.
        out["tree_idle_bounded"] = run_idle_steps(llm, drafter, K, prompts["short"],
                                                  greedy(NEW_TOKENS), max_hole=3, tree=True)
        drafter.settings = {**drafter.settings, "cost_control": False,
                            "draft_tree": {"paths": STATIC_PATHS}}
        # Each round also drafts the argmax chain over the same first pass (the chain
        # round, before the tree's: the tree's passes rewrite the lookahead KV it used):
        # the tree's rank-0 path must be that chain.
        tree_round = drafter.draft_round
        pairs: list[tuple[list[int], list[int]]] = []

        def both(start: Any, md: Any) -> Any:
            from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound

            chain = super(EagleTreeRound, drafter).draft_round(start, md)
            trees = tree_round(start, md)
            pairs.extend((list(c), list(t)) for c, t in zip(chain, trees))
            return trees

        drafter.draft_round = both
        out["tree_static"] = output_ids(generate(llm, prompts["ragged"], greedy(NEW_TOKENS)))
        out["tree_static_pairs"] = pairs
        out["tree_stats"] = runner.specx_tree_state.stats
    return out


def test_head_tree_cost_control_prunes_and_equals_no_speculation(runs):
    """specx_eagle3 dynamic tree with cost_control on (a fixed cost model): each
    request's tree is cut to the nodes that pay, some to zero nodes (the request verifies
    nothing that step), others kept deeper; greedy output stays equal to no speculation."""
    assert runs["tree_cost"] == runs["plain_ragged"]
    control = runs["tree_cost_control"]
    print("tree cost control:", control, "seconds:", round(runs["tree_cost_seconds"], 1))
    assert control is not None and control["rounds"] > 0
    sizes = {int(k): v for k, v in control["kept_histogram"].items()}
    assert sizes.get(0, 0) > 0, sizes  # pruned to nothing
    assert any(n >= 2 and c > 0 for n, c in sizes.items()), sizes  # and kept as a tree
    assert 0 < control["kept_nodes"] < control["drafted_nodes"]


def test_steps_where_nobody_drafts_skip_the_heads_first_pass_and_catch_its_kv_up(runs):
    """specx_eagle3 with cost control planning zero drafts for every request on runs of
    steps: those steps skip the head's first pass, keeping its inputs (the target's
    combined auxiliary hidden states and the tokens); the next first pass that runs is
    preceded by a catch-up of the head's KV. Greedy output equals no speculation and every
    round's drafts equal those of the same plans with every first pass run."""
    check_idle_steps(runs["idle"], runs["plain_short"])
    check_idle_steps(runs["idle_long"], runs["plain_long"])
    check_idle_steps(runs["idle_many"], runs["plain_many_idle"])
    assert runs["idle_preemptions"] > 0


def test_tree_rounds_of_depth_zero_skip_the_heads_first_pass_and_catch_its_kv_up(runs):
    """specx_eagle3 with a dynamic tree, its cost control choosing depth 0 on runs of
    rounds (scripted): those steps skip the head's first pass, keeping its inputs in the
    chain layout of the tree step before; the next first pass is preceded by the catch-up.
    Greedy output equals no speculation, and every round's trees (and first-pass outputs)
    equal those of the same depths with every first pass run."""
    idle = runs["tree_idle"]
    check_idle_steps(idle, runs["plain_short"])
    # Trees, not chains: some round drafted more nodes than the tree's depth.
    assert max(len(d) for _, drafts in idle["skip_rounds"] for d in drafts) > 4
    # A bounded hole: some steps were not allowed to skip, the trees are the same.
    bounded = runs["tree_idle_bounded"]
    check_idle_steps(bounded, runs["plain_short"])
    assert bounded["holes"]["refused_skips"] > 0
    assert bounded["holes"]["skipped_first_passes"] < idle["holes"]["skipped_first_passes"]


def test_a_request_idle_for_long_retires_from_drafting_and_output_is_unchanged(runs):
    """A request that goes ``retire_after`` skipped steps in a row (here 3) stops its head
    KV upkeep (nothing kept, no catch-up) and is planned zero drafts for the rest of its
    life, even where its acceptance says drafting would pay again: no draft reads the
    gaps. Greedy output equals no speculation; new requests afterwards draft as usual."""
    check_retirement(runs["retire"], runs["plain_short"])


def test_vllm_eagle3_with_the_head_stays_vllm_and_equals_no_speculation(runs):
    module, drafter, sampler = runs["vllm_components"]
    assert (module, drafter) == ("vllm.v1.spec_decode.eagle", "EagleProposer")
    assert sampler == "RejectionSampler"
    assert "specx" not in runs["vllm_additional_config"]
    assert runs["vllm_drafted"] > 0
    assert runs["vllm_ragged"] == runs["plain_ragged"]


def test_eagle3_adaptive_runs_the_specx_drafter_over_vllm_eagle3(runs):
    assert runs["method"] == ("eagle3", "specx_eagle3")
    assert runs["components"] == ("EagleChainProposer", "SpecxRejectionSampler")
    assert runs["aux_layers"] is True  # the target hands the head its auxiliary states
    assert runs["async_scheduling"] is False  # ragged drafts reach the scheduler
    assert runs["chunked"] is True


def test_greedy_equals_no_speculation_with_chunked_prefill_and_prefix_caching(runs):
    assert runs["ragged"] == runs["plain_ragged"]
    assert runs["long"] == runs["plain_long"]
    assert runs["long_again"] == runs["plain_long"]
    assert runs["prefix_hits"] > 0
    c = runs["ragged_counts"]
    assert 0 < c["accepted"] < c["drafted"]  # the head is right sometimes, not always


def test_the_confidence_stop_drafts_ragged_lengths(runs):
    assert runs["confidence_stop_rule"] == "ConfidenceStop"
    rounds = runs["ragged_rounds"] + runs["long_rounds"]
    lengths = [n for r in rounds for n in r]
    assert all(1 <= n <= K for n in lengths)
    assert len(set(lengths)) > 1
    assert any(len(set(r)) > 1 for r in rounds if len(r) > 1)  # one batch, several lengths
    s = runs["stats"]
    assert s["drafted_tokens"] == s["scheduled_tokens"] > 0
    assert 0 < s["lookahead_rows"] < s["padded_lookahead_rows"]  # the batch shrinks


def test_acceptance_head_stop_keeps_greedy_output(runs):
    assert runs["head_stop_rule"] == "HeadStop"  # loaded at start from the config
    assert runs["head_ragged"] == runs["plain_ragged"]
    assert runs["head_ragged_counts"]["drafted"] > 0


def test_preemption_keeps_greedy_output(runs):
    assert runs["preemptions"] > 0
    for i, (got, want) in enumerate(zip(runs["many"], runs["plain_many"])):
        assert got == want, (i, got, want)


def test_mixed_batch_greedy_rows_exact_and_seeds_reproduce(runs):
    for i in (0, 2):
        assert runs["mixed"][i] == runs["plain_short"][i]
    assert runs["mixed"] == runs["mixed_again"]


def _exact_two_token_distribution(target: str, prompt: list[int]) -> dict[tuple[int, int], float]:
    """p(t1, t2 | prompt) of the target at temperature 1, top-k STAT_TOP_K, enumerated
    with the Hugging Face model (9 sequences)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def top(ctx: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        vals, idx = logits.topk(STAT_TOP_K)
        return list(zip(idx.tolist(), vals.softmax(-1).tolist()))

    return {(a, b): pa * pb for a, pa in top(prompt) for b, pb in top(prompt + [a])}


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_sampled_output_is_distributed_as_the_target(runs, target, drafts):
    """Chi-square of the engine's seeded 2-token samples against the target's exact
    distribution: one-hot EAGLE-3 drafts, verified by accept-with-p(x) and the residual
    p without x; or the head's dynamic tree (top-k children), verified by the
    "deterministic" tree rule. Both verification outcomes must have happened."""
    from scipy.stats import chisquare

    if drafts == "chain":
        c = runs["stat_counts"]
        assert 0 < c["accepted"] < c["drafted"]
        samples = runs["stat"]
    else:
        trees, accepted = runs["tree_stat_nodes"]
        assert 0 < accepted < trees  # some trees accepted a node, some none
        samples = runs["tree_stat"]
    dist = _exact_two_token_distribution(target, runs["prompts"]["stat"][0])
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


def test_head_trees_equal_no_speculation_and_draft_the_chain_on_rank_0(runs):
    """specx_eagle3 with draft_tree (read from vLLM's eagle3 + the knob): greedy output
    equal to no speculation with a dynamic tree (chunked prefill, requests ending inside a
    tree) and with a static paths tree; every tree node was verified in one target pass,
    and the static tree's rank-0 path is the head's own argmax chain, i.e. the tree passes
    give each node its ancestors and its depth's position."""
    assert runs["tree_method"] == ("eagle3", "specx_eagle3", 8, "EagleChainProposer")
    assert runs["tree_ragged"] == runs["plain_ragged"]
    assert runs["tree_long"] == runs["plain_long"]
    assert [len(p) for p in runs["prompts"]["lengths"]][:2] == [200, 3]
    assert runs["tree_lengths"] == runs["plain_lengths"]  # batch > 1, lengths 3-200
    for n, got, want in zip((2, 3, 5, 7), runs["tree_ends"], runs["plain_short"]):
        assert got == want[:n]
    dynamic = runs["tree_dynamic_stats"]
    assert dynamic.tree_requests > 0 and dynamic.tree_nodes > 4 * dynamic.tree_requests
    assert 0 < dynamic.accepted and dynamic.compacted > 0  # off-rank-0 paths were taken
    assert runs["tree_static"] == runs["plain_ragged"]
    pairs = runs["tree_static_pairs"]
    full = [(chain, tree) for chain, tree in pairs if len(tree) == len(STATIC_PATHS)]
    assert len(full) > 10
    for chain, tree in full:
        # BFS order: [0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0].
        assert [tree[0], tree[2], tree[4], tree[6]] == chain[:4]
        assert tree[0] != tree[1]
    assert runs["tree_stats"].tree_requests > dynamic.tree_requests
