"""``adaptive`` with ``draft_tree``: a dynamic tree from the draft model, verified
losslessly (the ``"deterministic"`` tree rule) in one target pass, in the real vLLM CPU
engine. The draft is the target itself (deep accepted paths off the first BFS nodes)."""

from __future__ import annotations

import pytest
from mtad_reference import greedy_generate
from test_mtad_tree_engine import TreeEngine, pair, prompts_of  # noqa: F401 (fixture)

pytestmark = pytest.mark.engine

TREE = {"max_nodes": 8, "max_depth": 3, "branching": 3}


@pytest.fixture(scope="module")
def engine(pair):  # noqa: F811
    target_dir = pair[0]
    eng = TreeEngine(target_dir, {"method": "adaptive", "model": target_dir,
                                  "num_speculative_tokens": 4, "draft_tree": TREE})
    yield eng
    eng.close()


def test_the_tree_drafter_and_the_lossless_rule(engine):
    from vllm_specx.glue.mtad_proposer import DraftTreeProposer

    runner = engine.runner
    assert isinstance(runner.drafter, DraftTreeProposer)
    assert runner.drafter.num_beams == 3
    assert runner.speculative_config.num_speculative_tokens == 8  # the node budget
    assert runner.rejection_sampler.rule == "standard"


def test_greedy_equals_no_speculation_and_sampled_rows_run(pair, engine):  # noqa: F811
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([6, 70, 17, 25], seed=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=13),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.9, max_tokens=11, seed=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16),
    ]
    stats = engine.state.stats
    before = (stats.tree_requests, stats.compacted, stats.accepted)
    outs = engine.generate(prompts, params)
    for out, prompt, sp in zip(outs, prompts, params):
        tokens = list(out.outputs[0].token_ids)
        if sp.temperature == 0.0:
            assert tokens == greedy_generate(target, prompt, sp.max_tokens), out.request_id
        else:
            assert len(tokens) == sp.max_tokens
    assert stats.tree_requests > before[0]
    assert stats.compacted > before[1]
    assert stats.accepted - before[2] > stats.tree_requests - before[0]
