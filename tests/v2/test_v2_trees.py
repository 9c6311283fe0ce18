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
with a seeded sampled one (a sampled batch drafts i.i.d. children, verified by the
"sampled" rule); the same engine then draws seeded samples at T = 1 whose distribution is
checked against the target's exact one (chi-square).

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
# cost_control false: whole trees (pruned_tree_run turns the control on with fixed costs).
MTAD_TREE = {"method": "mtad", "model": DRAFT, "num_speculative_tokens": 3, "num_beams": 2,
             "draft_tree": True, "greedy_drafting": "beam", "cost_control": False}
# cost_control false: V1 and V2 must verify the same trees (pruning follows each
# engine's own timings).
ADAPTIVE_TREE = {"method": "adaptive", "model": DRAFT, "num_speculative_tokens": 4,
                 "draft_tree": {"max_nodes": 8, "max_depth": 3, "branching": 3},
                 "cost_control": False}

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
            "received": received, "preemptions": preemptions,
            "sampled_rounds": getattr(runner.speculator, "sampled_tree_rounds", None)}


@pytest.fixture(scope="module")
def mtad_tree_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("mtad-tree", speculative_config=MTAD_TREE, **SMALL_KV)
    assert description["speculator"].endswith("MTADV2Speculator"), description
    return v2_host.call("mtad-tree", f"{__name__}:run_tree", *_ragged_requests())


@pytest.fixture(scope="module")
def adaptive_tree_run(v2_engine, v2_host) -> dict[str, Any]:
    description = v2_engine("adaptive-tree", speculative_config=ADAPTIVE_TREE)
    assert description["speculator"].endswith("DraftTreeV2Speculator"), description
    # The last greedy request ends inside a tree (7 tokens) drafted by the sampled round.
    return v2_host.call("adaptive-tree", f"{__name__}:run_tree",
                        [*PROMPTS, PROMPTS[1], PROMPTS[2]],
                        [GREEDY] * len(PROMPTS) + [SAMPLED, {**GREEDY, "max_tokens": 7}])


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


def test_mtad_tree_cost_control_prunes_on_v2(mtad_tree_run, v2_host, v2_reference):
    """``mtad`` with ``draft_tree`` and ``"cost_control": true`` on V2 (its beams, the
    same fixed cost model): the beam trees are cut as ``adaptive``'s are, greedy output
    equals no speculation (as V1's ``tests/mtad/test_mtad_tree_engine.py``). Before the
    adaptive tree's tests: an engine started in the V2 host takes vLLM's metrics over
    (``unregister_vllm_metrics``), so the mtad engine must not start between the adaptive
    engine's tests, whose idle-step check reads its counters."""
    _assert_pruned(v2_host.call("mtad-tree", f"{__name__}:pruned_tree_run", PROMPTS),
                   v2_reference)


def test_adaptive_tree_greedy_equals_no_speculation_on_v2(adaptive_tree_run, v2_reference):
    """Greedy requests in a batch with a sampled one give the no-speculation tokens, one of
    them ending inside a tree; the sampled request runs its tree to its length. While the
    sampled request is in the batch, the batch drafts by the sampled-children round (the
    greedy rows take their top-``branching`` tokens per depth)."""
    outputs = adaptive_tree_run["outputs"]
    assert outputs[: len(PROMPTS)] == v2_reference
    assert len(outputs[len(PROMPTS)]) == SAMPLED["max_tokens"]
    assert outputs[-1] == v2_reference[2][:7]
    assert adaptive_tree_run["sampled_rounds"] > 0
    _assert_tree_steps(adaptive_tree_run, 8)


def pruned_tree_run(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Runs in the V2 host: greedy requests with the tree cost control on (this engine
    turned it off) under a fixed cost model in which a node pays only where its path's
    value beats ~0.1 of the step's rate (as V1's
    ``tests/mtad/test_draft_model_tree_engine.py``); what the control kept, and the run's
    tree counters and lengths the scheduler received."""
    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.glue.tree_cost import tree_cost_control_for
    from vllm_specx.testing.v2_engine import runner_of

    spec = runner_of(llm).speculator
    settings = spec.settings
    spec.settings = {**settings, "cost_control": True}
    try:
        control = tree_cost_control_for(spec)
        assert control is not None
        control.fixed_costs = StepCosts(target_base=0.0, target_per_request=1.0,
                                        target_per_token=0.1, draft_pass=0.0, draft_row=0.0)
        run = run_tree(llm, prompts, [GREEDY] * len(prompts))
    finally:
        spec.settings = settings
    run["control"] = control.describe()
    run["reported"] = spec.specx_stats().get("tree_cost_control")
    return run


def test_adaptive_tree_cost_control_prunes_on_v2(adaptive_tree_run, v2_host, v2_reference):
    """``adaptive`` with ``draft_tree`` and cost control (its default) on V2, a fixed cost
    model: each request's tree is cut to the nodes that pay, to several sizes (some to
    nothing), the scheduler receives the cut trees, and greedy output equals no
    speculation (as on V1)."""
    _assert_pruned(v2_host.call("adaptive-tree", f"{__name__}:pruned_tree_run", PROMPTS),
                   v2_reference)


def _assert_pruned(run: dict[str, Any], reference: list[list[int]]) -> None:
    assert run["outputs"] == reference
    control = run["control"]
    assert control["rounds"] > 0 and 0 < control["kept_nodes"] < control["drafted_nodes"], \
        control
    sizes = {int(k) for k, v in control["kept_histogram"].items() if v}
    assert len(sizes) >= 2 and max(sizes) >= 2, sizes  # cut to different trees
    # The scheduler got the cut trees (nothing longer than any request kept) ...
    received = {n for step in run["received"] for n in step}
    assert received <= sizes | {0} and max(received) >= 2, (received, sizes)
    # ... and verified them as trees.
    assert run["stats"]["tree_requests"] > 0 and run["stats"]["accepted"] > 0, run["stats"]
    # The speculator reports its tree control (vllm-specx bench prints it).
    assert run["reported"]["kept_nodes"] == control["kept_nodes"]


def scripted_depth_run(llm: Any, prompts: list[list[int]],
                       samplings: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs in the V2 host: the batch with cost control on and its depth choice for the
    sampled i.i.d. children scripted (0, 1, 2, 3, 3, ...); outputs, the depths chosen and
    what the control counted."""
    from vllm_specx.glue.tree_cost import tree_cost_control_for
    from vllm_specx.testing.v2_engine import runner_of

    spec = runner_of(llm).speculator
    settings, spec._tree_cost = spec.settings, None
    spec.settings = {**settings, "cost_control": True}
    depths: list[int] = []

    def scripted(num_reqs: int, max_depth: int, **kwargs: Any) -> int:
        if kwargs.get("whole") is not True:
            # Not a sampled round (the sampled request finished first, how soon depends
            # on its draws): the greedy rest plans its pruned trees as usual.
            return planned(num_reqs, max_depth, **kwargs)
        depths.append([0, 1, 2, 3, 3][len(depths) % 5])
        return min(depths[-1], max_depth)

    try:
        control = tree_cost_control_for(spec)
        assert control is not None
        planned = control.choose_depth
        control.choose_depth = scripted
        run = run_tree(llm, prompts, samplings)
    finally:
        spec.settings, spec._tree_cost = settings, None
    run["depths"] = depths
    run["control"] = control.describe()
    return run


def test_adaptive_tree_sampled_children_at_depths_chosen_before_drafting_on_v2(
        adaptive_tree_run, v2_host, v2_reference):
    """A batch with a sampled request drafts i.i.d. children, which cost control does not
    prune (that would bias the "sampled" rule): their depth is chosen before drafting
    (scripted here, 0 included) and they are verified whole, on V2 as on V1
    (``mtad_proposer.DraftTreeRound``); the greedy requests of the batch still give the
    no-speculation tokens."""
    run = v2_host.call("adaptive-tree", f"{__name__}:scripted_depth_run",
                       [*PROMPTS, PROMPTS[1]], [GREEDY] * len(PROMPTS) + [SAMPLED])
    assert run["outputs"][: len(PROMPTS)] == v2_reference
    assert len(run["outputs"][-1]) == SAMPLED["max_tokens"]
    assert {0, 1, 2, 3} <= set(run["depths"]), run["depths"]
    control = run["control"]
    assert control["whole_rounds"] > 0 and control["all_zero_rounds"] > 0, control
    # Whole trees of 3, 6 and 8 nodes (3 a depth, the last 2) reached the scheduler.
    assert {3, 6, 8} <= {n for step in run["received"] for n in step}, run["received"]


def idle_tree_run(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Runs in the V2 host: the adaptive tree with its depth scripted to 0 on runs of
    rounds (tests/idle_steps.py), skipping the draft model's first pass there."""
    from idle_steps import ScriptedShortTreeDepths, run_idle_steps
    from vllm import SamplingParams

    from vllm_specx.testing.v2_engine import runner_of

    spec = runner_of(llm).speculator
    return run_idle_steps(llm, spec, int(spec.num_speculative_steps), prompts,
                          SamplingParams(**GREEDY), fresh_prefix_cache=True, tree=True,
                          tree_depths=ScriptedShortTreeDepths)


def test_adaptive_tree_rounds_of_depth_zero_skip_the_first_pass_on_v2(
        adaptive_tree_run, v2_host, v2_heldout_reference):
    """``adaptive`` with ``draft_tree`` on V2, its cost control choosing depth 0 (scripted)
    on runs of two rounds before V2's first pass: those steps skip it, the draft
    KV is caught up before the next one (as V1, and as V2's chains), every tree and
    first-pass output equals that with every first pass run, and greedy output equals no
    speculation."""
    from idle_steps import check_idle_steps
    from v2_cases import heldout_prompts

    # Three held-out prompts (5, 33 and 17 tokens: one step prefills them all), on which
    # drafts are accepted. With a prompt in chunked prefill the first round's drafts for
    # it (discarded: it is still prefilling) differed between the two runs on V2.
    rows = (0, 1, 3)
    prompts = [heldout_prompts()[i] for i in rows]
    idle = v2_host.call("adaptive-tree", f"{__name__}:idle_tree_run", prompts)
    check_idle_steps(idle, [v2_heldout_reference[i] for i in rows])


# Sampled trees on V2: seeded 3-token samples at T = 1, top-k 2 (8 outcomes), on the
# adaptive tree engine. The fixture draft is another model than the target, so q differs
# from p and both acceptances and rejections happen. The engine computes in bfloat16 (vLLM's
# CPU default), the reference in float32: this prompt's target logits keep the top-k
# boundary at least 0.37 apart in all 7 contexts (found by a search over random prompts;
# PROMPTS[0]'s 3rd and 4th tokens after one token are 0.016 apart, which bfloat16 rounding
# ties or swaps, so the engine there emits tokens outside the float32 top-k).
N_TREE_STAT = 300
TREE_STAT_TOP_K = 2
TREE_STAT_PROMPT = [231, 424, 247, 434, 107, 421, 140]


def sampled_tree_run(llm: Any, prompt: list[int], n: int, sampled_children: bool
                     ) -> dict[str, Any]:
    """Runs in the V2 host: ``n`` seeded samples with ``sampled_children`` set as given
    (the knob is read per round), the rounds and tree steps they ran, vLLM's spec-decode
    counters, the lengths the scheduler received and the q the specx sampler read."""
    from dataclasses import asdict

    from vllm_specx.algorithms import draft_tree
    from vllm_specx.methods import SAMPLED_CHILDREN_KEY, draft_model_tree
    from vllm_specx.testing.v2_engine import runner_of, spec_decode_counters

    runner = runner_of(llm)
    spec = getattr(runner, "drafter", None) or runner.speculator  # V1 or V2
    settings = spec.settings
    spec.settings = {**settings, "draft_tree": {**draft_model_tree(settings),
                                                SAMPLED_CHILDREN_KEY: sampled_children}}
    q_shapes: set[tuple[int, ...]] = set()
    store = spec.take_last_draft_probs

    def take_q() -> Any:
        q = store()
        q_shapes.add(() if q is None else tuple(q.shape[1:]))
        return q

    # The tree rules the specx V2 sampler ran (it imports verify_tree at each call).
    rules: list[str] = []
    verify = draft_tree.verify_tree

    def verify_recorded(*args: Any, **kwargs: Any) -> Any:
        rules.append(kwargs["rule"])
        return verify(*args, **kwargs)

    spec.take_last_draft_probs = take_q
    draft_tree.verify_tree = verify_recorded
    before = (spec_decode_counters(llm), asdict(runner.specx_tree_state.stats),
              spec.sampled_tree_rounds)
    params = [dict(temperature=1.0, top_k=TREE_STAT_TOP_K, seed=i, max_tokens=3,
                   ignore_eos=True) for i in range(n)]
    try:
        run = run_tree(llm, [prompt] * n, params)
    finally:
        spec.settings = settings
        draft_tree.verify_tree = verify
        del spec.take_last_draft_probs
    run["rules"] = sorted(set(rules))
    after = spec_decode_counters(llm)
    run["counters"] = {k: after[k] - before[0].get(k, 0.0) for k in after}
    run["stats"] = {k: v - before[1][k] for k, v in run["stats"].items()}
    run["sampled_rounds"] = spec.sampled_tree_rounds - before[2]
    run["q_shapes"] = sorted(q_shapes)
    return run


def _chi_square_p(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]
                  ) -> float:
    """Pearson chi-square p-value of ``samples`` against ``dist``, cells expecting fewer
    than 5 pooled."""
    from scipy.stats import chisquare

    assert set(samples) <= set(dist), set(samples) - set(dist)
    n = len(samples)
    big = [k for k in dist if dist[k] * n >= 5]
    small = [k for k in dist if k not in big]
    observed = [samples.count(k) for k in big] + (
        [sum(samples.count(k) for k in small)] if small else [])
    expected = [dist[k] * n for k in big] + ([sum(dist[k] for k in small) * n] if small else [])
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def test_sampled_tree_keeps_the_target_distribution_on_v2(adaptive_tree_run, v2_host):
    """``adaptive`` with ``draft_tree`` at T = 1 on V2: a sampled batch drafts i.i.d.
    children (``sampled_children``, the default), whose q rows reach the specx V2 sampler,
    which verifies them with the "sampled" (SpecInfer) rule; the 3-token samples follow
    the target's exact distribution (chi-square); the scheduler and vLLM's counters got
    the trees' sizes."""
    from test_v2_eagle_family import _exact_distribution
    from v2_cases import TARGET

    prompt = TREE_STAT_PROMPT
    run = v2_host.call("adaptive-tree", f"{__name__}:sampled_tree_run", prompt, N_TREE_STAT,
                       True)
    samples = [tuple(t) for t in run["outputs"]]
    assert [len(t) for t in samples] == [3] * N_TREE_STAT
    assert run["sampled_rounds"] > 0 and run["rules"] == ["sampled"], run["rules"]
    # Every round handed full q rows: [tree nodes, vocabulary] per request.
    assert run["q_shapes"] == [(8, 4096)], run["q_shapes"]
    stats, counters = run["stats"], run["counters"]
    # Verified as trees, with acceptances and rejections (some paths left node 0).
    assert stats["tree_requests"] > 0 and stats["chain_fallback_steps"] == 0, stats
    assert 0 < stats["accepted"] < stats["tree_nodes"] - stats["tree_requests"], stats
    assert stats["compacted"] > 0, stats
    # The scheduler received whole trees (3 + 3 + 2 nodes) and vLLM's counters count them:
    # draft tokens = the nodes verified, accepted = the accepted paths' nodes.
    assert {n for step in run["received"] for n in step} == {8}, run["received"]
    assert counters["num_draft_tokens"] == stats["tree_nodes"], (counters, stats)
    assert counters["num_accepted_tokens"] == stats["accepted"], (counters, stats)
    p_value = _chi_square_p(samples, _exact_distribution(TARGET, prompt, 3,
                                                         TREE_STAT_TOP_K))
    assert p_value > 1e-3, p_value


# specx_eagle3 head trees on V2 (glue/v2_eagle.py's head-tree round over the V2 tree step):
# one engine, a dynamic tree, then a static paths tree on the same speculator (as
# tests/eagle/test_eagle3_engine.py does on V1).
HEAD_DYNAMIC = {"max_nodes": 8, "max_depth": 4, "branching": 2}
HEAD_STATIC = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]
HEAD_ENDS = (2, 3, 5, 7)


def run_head_trees(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Runs in the V2 host (or here, on a V1 engine): dynamic-tree greedy runs (full
    length, and requests ending inside a tree), the dynamic tree pruned by cost control
    (a fixed cost model), then the static tree with each round's argmax chain beside it."""
    from dataclasses import asdict

    from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound
    from vllm_specx.testing.v2_engine import generate_token_ids, runner_of

    runner = runner_of(llm)
    spec = getattr(runner, "drafter", None) or runner.speculator  # V1 or V2
    out: dict[str, Any] = {"dynamic": generate_token_ids(llm, prompts, GREEDY)}
    out["ends"] = generate_token_ids(llm, prompts,
                                     [{**GREEDY, "max_tokens": n} for n in HEAD_ENDS])
    out["dynamic_stats"] = asdict(runner.specx_tree_state.stats)
    # Cost control over the same dynamic tree (on by default; this engine turned it off),
    # with a fixed cost model under which a node pays only where its path's value beats
    # ~0.3 of the step's rate: trees are cut per request, some to nothing.
    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    spec.settings = {**spec.settings, "cost_control": True}
    control = tree_cost_control_for(spec)
    assert control is not None
    control.fixed_costs = StepCosts(target_base=0.0, target_per_request=1.0,
                                    target_per_token=0.3, draft_pass=0.0, draft_row=0.0)
    out["pruned"] = generate_token_ids(llm, prompts, GREEDY)
    out["pruned_control"] = control.describe()
    dynamic_settings = dict(spec.settings)
    spec.settings = {**spec.settings, "cost_control": False,
                     "draft_tree": {"paths": HEAD_STATIC}}
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
    # The dynamic tree again, its depth 0 on runs of rounds (scripted, tests/idle_steps.py):
    # those steps skip the first pass; the head's KV is caught up before the next one, as
    # after chain steps.
    from idle_steps import run_idle_steps
    from vllm import SamplingParams

    spec.settings = dynamic_settings
    k = getattr(spec, "num_speculative_steps", None) or spec.num_speculative_tokens
    out["idle"] = run_idle_steps(llm, spec, k, prompts,
                                 SamplingParams(**GREEDY), fresh_prefix_cache=True, tree=True)
    return out


@pytest.fixture(scope="module")
def head_tree_run(v2_engine, v2_host, tmp_path_factory) -> dict[str, Any]:
    from v2_cases import TARGET, build_eagle3_head, heldout_prompts

    head = build_eagle3_head(str(tmp_path_factory.mktemp("v2_eagle3_tree_head")))
    description = v2_engine("eagle3-tree", TARGET, speculative_config={
        "method": "specx_eagle3", "model": head, "num_speculative_tokens": 8,
        "draft_tree": HEAD_DYNAMIC, "cost_control": False})
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


def test_eagle3_head_tree_cost_control_prunes_on_v2(head_tree_run, v2_heldout_reference):
    """specx_eagle3 dynamic tree with cost control (its default) on V2, a fixed cost model:
    each request's tree is cut to the nodes that pay, some to nothing and some kept as a
    tree, as on V1 (tests/eagle/test_eagle3_engine.py); greedy output equals no
    speculation."""
    assert head_tree_run["pruned"] == v2_heldout_reference
    control = head_tree_run["pruned_control"]
    assert control["rounds"] > 0, control
    sizes = {int(k): v for k, v in control["kept_histogram"].items()}
    assert sizes.get(0, 0) > 0, sizes  # pruned to nothing
    assert any(n >= 2 and c > 0 for n, c in sizes.items()), sizes  # and kept as a tree
    assert 0 < control["kept_nodes"] < control["drafted_nodes"]


def test_eagle3_tree_rounds_of_depth_zero_skip_the_first_pass_on_v2(head_tree_run,
                                                                   v2_heldout_reference):
    """specx_eagle3 dynamic tree on V2, its cost control choosing depth 0 on runs of
    rounds (scripted): those steps skip vLLM's first pass, keeping its inputs (the
    auxiliary hidden states uncombined, in the chain layout of the tree step before); the
    next first pass, and block ends under prefix caching, catch the head's KV up first.
    Greedy output equals no speculation, and every round's trees and first-pass outputs
    equal those of the same depths with every first pass run."""
    from idle_steps import check_idle_steps

    idle = head_tree_run["idle"]
    check_idle_steps(idle, v2_heldout_reference)
    assert max(len(d) for _, drafts in idle["skip_rounds"] for d in drafts) > 4


# specx_mtp trees on V2 (glue/v2_eagle.py's MtpChainV2Speculator: the same head-tree round
# over vLLM's V2 MTPSpeculator), on the MTP fixture as plain attention (VLLM_MLA_DISABLE=1:
# an MLA target's tree is refused on either runner). One V2 engine, the V1 test's tree
# (tests/mtp/test_mtp_engine_plain_attention.py), dynamic then static as above; V1's
# no-speculation output and the same tree engine on V1 are built in this process (V1 on
# the CPU runs without the interpreter: seconds).
MTP_TREE = {"max_nodes": 8, "max_depth": 4, "branching": 2}
MTP_TREE_KW: dict[str, Any] = dict(max_model_len=256, max_num_seqs=8,
                                   kv_cache_memory_bytes=8 * 2**20, skip_tokenizer_init=True)
MLA_OFF = {"VLLM_MLA_DISABLE": "1"}


def set_environ(llm: Any, values: dict[str, str | None]) -> dict[str, str | None]:
    """Runs in the V2 host (``llm`` None): sets (None: removes) environment variables,
    returns their old values. vLLM reads VLLM_MLA_DISABLE when an engine's config is
    built and caches every VLLM_* value while an engine runs (make_llm / shutdown_llm)."""
    import os

    old = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return old


def _mtp_prompts() -> list[list[int]]:
    """Held-out text through the MTP fixture's tokenizer. The 70-token prompt is prefilled
    in two chunks (ENGINE_KWARGS: 64 tokens a step), both in steps without drafts: in a
    step with drafts vLLM's V1 feeds a partly prefilled request's draft its last prompt
    token instead of the token after the chunk, so V1 drafts other trees afterwards (V2
    does not; docs/trees.md, "MTP trees on V2"), which this order keeps out of the V1/V2
    comparison."""
    from transformers import AutoTokenizer
    from v2_cases import MTP_TARGET

    from vllm_specx.fixtures import heldout_prompts as texts

    tok = AutoTokenizer.from_pretrained(MTP_TARGET)
    enc = [tok(t)["input_ids"] for t in texts(4)]
    return [enc[2][:70], enc[0][:5], enc[1][:33], enc[3][:17]]


@pytest.fixture(scope="module")
def mtp_tree_runs(v2_engine, v2_host) -> dict[str, Any]:
    from v2_cases import ENGINE_KWARGS, MTP_TARGET

    from vllm_specx.engine import running_llm
    from vllm_specx.testing.v2_engine import generate_token_ids

    prompts = _mtp_prompts()
    spec = {"method": "specx_mtp", "draft_tree": MTP_TREE, "cost_control": False}
    kwargs = {**ENGINE_KWARGS, **MTP_TREE_KW}
    out: dict[str, Any] = {}
    old = set_environ(None, MLA_OFF)  # this process: the V1 engines
    try:
        with running_llm(MTP_TARGET, **kwargs) as llm:
            out["reference"] = generate_token_ids(llm, prompts, GREEDY)
        with running_llm(MTP_TARGET, speculative_config=spec, **kwargs) as llm:
            out["v1"] = run_head_trees(llm, prompts)
    finally:
        set_environ(None, old)
    # One engine at a time in the host (conftest), and none running while the variable
    # changes: a running engine keeps vLLM's VLLM_* cache on (stopping one clears it).
    for key in list(v2_host.running):
        v2_host.stop(key)
    host_old = v2_host.call(None, f"{__name__}:set_environ", MLA_OFF)
    try:
        description = v2_engine("mtp-tree", MTP_TARGET, speculative_config=spec,
                                **MTP_TREE_KW)
        assert description["speculator"].endswith("MtpChainV2Speculator"), description
        out["v2"] = v2_host.call("mtp-tree", f"{__name__}:run_head_trees", prompts)
    finally:
        if "mtp-tree" in v2_host.running:
            v2_host.stop("mtp-tree")
        v2_host.call(None, f"{__name__}:set_environ", host_old)
    return out


def test_mtp_trees_equal_no_speculation_and_v1_on_v2(mtp_tree_runs):
    """specx_mtp + draft_tree on V2 (plain-attention MTP fixture): greedy output equals
    no speculation (and V1's) with a dynamic tree, requests ending inside a tree and a
    static paths tree; trees were verified as trees, some paths off rank 0 (their K/V and
    hidden rows moved); V1 verifies the same trees (same tree counters, so the same block
    efficiency); the static tree's rank-0 path is the MTP layer's own argmax chain."""
    runs = mtp_tree_runs
    v1, v2, reference = runs["v1"], runs["v2"], runs["reference"]
    assert v2["dynamic"] == reference and v1["dynamic"] == reference
    for n, got, want in zip(HEAD_ENDS, v2["ends"], reference):
        assert got == want[:n]
    assert v2["static"] == reference
    # Pruned by cost control (a fixed cost model): still no speculation's output, and
    # pruned on both runners (V2 may plan one more round than V1: a request's last step).
    assert v2["pruned"] == reference and v1["pruned"] == reference
    for control in (v1["pruned_control"], v2["pruned_control"]):
        assert 0 < control["kept_nodes"] < control["drafted_nodes"], control
        assert control["kept_histogram"].get("0", 0) > 0, control
    # Rounds of depth 0 (scripted) skip the MTP layer's first pass, caught up after, on
    # both runners: the same trees as with every first pass run.
    from idle_steps import check_idle_steps

    check_idle_steps(v1["idle"], reference)
    check_idle_steps(v2["idle"], reference)
    dynamic = v2["dynamic_stats"]
    assert dynamic["tree_requests"] > 0 and dynamic["chain_fallback_steps"] == 0, dynamic
    assert dynamic["tree_nodes"] > 4 * dynamic["tree_requests"], dynamic
    assert dynamic["accepted"] > dynamic["tree_requests"], dynamic  # > 1 per tree
    assert dynamic["compacted"] > 0, dynamic
    assert v2["dynamic_stats"] == v1["dynamic_stats"]
    assert v2["stats"] == v1["stats"]
    full = [(c, t) for c, t in v2["pairs"] if len(t) == len(HEAD_STATIC)]
    assert len(full) > 5, v2["pairs"]
    for chain, tree in full:
        assert [tree[0], tree[2], tree[4], tree[6]] == chain[:4]
        assert tree[0] != tree[1]
