"""`specx_mtp` under chunked prefill and prefix caching: the MTP fixture as plain attention.

vLLM turns chunked prefill and prefix caching off for MLA models on its CPU platform, so
``test_mtp_engine.py`` (MLA) cannot reach them. Here the same checkpoint runs with
``VLLM_MLA_DISABLE=1`` (DeepSeek attention without the latent cache, vLLM's ``CPU_ATTN``
backend), where both are on: a prompt longer than the token budget is prefilled in
chunks (the MTP layer drafts from chunked hidden states), and a repeated batch hits the
prefix cache (the MTP layer's KV is cached with the target's). Greedy output must equal
no speculation, with the adaptive stop on. The stop here is an acceptance head on the MTP
layer's hidden state (a seeded untrained one: exactness cannot depend on the head's
quality); ``test_mtp_engine.py`` covers the training-free confidence stop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from engine_requests import counter, generate, greedy, output_ids

pytestmark = pytest.mark.engine

K = 4
NEW_TOKENS = 24
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,  # the 150-token prompt is prefilled in 3 chunks
    enable_prefix_caching=True,
    kv_cache_memory_bytes=8 * 2**20,
    skip_tokenizer_init=True,
    disable_log_stats=False,
)
SPEC = {"method": "specx_mtp", "num_speculative_tokens": K, "adaptive": True,
        "stop_threshold": 0.5, "cost_control": False}  # drafts must happen: no timing


@pytest.fixture(scope="module")
def mla_disabled() -> Iterator[None]:
    old = os.environ.get("VLLM_MLA_DISABLE")
    os.environ["VLLM_MLA_DISABLE"] = "1"
    yield
    if old is None:
        os.environ.pop("VLLM_MLA_DISABLE", None)
    else:
        os.environ["VLLM_MLA_DISABLE"] = old


@pytest.fixture(scope="module")
def runs(mla_disabled: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import json

    import torch
    from transformers import AutoTokenizer

    from vllm_specx.algorithms.acceptance_head import AcceptanceHead, save_head
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixtures_root, heldout_prompts

    target = str(fixtures_root() / "mtp_target")
    hidden = json.loads((fixtures_root() / "mtp_target" / "config.json").read_text())[
        "hidden_size"]
    torch.manual_seed(0)
    head = save_head(AcceptanceHead(hidden, num_blocks=1), tmp_path_factory.mktemp("head"))
    tok = AutoTokenizer.from_pretrained(target)
    texts = heldout_prompts(6)
    long = tok("\n".join(texts[:4]))["input_ids"][:150]
    prompts = [long, *(tok(t)["input_ids"][:40] for t in texts[4:6])]
    out: dict[str, Any] = {"prompts": prompts}
    with running_llm(target, **ENGINE_KW) as llm:
        out["plain"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
    llm = make_llm(target, speculative_config={**SPEC, "acceptance_head": str(head)},
                   **ENGINE_KW)
    try:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        out["use_mla"] = config.model_config.use_mla
        out["chunked"] = config.scheduler_config.enable_chunked_prefill
        out["drafter"] = type(runner.drafter).__name__
        out["stop_rule"] = type(runner.drafter.stop_rule(K)).__name__
        out["spec"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        hits = counter(llm, "vllm:prefix_cache_hits")
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        out["again"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        out["prefix_hits"] = counter(llm, "vllm:prefix_cache_hits") - hits
        out["accepted_again"] = counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted
    finally:
        shutdown_llm(llm)
    return out


def test_plain_attention_with_chunked_prefill_and_prefix_caching_is_exact(runs):
    assert runs["use_mla"] is False and runs["chunked"] is True
    assert runs["drafter"] == "MtpProposer"
    assert runs["stop_rule"] == "HeadStop"  # the head was loaded and decides the stops
    assert runs["spec"] == runs["plain"]
    assert runs["again"] == runs["plain"]
    assert runs["prefix_hits"] > 0
    assert runs["accepted_again"] > 0  # drafts kept being accepted after cache hits


# -- draft trees over the MTP layer (issue 37) ---------------------------------------------
# The MLA target's CPU attention takes no tree mask (refused: test_mtp_config.py); as plain
# attention the target verifies a tree in one pass and the MTP layer drafts it with the EAGLE
# heads' round (glue/eagle_tree_proposer.py), reused at every depth. One engine: a dynamic
# tree (vLLM's K = 8 nodes), then cost control over it, then a static paths tree.
TREE = {"max_nodes": 8, "max_depth": 4, "branching": 2}
STATIC_PATHS = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]
TREE_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_drafts")


@pytest.fixture(scope="module")
def tree_runs(runs: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    from engine_requests import mixed

    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.engine import running_llm
    from vllm_specx.fixtures import fixtures_root
    from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    target = str(fixtures_root() / "mtp_target")
    prompts = runs["prompts"]
    out: dict[str, Any] = {}
    # vLLM's own method name + the knob: read as specx_mtp; no K given (the MTP config's 1).
    # cost_control false: whole trees (counted below); pruning is switched on later
    # with a fixed cost model.
    spec = {"method": "mtp", "draft_tree": TREE, "cost_control": False}
    with running_llm(target, speculative_config=spec, **ENGINE_KW) as llm:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        drafter = runner.drafter
        out["method"] = (config.speculative_config.method,
                         config.additional_config["specx"]["method"],
                         config.speculative_config.num_speculative_tokens,
                         type(drafter).__name__, config.model_config.use_mla)
        before = [counter(llm, k) for k in TREE_COUNTERS]
        out["tree"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        out["counts"] = [counter(llm, k) - b for k, b in zip(TREE_COUNTERS, before)]
        out["dynamic_stats"] = dataclasses.replace(runner.specx_tree_state.stats)
        # Requests ending inside a tree, and a batch mixing greedy and sampled rows.
        out["ends"] = output_ids(generate(llm, prompts, [greedy(n) for n in (2, 3, 5)]))
        out["mixed"] = output_ids(generate(llm, [*prompts, prompts[1]], mixed(NEW_TOKENS)))
        # Cost control over the same dynamic tree (a fixed cost model under which a node
        # pays only where its path is likely): trees are cut per request, some to nothing.
        drafter.settings = {**drafter.settings, "cost_control": True}
        control = tree_cost_control_for(drafter)
        assert control is not None
        control.fixed_costs = StepCosts(target_base=0.0, target_per_request=1.0,
                                        target_per_token=0.3, draft_pass=0.0, draft_row=0.0)
        out["cost"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        out["cost_control"] = drafter.specx_stats().get("tree_cost_control")
        # A static tree; each round also drafts the MTP layer's argmax chain over the same
        # first pass (before the tree's passes rewrite the lookahead KV): the tree's rank-0
        # path must be that chain.
        drafter.settings = {**drafter.settings, "cost_control": False,
                            "draft_tree": {"paths": STATIC_PATHS}}
        tree_round = drafter.draft_round
        pairs: list[tuple[list[int], list[int]]] = []

        def both(start: Any, md: Any) -> Any:
            chain = super(EagleTreeRound, drafter).draft_round(start, md)
            trees = tree_round(start, md)
            pairs.extend((list(c), list(t)) for c, t in zip(chain, trees))
            return trees

        drafter.draft_round = both
        out["static"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        out["static_pairs"] = pairs
        out["stats"] = runner.specx_tree_state.stats
    return out


def test_mtp_trees_equal_no_speculation(runs, tree_runs):
    """specx_mtp with draft_tree (read from vLLM's mtp + the knob): greedy output equal to
    no speculation with a dynamic tree (a chunked 150-token prompt, requests ending 2, 3
    and 5 tokens in, a batch of greedy and sampled rows) and with a static paths tree;
    more than one token accepted per tree in vLLM's spec-decode counters."""
    assert tree_runs["method"] == ("mtp", "specx_mtp", 8, "MtpProposer", False)
    plain = runs["plain"]
    assert tree_runs["tree"] == plain
    for n, got, want in zip((2, 3, 5), tree_runs["ends"], plain):
        assert got == want[:n]
    assert tree_runs["mixed"][0] == plain[0] and tree_runs["mixed"][2] == plain[2]
    drafted, accepted, drafts = tree_runs["counts"]
    dynamic = tree_runs["dynamic_stats"]
    assert drafted == dynamic.tree_nodes  # the scheduler saw every node as a draft
    print("mtp tree: accepted per tree", accepted / drafts, "nodes per tree", drafted / drafts)
    assert accepted / drafts > 1.0
    assert dynamic.compacted > 0  # off-rank-0 paths were taken
    assert tree_runs["static"] == plain


def test_mtp_static_tree_drafts_the_chain_on_rank_0(tree_runs):
    """The MTP layer's tree passes give each node its ancestors and its depth's position:
    the static tree's rank-0 path is the layer's own argmax chain, round by round."""
    full = [(c, t) for c, t in tree_runs["static_pairs"] if len(t) == len(STATIC_PATHS)]
    assert len(full) > 10
    for chain, tree in full:
        # BFS order: [0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0].
        assert [tree[0], tree[2], tree[4], tree[6]] == chain[:4]
        assert tree[0] != tree[1]


def test_mtp_tree_cost_control_prunes_and_equals_no_speculation(runs, tree_runs):
    assert tree_runs["cost"] == runs["plain"]
    control = tree_runs["cost_control"]
    assert control is not None and control["rounds"] > 0
    assert 0 < control["kept_nodes"] < control["drafted_nodes"]
