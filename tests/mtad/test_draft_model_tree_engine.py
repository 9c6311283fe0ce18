"""``adaptive`` with ``draft_tree``: a dynamic tree from the draft model, verified
losslessly (the ``"deterministic"`` tree rule) in one target pass, in the real vLLM CPU
engine. The draft is the target itself (deep accepted paths off the first BFS nodes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mtad_reference import greedy_generate
from test_mtad_tree_engine import (  # noqa: F401 (fixture)
    TreeEngine,
    check_rows,
    pair,
    prompts_of,
    run_with_tree_cost_control,
)

pytestmark = pytest.mark.engine

TREE = {"max_nodes": 8, "max_depth": 3, "branching": 3}


@pytest.fixture(scope="module")
def engine(pair):  # noqa: F811
    target_dir = pair[0]
    eng = TreeEngine(target_dir, {"method": "adaptive", "model": target_dir,
                                  "num_speculative_tokens": 4, "draft_tree": TREE,
                                  # whole trees (sizes must not follow timings); the
                                  # pruning test turns the control on, fixed costs
                                  "cost_control": False})
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
    check_rows(target, prompts, params, outs)
    assert stats.tree_requests > before[0]
    assert stats.compacted > before[1]
    assert stats.accepted - before[2] > stats.tree_requests - before[0]


def test_cost_control_prunes_trees_and_equals_no_speculation(pair, engine):  # noqa: F811
    """``cost_control`` on the draft-model tree (``run_with_tree_cost_control``'s fixed
    cost model: a node pays only when its path's value beats ~0.1 of the step's rate):
    trees are cut per request, some to zero nodes, and greedy output stays equal to no
    speculation."""
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([6, 17, 25, 9], seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=12) for _ in prompts]
    outs, control, stats = run_with_tree_cost_control(engine, prompts, params)
    for out, prompt, sp in zip(outs, prompts, params):
        assert list(out.outputs[0].token_ids) == greedy_generate(
            target, prompt, sp.max_tokens), out.request_id
    sizes = {int(k): v for k, v in control.describe()["kept_histogram"].items()}
    assert control.stats.rounds > 0 and 0 < control.stats.kept_nodes < control.stats.drafted_nodes
    assert len(sizes) >= 2, sizes  # sizes varied between requests and steps
    assert stats["tree_nodes"] >= control.stats.kept_nodes
    # The drafter reports its tree control (vllm-specx bench prints it).
    assert stats["tree_cost_control"]["kept_nodes"] == control.stats.kept_nodes


def test_depth_zero_rounds_skip_the_draft_models_first_pass(pair, engine):  # noqa: F811
    """With cost control (its default) the tree's depth is chosen before the first pass,
    and a round of depth 0 is a plain step that skips the draft model's first pass; the
    draft KV it leaves unwritten is caught up before the next first pass that runs
    (``DraftKVHoles``, as for ``adaptive``'s chains), block ends included. Depths scripted
    (``idle_steps.ScriptedTreeDepths``: runs of one and four depth-0 rounds): every tree
    drafted after a skip, and every first pass's output, equals that with every first pass
    run (they differ when the catch-up writes nothing), and greedy output equals no
    speculation."""
    from idle_steps import check_idle_steps, run_idle_steps
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([6, 17, 25, 9], seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    idle = run_idle_steps(engine.llm, engine.runner.drafter, 8, prompts, params,
                          fresh_prefix_cache=True, tree=True)
    check_idle_steps(idle, [greedy_generate(target, p, 16) for p in prompts])


def test_top_k_trees_are_drafted_to_the_chosen_depth(pair, engine):  # noqa: F811
    """With cost control the greedy batch's top-k tree is drafted to the depth its control
    chooses (scripted here: 1, then 2) and pruned after: every recorded tree is that deep
    at most, some exactly, and greedy output equals no speculation."""
    from vllm import SamplingParams

    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.algorithms.tree_budget import node_depths
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    _, target = pair
    drafter = engine.runner.drafter
    drafter.settings = {**drafter.settings, "cost_control": True}
    drafter._tree_cost = None
    control = tree_cost_control_for(drafter)
    assert control is not None
    control.fixed_costs = StepCosts(0.0, 1.0, 1e-4, 0.0, 0.0)  # every node pays
    chosen = {"depth": 1}
    control.choose_depth = lambda num_reqs, max_depth, **kwargs: (
        chosen["depth"] if not kwargs.get("whole") else max_depth)
    depths: list[int] = []
    record = engine.state.record_round

    def recorded(req_ids, tokens, parents, **kwargs):
        depths.extend(int(node_depths(p.numpy()).max()) for p in parents if len(p))
        return record(req_ids, tokens, parents, **kwargs)

    engine.state.record_round = recorded
    prompts = prompts_of([6, 17, 25, 9], seed=17)
    params = [SamplingParams(temperature=0.0, max_tokens=10) for _ in prompts]
    try:
        outs = {}
        for depth in (1, 2):
            chosen["depth"] = depth
            depths.clear()
            outs[depth] = engine.generate(prompts, params)
            assert depths and max(depths) == depth, (depth, depths)
    finally:
        drafter.settings = {**drafter.settings, "cost_control": False}
        drafter._tree_cost = None
        del engine.state.record_round
    for depth in (1, 2):
        for out, prompt in zip(outs[depth], prompts):
            assert list(out.outputs[0].token_ids) == greedy_generate(target, prompt, 10)


N_STAT = 400  # seeded 3-token samples, top-k 3 at T = 1: 27 outcomes


def _exact_three_tokens(model, prompt: list[int], top_k: int) -> dict[tuple[int, ...], float]:
    """p(t1, t2, t3 | prompt) under temperature 1 and top-k, enumerated with the HF model."""
    def top(ctx: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        vals, idx = logits.topk(top_k)
        return list(zip(idx.tolist(), vals.softmax(-1).tolist()))

    return {(a, b, c): pa * pb * pc for a, pa in top(prompt) for b, pb in top(prompt + [a])
            for c, pc in top(prompt + [a, b])}


def _skewed_three_token_samples(pair, engine) -> tuple[float, int, int]:  # noqa: F811
    """N_STAT seeded 3-token samples at T = 1, top-k 3, with the drafter's logits skewed
    by a fixed random bias (the fixture's draft is the target: q must differ from p):
    the chi-square p-value against the target's exact distribution, and the run's
    accepted and verified draft nodes."""
    from scipy.stats import chisquare
    from vllm import SamplingParams

    _, target = pair
    drafter = engine.runner.drafter
    model = drafter.model
    assert model is not engine.runner.model
    bias = 0.6 * torch.randn(target.config.vocab_size, generator=torch.Generator().manual_seed(4))

    def skewed(hidden: torch.Tensor, _original=model.compute_logits) -> torch.Tensor:
        logits = _original(hidden)
        return logits + bias[: logits.shape[-1]].to(logits)

    prompt = prompts_of([9], seed=21)[0]
    stats = engine.state.stats
    before = (drafter.sampled_tree_rounds, stats.tree_nodes, stats.accepted,
              stats.tree_requests)
    model.compute_logits = skewed
    try:
        params = [SamplingParams(temperature=1.0, top_k=3, seed=i, max_tokens=3,
                                 ignore_eos=True) for i in range(N_STAT)]
        outs = engine.generate([prompt] * N_STAT, params)
    finally:
        del model.compute_logits  # the class's method again
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert drafter.sampled_tree_rounds > before[0]
    accepted, nodes = stats.accepted - before[2], stats.tree_nodes - before[1]
    dist = _exact_three_tokens(target, prompt, 3)
    assert set(samples) <= set(dist)
    big = [k for k in dist if dist[k] * N_STAT >= 5]
    small = [k for k in dist if k not in big]
    observed = [samples.count(k) for k in big] + [sum(samples.count(k) for k in small)]
    expected = [dist[k] * N_STAT for k in big] + [sum(dist[k] for k in small) * N_STAT]
    scale = sum(observed) / sum(expected)
    p_value = float(chisquare(observed, [e * scale for e in expected]).pvalue)
    return p_value, accepted, nodes - (stats.tree_requests - before[3])


def test_sampled_children_output_is_distributed_as_the_target(pair, engine):  # noqa: F811
    """Sampled requests draft i.i.d. children and are verified by the "sampled" rule
    (``sampled_children``, the default): chi-square of the engine's 3-token samples
    against the target's exact distribution (p 0.53 when written). Checked by hand:
    drafting the top-k children but verifying them with the "sampled" rule (the
    documented wrong pairing) fails it with p = 7e-58; handing every node the q row of
    depth 0 is too small an error for these samples (p 0.012 with 600) and is caught in
    tests/algorithms/test_sampled_tree.py."""
    p_value, accepted, drafted = _skewed_three_token_samples(pair, engine)
    assert 0 < accepted < drafted  # rejections too
    assert p_value > 1e-3, p_value


def test_sampled_children_at_depths_chosen_before_drafting(pair, engine):  # noqa: F811
    """With cost control (its default) the i.i.d. children are not pruned after drafting
    (keeping a node's children by what they drew would bias the "sampled" rule): the
    round's depth is chosen before they are drawn and the trees are verified whole. Here
    the control's choice is scripted (0, 1, 2, 3, 3, ...: plain steps and trees of 3, 6
    and 8 nodes, never reading the draws): the samples still follow the target's exact
    distribution, and the control times and learns from the whole trees."""
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    drafter = engine.runner.drafter
    drafter.settings = {**drafter.settings, "cost_control": True}
    drafter._tree_cost = None  # a control of this test's own (not the pruning test's)
    control = tree_cost_control_for(drafter)
    assert control is not None
    depths: list[int] = []

    def scripted(num_reqs: int, max_depth: int, **kwargs: Any) -> int:
        assert kwargs.get("whole") is True, kwargs  # the sampled rounds' table
        assert max_depth == 3
        depths.append([0, 1, 2, 3, 3][len(depths) % 5])
        return depths[-1]

    control.choose_depth = scripted
    received: list[int] = []
    record = engine.state.record_round

    def recorded(req_ids, tokens, parents, **kwargs):
        received.extend(len(t) for t in tokens)
        return record(req_ids, tokens, parents, **kwargs)

    engine.state.record_round = recorded
    try:
        p_value, accepted, drafted = _skewed_three_token_samples(pair, engine)
    finally:
        drafter.settings = {**drafter.settings, "cost_control": False}
        del engine.state.record_round
        drafter._tree_cost = None
    assert {0, 1, 2, 3} <= set(depths)
    # 3 a depth, the last depth 2; depth 0 records empty trees (its first pass skipped).
    assert set(received) == {0, 3, 6, 8}, set(received)
    stats = control.stats
    assert stats.whole_rounds > 0 and stats.all_zero_rounds > 0, stats
    assert stats.kept_nodes == stats.drafted_nodes == sum(received)
    assert 0 < accepted < drafted
    assert p_value > 1e-3, p_value


def test_sampled_children_under_chain_fallback(engine):
    """A batch with penalties verifies its drafts as the scheduled chain: the i.i.d.
    children's q rows then go to the standard rule, BFS order (lossless: each node is a
    fresh draw from its row given the nodes before it); the step runs and counts."""
    from vllm import SamplingParams

    drafter, stats = engine.runner.drafter, engine.state.stats
    before = (drafter.sampled_tree_rounds, stats.chain_fallback_steps)
    params = [SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=i, max_tokens=9,
                             ignore_eos=True) for i in range(2)]
    outs = engine.generate(prompts_of([7, 12], seed=5), params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 9]
    assert drafter.sampled_tree_rounds > before[0]
    assert stats.chain_fallback_steps > before[1]
