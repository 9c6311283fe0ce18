"""Draft trees on Model Runner V2 (CPU platform, Triton interpreter), fixture pair:
``mtad`` and ``adaptive`` with ``draft_tree`` verify each request's tree in one target pass
on V2 (``glue/v2_tree_step.py``), and greedy output equals no speculation on V2.

V2 without speculation gives V1's tokens (``test_v2_harness.py``) and the same tree
configs on V1 give V1's no-speculation tokens (``tests/mtad/test_mtad_tree_engine.py``,
``test_draft_model_tree_engine.py``), so V1 and V2 give the same tokens for these
requests wherever these tests pass.

One engine per method (the interpreter makes V2 slow). The mtad engine has the small KV
cache of ``test_v2_draft_models.py``: its requests (five copies of one prompt, and each
shared prompt at three output lengths) are preempted and end inside a tree; it is also the
V2 suite's MTAD-under-preemption case. The adaptive engine's batch mixes greedy requests
with a seeded sampled one (warped rows, the "deterministic" tree rule).

Measured once (not asserted: the tree drafter may change): the adaptive engine's greedy
requests give the same tree counters on V1 as here (16 tree steps, 110 nodes, 20 accepted,
8 compacted; 2026-11-25).
"""

from __future__ import annotations

from typing import Any

import pytest
from test_v2_draft_models import SMALL_KV, _ragged_requests
from v2_cases import DRAFT, GREEDY, PROMPTS

pytestmark = pytest.mark.engine

# greedy_drafting "beam": greedy requests draft the beams (a tree), not the argmax chain.
MTAD_TREE = {"method": "mtad", "model": DRAFT, "num_speculative_tokens": 3, "num_beams": 2,
             "draft_tree": True, "greedy_drafting": "beam"}
ADAPTIVE_TREE = {"method": "adaptive", "model": DRAFT, "num_speculative_tokens": 4,
                 "draft_tree": {"max_nodes": 8, "max_depth": 3, "branching": 3}}

SAMPLED = {**GREEDY, "temperature": 1.0, "seed": 11}


def run_tree(llm: Any, prompts: list[list[int]], samplings: list[dict[str, Any]]
             ) -> dict[str, Any]:
    """Runs in the V2 host: generate; the runner's tree counters, the lengths the
    scheduler received per step, and preemptions."""
    from dataclasses import asdict

    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of

    runner = runner_of(llm)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    received: list[list[int]] = []
    preemptions = 0
    take_ids, preempt = runner.take_draft_token_ids, scheduler._preempt_request

    def ids_hook() -> Any:
        out = take_ids()
        if out is not None:
            received.append([len(ids) for ids in out.draft_token_ids])
        return out

    def preempt_hook(*args: Any, **kwargs: Any) -> Any:
        nonlocal preemptions
        preemptions += 1
        return preempt(*args, **kwargs)

    runner.take_draft_token_ids = ids_hook
    scheduler._preempt_request = preempt_hook
    try:
        outputs = generate_token_ids(llm, prompts, samplings)
    finally:
        del runner.take_draft_token_ids
        scheduler._preempt_request = preempt
    return {"outputs": outputs, "stats": asdict(runner.specx_tree_state.stats),
            "received": received, "preemptions": preemptions}


@pytest.fixture(scope="module")
def mtad_tree_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("mtad-tree", speculative_config=MTAD_TREE, **SMALL_KV)
    assert description["speculator"].endswith("MTADV2Speculator"), description
    return v2_host.call("mtad-tree", f"{__name__}:run_tree", *_ragged_requests())


@pytest.fixture(scope="module")
def adaptive_tree_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("adaptive-tree", speculative_config=ADAPTIVE_TREE)
    assert description["speculator"].endswith("DraftTreeV2Speculator"), description
    return v2_host.call("adaptive-tree", f"{__name__}:run_tree", [*PROMPTS, PROMPTS[1]],
                        [GREEDY] * len(PROMPTS) + [SAMPLED])


def _assert_tree_steps(run: dict[str, Any], max_nodes: int) -> None:
    stats = run["stats"]
    # Trees were verified as trees (not chains), some paths left the first branch (their
    # K/V moved), and trees of several sizes reached the scheduler.
    assert stats["tree_requests"] > 0 and stats["accepted"] > 0, stats
    assert stats["tree_nodes"] > stats["tree_requests"], stats
    assert stats["compacted"] > 0, stats
    sizes = {n for step in run["received"] for n in step if n}
    assert len(sizes) > 1 and max(sizes) <= max_nodes, sizes


def test_mtad_tree_greedy_under_preemption_and_mid_tree_ends_on_v2(mtad_tree_run,
                                                                    v2_reference):
    """Preempted requests and requests ending inside a tree give the no-speculation
    tokens."""
    from test_v2_draft_models import OUTPUT_LENGTHS

    expected = [v2_reference[1]] * 5 + [ref[:n] for ref in v2_reference for n in OUTPUT_LENGTHS]
    assert mtad_tree_run["outputs"] == expected
    assert mtad_tree_run["preemptions"] > 0
    _assert_tree_steps(mtad_tree_run, 2 * 3)


def test_adaptive_tree_greedy_equals_no_speculation_on_v2(adaptive_tree_run, v2_reference):
    """Greedy requests in a batch with a sampled one give the no-speculation tokens; the
    sampled request runs its tree to its length."""
    outputs = adaptive_tree_run["outputs"]
    assert outputs[: len(PROMPTS)] == v2_reference
    assert len(outputs[-1]) == SAMPLED["max_tokens"]
    _assert_tree_steps(adaptive_tree_run, 8)


# specx_eagle3 head trees on V2 (glue/v2_eagle.py's head-tree round over the V2 tree step):
# one engine, a dynamic tree, then a static paths tree on the same speculator (as
# tests/eagle/test_eagle3_engine.py does on V1).
HEAD_DYNAMIC = {"max_nodes": 8, "max_depth": 4, "branching": 2}
HEAD_STATIC = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]
HEAD_ENDS = (2, 3, 5, 7)


def run_head_trees(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Runs in the V2 host: dynamic-tree greedy runs (full length, and requests ending
    inside a tree), then the static tree with each round's argmax chain beside it."""
    from dataclasses import asdict

    from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound
    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of

    runner = runner_of(llm)
    spec = runner.speculator
    out: dict[str, Any] = {"dynamic": generate_token_ids(llm, prompts, GREEDY)}
    out["ends"] = generate_token_ids(llm, prompts,
                                     [{**GREEDY, "max_tokens": n} for n in HEAD_ENDS])
    out["dynamic_stats"] = asdict(runner.specx_tree_state.stats)
    spec.settings = {**spec.settings, "draft_tree": {"paths": HEAD_STATIC}}
    tree_round = spec.draft_round
    pairs: list[tuple[list[int], list[int]]] = []

    def both(start: Any, sampling: Any) -> Any:
        # The chain round first: the tree's passes rewrite the lookahead KV it used.
        chain = super(EagleTreeRound, spec).draft_round(start, sampling)
        trees = tree_round(start, sampling)
        pairs.extend((list(c), list(t)) for c, t in zip(chain, trees))
        return trees

    spec.draft_round = both
    try:
        out["static"] = generate_token_ids(llm, prompts, GREEDY)
    finally:
        del spec.draft_round
    out["pairs"] = pairs
    out["stats"] = asdict(runner.specx_tree_state.stats)
    return out


@pytest.fixture(scope="module")
def head_tree_run(v2_engine, v2_host, tmp_path_factory) -> dict[str, Any]:
    from v2_cases import TARGET, build_eagle3_head, heldout_prompts

    head = build_eagle3_head(str(tmp_path_factory.mktemp("v2_eagle3_tree_head")))
    description = v2_engine("eagle3-tree", TARGET, speculative_config={
        "method": "specx_eagle3", "model": head, "num_speculative_tokens": 8,
        "draft_tree": HEAD_DYNAMIC})
    assert description["speculator"].endswith("EagleChainV2Speculator"), description
    try:
        return v2_host.call("eagle3-tree", f"{__name__}:run_head_trees", heldout_prompts())
    finally:
        v2_host.stop("eagle3-tree")


def test_eagle3_head_trees_equal_no_speculation_on_v2(head_tree_run, v2_heldout_reference):
    """specx_eagle3 + draft_tree on V2: greedy output equals no speculation with a dynamic
    tree (requests ending inside a tree too) and with a static paths tree; every tree was
    verified as a tree; the static tree's rank-0 path is the head's own argmax chain (the
    head's tree passes give each node its ancestors and its depth's position)."""
    run, reference = head_tree_run, v2_heldout_reference
    assert run["dynamic"] == reference
    for n, got, want in zip(HEAD_ENDS, run["ends"], reference):
        assert got == want[:n]
    dynamic = run["dynamic_stats"]
    assert dynamic["tree_requests"] > 0
    assert dynamic["tree_nodes"] > 4 * dynamic["tree_requests"], dynamic
    # Paths were accepted, some off rank 0 (their K/V and hidden rows moved).
    assert dynamic["accepted"] > 0 and dynamic["compacted"] > 0, dynamic
    assert run["static"] == reference
    full = [(c, t) for c, t in run["pairs"] if len(t) == len(HEAD_STATIC)]
    assert len(full) > 5, run["pairs"]
    for chain, tree in full:
        # BFS order: [0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0].
        assert [tree[0], tree[2], tree[4], tree[6]] == chain[:4]
        assert tree[0] != tree[1]
    assert run["stats"]["tree_requests"] > dynamic["tree_requests"]
