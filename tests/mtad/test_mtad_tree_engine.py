"""MTAD's beams verified as ONE draft tree in one target pass (issue 37), in the real vLLM
CPU engine: ``{"method": "mtad", ..., "draft_tree": true}``.

The draft here is the target itself, so the target accepts deep paths every step; with
B = 3 beams the accepted path runs through nodes that are not the first of their depth
in BFS order, so every step needs the tree positions, the ancestor-only mask and the KV
compaction: greedy output equal to no speculation breaks if any of the three is wrong
(checked by hand: each one disabled on its own makes these tests fail).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from engine_support import make_tiny_pair
from mtad_reference import greedy_generate

pytestmark = pytest.mark.engine

K, B = 3, 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("mtad_tree_models"))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return target_dir, target


class TreeEngine:
    """An in-process engine with MTAD tree drafting, its runner and preemption count."""

    def __init__(self, target_dir: str, spec: dict[str, Any] | None = None) -> None:
        from vllm_specx.engine import make_llm

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise RuntimeError("engine tests need VLLM_ENABLE_V1_MULTIPROCESSING=0")
        self.llm = make_llm(
            target_dir,
            speculative_config=spec or {
                "method": "mtad", "model": target_dir, "num_speculative_tokens": K,
                "num_beams": B, "acceptance_threshold": 0.1, "greedy_drafting": "beam",
                "draft_tree": True, "cost_control": False,  # whole trees, as the reference
            },
            skip_tokenizer_init=True,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=64,  # the 70-token prompt is prefilled in chunks
            block_size=32,
            enable_prefix_caching=True,
            num_gpu_blocks_override=9,  # small: requests get preempted
            disable_log_stats=False,  # vLLM's spec-decode counters (tests/idle_steps.py)
        )
        self.runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.state = self.runner.specx_tree_state
        sched = self.llm.llm_engine.engine_core.engine_core.scheduler
        self.preemptions = 0
        original = sched._preempt_request

        def preempt(*args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            return original(*args, **kwargs)

        sched._preempt_request = preempt

    def generate(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                 use_tqdm=False)
        return sorted(outs, key=lambda o: int(o.request_id))

    def close(self) -> None:
        from vllm_specx.engine import shutdown_llm

        shutdown_llm(self.llm)


@pytest.fixture(scope="module")
def engine(pair):
    eng = TreeEngine(pair[0])
    yield eng
    eng.close()


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]


def test_tree_config_reaches_the_engine(engine):
    """vLLM schedules a whole tree (its K is B * K nodes); the drafter drafts depth K."""
    assert engine.runner.speculative_config.num_speculative_tokens == B * K
    assert engine.runner.drafter.settings["num_speculative_tokens"] == K
    assert engine.runner.rejection_sampler.tree_state is engine.state


def test_greedy_tree_equals_no_speculation(pair, engine):
    """Mixed lengths (a chunked 70-token prefill while others decode), requests ending
    inside a tree (max_tokens 2, 9): every token equals plain greedy decoding."""
    from vllm import SamplingParams

    _, target = pair
    before = dict(vars(engine.state.stats))
    prompts = prompts_of([5, 11, 70, 23], seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (12, 2, 9, 14)]
    for out, prompt, sp in zip(engine.generate(prompts, params), prompts, params):
        assert list(out.outputs[0].token_ids) == greedy_generate(target, prompt,
                                                                 sp.max_tokens), out.request_id
    stats = {k: v - before[k] for k, v in vars(engine.state.stats).items()}
    assert stats["tree_requests"] > 0
    assert stats["compacted"] > 0  # accepted paths off the first BFS nodes were moved
    assert stats["accepted"] > stats["tree_requests"]  # more than one node per tree step


@torch.no_grad()
def reference_logprobs(target: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """The target's log-probability of each generated token, recomputed in one pass."""
    logits = target(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_logprobs_come_from_each_token_s_own_tree_row(pair, engine):
    """vLLM reads a request's j-th logprob from its j-th row; a tree's accepted token was
    verified on its parent's row, which the sampler hands vLLM instead."""
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([7, 19], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=14, logprobs=0)] * 2
    compacted = engine.state.stats.compacted
    for out, prompt in zip(engine.generate(prompts, params), prompts):
        tokens = list(out.outputs[0].token_ids)
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)]
        want = reference_logprobs(target, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, (got, want)
    assert engine.state.stats.compacted > compacted


def test_prefix_caching_and_preemption(pair, engine):
    """Shared prefixes, twice (the second pass hits the prefix cache, whose blocks hold
    compacted tree KV), on a KV cache so small that requests are preempted and
    recomputed: still plain greedy decoding."""
    from vllm import SamplingParams

    _, target = pair
    shared = prompts_of([40], seed=21)[0]
    prompts = [shared + tail for tail in prompts_of([3, 9, 5, 12], seed=22)]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    preempted = engine.preemptions
    cached = []
    for _ in range(2):
        outs = engine.generate(prompts, [params] * len(prompts))
        cached.append(sum(o.num_cached_tokens or 0 for o in outs))
        for out, prompt in zip(outs, prompts):
            assert list(out.outputs[0].token_ids) == greedy_generate(target, prompt, 30)
    assert engine.preemptions > preempted
    assert cached[1] > 0


def test_mixed_batch_of_trees_and_chains(pair, engine):
    """greedy_drafting "chain": greedy requests draft the argmax chain (verified as a
    chain), sampled ones B beams (verified as a tree) in the same steps. Greedy rows equal
    plain greedy decoding; seeded sampled rows are reproducible."""
    from vllm import SamplingParams

    _, target = pair
    drafter = engine.runner.drafter
    drafter.greedy_chain = True
    try:
        prompts = prompts_of([9, 30, 6, 14], seed=11)
        params = [
            SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=0.8, top_k=8, max_tokens=12, seed=5),
            SamplingParams(temperature=0.0, max_tokens=7),
            SamplingParams(temperature=1.0, max_tokens=10, seed=6),
        ]
        before = engine.state.stats.tree_requests
        first = engine.generate(prompts, params)
        assert engine.state.stats.tree_requests > before  # the sampled rows were trees
        for out, prompt, sp in zip(first, prompts, params):
            if sp.temperature == 0.0:
                assert list(out.outputs[0].token_ids) == greedy_generate(
                    target, prompt, sp.max_tokens)
            else:
                assert len(out.outputs[0].token_ids) == sp.max_tokens
        again = engine.generate(prompts, params)
        assert [list(o.outputs[0].token_ids) for o in again] == [
            list(o.outputs[0].token_ids) for o in first]
    finally:
        drafter.greedy_chain = False


def test_penalties_fall_back_to_chain_verification(pair, engine):
    """A repetition penalty changes the target's logits along the output tokens, which a
    tree's rows do not follow: such steps verify the scheduled BFS nodes as a chain (vLLM's
    own penalised verification), and trees resume when the batch has no penalty."""
    from vllm import SamplingParams

    stats = engine.state.stats
    before = (stats.tree_requests, stats.chain_fallback_steps)
    prompts = prompts_of([12, 8], seed=4)
    penalised = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3)
    outs = engine.generate(prompts, [penalised] * 2)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert stats.chain_fallback_steps > before[1]
    assert stats.tree_requests == before[0]


def check_rows(target: Any, prompts: list[list[int]], params: list[Any],
               outs: list[Any]) -> None:
    """Greedy rows equal plain greedy decoding; sampled rows ran to their length."""
    for out, prompt, sp in zip(outs, prompts, params):
        tokens = list(out.outputs[0].token_ids)
        if sp.temperature == 0.0:
            assert tokens == greedy_generate(target, prompt, sp.max_tokens), out.request_id
        else:
            assert len(tokens) == sp.max_tokens


def run_with_tree_cost_control(engine: TreeEngine, prompts: list[list[int]],
                               params: list[Any], value: bool | str = True,
                               ) -> tuple[list[Any], Any, dict[str, Any]]:
    """Generate with the drafter's tree cost control on (``value``: true, or mtad's
    "greedy"; the engine's own is off) under a fixed cost model in which a node pays only
    where its path's value beats ~0.1 of the step's rate; the outputs, the control and the
    drafter's stats. Settings restored."""
    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.glue.tree_cost import tree_cost_control_for

    drafter = engine.runner.drafter
    assert drafter.settings["cost_control"] is False  # the engine's, turned off
    drafter.settings = {**drafter.settings, "cost_control": value}
    drafter._tree_cost = None
    try:
        control = tree_cost_control_for(drafter)
        assert control is not None
        control.fixed_costs = StepCosts(target_base=0.0, target_per_request=1.0,
                                        target_per_token=0.1, draft_pass=0.0, draft_row=0.0)
        outs = engine.generate(prompts, params)
        stats = drafter.specx_stats()
    finally:
        drafter.settings = {**drafter.settings, "cost_control": False}
        drafter._tree_cost = None
    return outs, control, stats


def test_cost_control_prunes_the_beam_tree(pair, engine):
    """``"cost_control": true`` with ``draft_tree`` on mtad (:func:`run_with_tree_cost_control`):
    the beams run to the depth chosen before the first pass and each request's beam tree
    is cut to the nodes that pay, to several sizes, some to none; greedy rows equal plain
    greedy decoding, and sampled rows (MTAD's deepest passing node, on the cut tree) run
    to their length."""
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([6, 17, 25, 9], seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=12) for _ in prompts[:3]]
    params.append(SamplingParams(temperature=0.9, max_tokens=10, seed=2, ignore_eos=True))
    before = engine.state.stats.tree_requests
    outs, control, stats = run_with_tree_cost_control(engine, prompts, params)
    check_rows(target, prompts, params, outs)
    assert engine.state.stats.tree_requests > before  # the cut trees were verified as trees
    sizes = {int(k) for k, v in control.describe()["kept_histogram"].items() if v}
    assert control.stats.rounds > 0, control.describe()
    assert 0 < control.stats.kept_nodes < control.stats.drafted_nodes, control.describe()
    assert len(sizes) >= 2 and max(sizes) >= 2, sizes
    # The drafter reports its tree control (vllm-specx bench prints it).
    assert stats["tree_cost_control"]["kept_nodes"] == control.stats.kept_nodes


def test_greedy_control_cuts_only_all_greedy_beam_trees(pair, engine):
    """mtad's ``"cost_control": "greedy"`` with ``draft_tree``: a batch with a
    sampled request (from its first step to its last) drafts and verifies its whole beam
    trees, the control weighing none; a batch of greedy requests has its trees cut as with
    ``true``. Greedy rows equal plain greedy decoding in both."""
    from vllm import SamplingParams

    _, target = pair
    prompts = prompts_of([6, 17, 25, 9], seed=17)  # one first step for all four (64 tokens)
    # The sampled request outlives the greedy ones whatever its draws (32 tokens: at
    # least 8 steps; 4 tokens: at most 4).
    mixed = [SamplingParams(temperature=0.9, max_tokens=32, seed=4, ignore_eos=True),
             *[SamplingParams(temperature=0.0, max_tokens=4) for _ in prompts[1:]]]
    before = engine.state.stats.tree_nodes
    outs, control, _ = run_with_tree_cost_control(engine, prompts, mixed, value="greedy")
    check_rows(target, prompts, mixed, outs)
    assert engine.state.stats.tree_nodes - before > 0  # whole trees verified
    assert control.stats.rounds == 0 and control.stats.drafted_nodes == 0, control.describe()
    greedy = [SamplingParams(temperature=0.0, max_tokens=12) for _ in prompts]
    outs, control, _ = run_with_tree_cost_control(engine, prompts, greedy, value="greedy")
    check_rows(target, prompts, greedy, outs)
    assert control.stats.rounds > 0, control.describe()
    assert 0 < control.stats.kept_nodes < control.stats.drafted_nodes, control.describe()


def test_depth_zero_rounds_skip_the_draft_models_first_pass(pair, engine):
    """mtad's beam tree with cost control, its depths scripted (``idle_steps``: runs of
    one and four depth-0 rounds): a round of depth 0 is a plain step that skips the
    draft model's first pass, its draft KV caught up before the next first pass that
    runs; every tree drafted after a skip, and every first pass's output, equals that
    with every first pass run, and greedy output equals no speculation."""
    from idle_steps import check_idle_steps, run_idle_steps
    from vllm import SamplingParams

    _, target = pair
    drafter = engine.runner.drafter
    prompts = prompts_of([6, 17, 25, 9], seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    try:
        idle = run_idle_steps(engine.llm, drafter, B * K, prompts, params,
                              fresh_prefix_cache=True, tree=True)
    finally:
        drafter._tree_cost = None
    check_idle_steps(idle, [greedy_generate(target, p, 16) for p in prompts])
