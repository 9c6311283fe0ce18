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
