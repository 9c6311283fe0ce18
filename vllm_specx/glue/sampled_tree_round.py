"""The draft-model tree round for sampled requests: i.i.d. children for the ``"sampled"``
tree rule (``adaptive`` with ``draft_tree``, ``"sampled_children"`` on, the default).

:class:`~vllm_specx.glue.mtad_proposer.DraftTreeRound` runs this round instead of its
top-k beam tree whenever the batch has a sampled request (temperature > 0), the drafter
shares the target's vocabulary and the knob is on. The tree is
:func:`~vllm_specx.algorithms.sampled_tree.sampled_spine_tree` with the draft model as
its callback: after vLLM's first pass (the root's distribution), ONE lookahead pass per
depth feeds every request the token it expands, in the request's own lookahead slots,
exactly as a chain round feeds its drafts (so the drafter costs what a chain of
``max_depth`` drafts costs). Greedy requests of the same batch get their top-``branching``
tokens per depth (their walk follows the target's argmax; an all-greedy batch keeps the
beam tree).

Every node's draft distribution row (the warped ``q`` its parent's children were drawn
from) goes to the sampler through ``take_last_draft_probs`` as ``[R, N, V]``; the runner
slices ``[row, :num_draft]`` and the specx sampler then verifies the tree with the
``"sampled"`` rule. On Model Runner V2 the same round runs
(``glue/v2_speculators.DraftTreeV2Speculator``): the rows reach the specx V2 sampler by
request-state row (``glue/v2_sampler.store_draft_q``). A step that verifies the scheduled
drafts as a chain (penalties, grammars, a cut tree) runs the standard rule with the same
rows, which is lossless too: each node, in BFS order, is a fresh draw from its row given
the nodes before it.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_specx.algorithms.beam_draft import greedy_mask_from_temperature, warp_logprobs
from vllm_specx.algorithms.sampled_tree import depth_sizes, sampled_spine_tree
from vllm_specx.glue.draft_passes import RoundStart
from vllm_specx.glue.tree_cost import TreeCostControl
from vllm_specx.methods import SAMPLED_CHILDREN_KEY, draft_model_tree, tree_max_nodes


def sampled_children_on(proposer: Any) -> bool:
    """Whether a batch with a sampled request drafts i.i.d. children: the knob is on and
    the drafter's rows are over the target's vocabulary (a drafter with another
    tokenizer keeps the top-k tree, which the deterministic rule verifies)."""
    shape = draft_model_tree(proposer.settings)
    if shape is None or not shape.get(SAMPLED_CHILDREN_KEY, True):
        return False
    return not getattr(proposer, "use_heterogeneous_vocab", False)


def wants_sampled_tree(proposer: Any, sampling_metadata: Any, num_reqs: int) -> bool:
    """Whether this round drafts i.i.d. children: :func:`sampled_children_on`, and some
    request samples."""
    if not sampled_children_on(proposer):
        return False
    greedy = greedy_mask_from_temperature(sampling_metadata.temperature, num_reqs)
    return not bool(greedy.all())


def sampled_tree_depths(settings: dict[str, Any], k: int) -> int:
    """How many depths a round of i.i.d. children can draft: the shape's ``max_depth``
    cut by the node budget (``min(max_nodes, K)``, ``branching`` nodes a depth); 0 for a
    round with no budget."""
    shape = draft_model_tree(settings)
    assert shape is not None
    budget = min(int(tree_max_nodes(settings) or 0), int(k))
    if budget <= 0:
        return 0
    return len(depth_sizes(budget, int(shape["max_depth"]), int(shape["branching"])))


def sampled_tree_round(proposer: Any, start: RoundStart, sampling_metadata: Any,
                       depth: int | None = None, control: TreeCostControl | None = None,
                       ) -> list[list[int]] | torch.Tensor:
    """Draft every request's tree (module docstring); returns each request's BFS tokens
    and leaves the trees in the runner's ``TreeState`` and the q rows for the sampler.
    ``depth``: the round's depth, chosen before drafting by the tree cost ``control``
    (None: the shape's ``max_depth``), which then learns from their verification what
    each depth was worth (:meth:`TreeCostControl.verified_whole`); the trees are verified
    whole."""
    settings = proposer.settings
    shape = draft_model_tree(settings)
    assert shape is not None
    max_depth = int(shape["max_depth"]) if depth is None else int(depth)
    num_reqs = start.num_reqs
    logits = proposer.model.compute_logits(start.out)
    proposer.last_sample_positions = start.sample_positions
    budget = min(int(tree_max_nodes(settings) or 0), int(start.k))
    if budget == 0:
        return start.no_drafts()
    md = sampling_metadata

    def warp(lg: torch.Tensor) -> torch.Tensor:
        # The request's own temperature, top-k and top-p, as the beam rounds warp.
        if md.temperature is None:
            return warp_logprobs(lg)
        return warp_logprobs(lg, md.temperature, md.top_k, md.top_p)

    greedy = greedy_mask_from_temperature(md.temperature, num_reqs, device=logits.device)
    passes = proposer.lookahead_passes(start.cad, start.sample_positions, start.base_seq_lens)
    rows = torch.arange(num_reqs, dtype=torch.int64)
    fed = {"tokens": 0, "passes": 0}

    def next_logprobs(path: torch.Tensor) -> torch.Tensor:
        # The newest expanded token at P + d; the earlier ones' KV is already in the slots.
        d = path.shape[1]
        first = torch.full((num_reqs,), d - 1, dtype=torch.int64)
        hidden = passes.run(rows, path.to(torch.int64), first)
        fed["tokens"] += num_reqs
        fed["passes"] += 1
        return warp(proposer.model.compute_logits(hidden))

    tree = sampled_spine_tree(
        warp(logits), next_logprobs, max_nodes=budget, max_depth=max_depth,
        branching=int(shape["branching"]), greedy=greedy, generators=md.generators or None)
    n = tree.tokens.shape[1]
    proposer._sampled_q = tree.node_q().contiguous()
    tokens_cpu = tree.tokens.to("cpu")
    parents_cpu = tree.parents.to("cpu")
    runner = proposer.model_runner
    req_ids = list(start.req_ids if start.req_ids is not None
                   else runner.input_batch.req_ids[:num_reqs])
    # The live requests: V1's runner.requests, V2's request states (Model Runner V2 runs
    # this round too: glue/v2_speculators.DraftTreeV2Speculator).
    live = getattr(runner, "requests", None)
    if live is None:
        live = runner.req_states.req_id_to_index
    proposer.tree_state.record_round(req_ids, list(tokens_cpu), list(parents_cpu),
                                     live_req_ids=live)
    sizes = depth_sizes(budget, max_depth, int(shape["branching"]))
    if control is not None:
        control.verified_whole(req_ids, sizes)
        control.end(fed["passes"], fed["tokens"])
    depth = len(sizes)
    proposer.stats.record(num_reqs, depth, 1, start.first_tokens, fed["tokens"],
                          fed["passes"], request_passes=num_reqs + fed["tokens"])
    proposer.stats.tree_nodes += num_reqs * n
    proposer.sampled_tree_rounds += 1
    return tokens_cpu.tolist()
