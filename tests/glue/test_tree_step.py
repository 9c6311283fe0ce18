"""``glue/tree_step.TreeState.begin_step`` on a stand-in runner: which requests of a step
become trees, their RoPE positions and masks; a request with a grammar (structured
output) is left to chain verification, since vLLM's bitmask follows the scheduled chain."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_specx.glue.tree_step import TreeState

# One tree of 3 nodes: node 0 and node 1 are children of the root, node 2 of node 0.
TOKENS, PARENTS = torch.tensor([11, 12, 13]), torch.tensor([-1, -1, 0])


def _runner(structured: set[str]) -> SimpleNamespace:
    req_ids = ["a", "b"]
    ctx = [5, 9]  # each request's root position
    positions = torch.tensor([ctx[0] + i for i in range(4)] + [ctx[1] + i for i in range(4)])
    metadata = SimpleNamespace(no_penalties=True, bad_words_token_ids={},
                               allowed_token_ids_mask=None,
                               logitsprocs=SimpleNamespace(non_argmax_invariant=[]))
    slots = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=torch.arange(100, 108)))
    requests = {
        rid: SimpleNamespace(sampling_params=SimpleNamespace(
            structured_outputs=object() if rid in structured else None))
        for rid in req_ids
    }
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=2, req_ids=req_ids, sampling_metadata=metadata,
                                    block_table=[slots],
                                    num_computed_tokens_cpu=np.array(ctx, dtype=np.int32)),
        query_start_loc=SimpleNamespace(np=np.array([0, 4, 8])),
        positions=positions,
        kv_cache_config=SimpleNamespace(kv_cache_groups=[object()]),
        requests=requests,
    )


def _step(structured: set[str]):
    runner = _runner(structured)
    state = TreeState()
    state.record_round(["a", "b"], [TOKENS, TOKENS], [PARENTS, PARENTS])
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={
        "a": TOKENS.tolist(), "b": TOKENS.tolist()})
    spec = SimpleNamespace(num_draft_tokens=[3, 3])
    state.begin_step(runner, scheduler_output, np.array([4, 4]), spec)
    return state, runner


def test_tree_requests_get_depth_positions_and_ancestor_masks():
    state, runner = _step(set())
    assert [t.row for t in state.step.trees] == [0, 1]
    # RoPE position ctx + depth: depths 1, 1, 2.
    assert runner.positions.tolist() == [5, 6, 6, 7, 9, 10, 10, 11]
    mask = state.step.masks.allowed[0]
    assert mask[3].tolist() == [True, True, False, True]  # node 2 sees root, node 0, itself
    assert mask[2].tolist() == [True, False, True, False]  # node 1 does not see node 0


def test_a_structured_output_request_is_verified_as_the_chain():
    state, runner = _step({"a"})
    assert [t.row for t in state.step.trees] == [1]
    assert runner.positions[:4].tolist() == [5, 6, 7, 8]  # chain positions kept
    assert state.step.masks.allowed[0, :4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    state, _ = _step({"a", "b"})
    assert state.step is None
