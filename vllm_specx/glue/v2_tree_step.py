"""Draft trees on Model Runner V2 (CPU and CUDA): ONE target pass over every request's tree.

The V2 counterpart of ``glue/tree_step.py`` (V1), sharing its pure parts (the tree's
depths and ancestor mask, :meth:`~.tree_step.TreeState.tree_for`, the KV move
:meth:`~.tree_step.TreeState.compact_path_kv`). A tree drafter on V2
(``MTADV2Speculator`` / ``DraftTreeV2Speculator`` with ``draft_tree``) drafts each
request's tree flattened in BFS order; the ``v2_ragged_draft_lengths`` patch hands the
scheduler each request's tree size, and V2 feeds the nodes from its own
``req_states.draft_tokens`` as a chain of drafts. Three named patches of V2's
``GPUModelRunner`` (also run by V2's ``CPUModelRunner``) make the step a tree step; all
are no-ops unless the runner carries a ``TreeState`` (``runner.specx_tree_state``, built by
``install_v2_speculator`` when ``draft_tree`` is on):

1. ``prepare_attn`` (``v2_tree_step_inputs``, after vLLM's): V2 computes the slot mapping
   from the positions there, so the nodes keep the chain slots ``ctx + 1 + i``; only
   after that does a tree request's node ``i`` get its RoPE position ``ctx + depth(i)``
   (``input_batch.positions``, which the model reads), and the step's ancestor-only query
   masks are set (``attention.query_masks``: read by the CPU attention op, and on CUDA by
   the route to the Triton tree kernel).
2. ``execute_model`` (``v2_tree_step_forward``): around the whole call, which on V2 holds
   the target's forward and nothing else that attends (the speculator drafts in
   ``sample_tokens``): it keeps the step's ``scheduler_output`` for step 1 and, when the
   call ends, clears the masks and puts the chain positions back, which V2's rejection
   sampler (``gather_draft_sampled``: positions of the logits rows, its placeholder
   test) and the speculator's first pass read.
3. ``sample`` (``v2_tree_step_compaction``, after vLLM's, i.e. after the specx V2
   sampler ran the tree rule, ``glue/v2_sampler.SpecxV2RejectionSampler.verify_trees``):
   the accepted path's target K/V moves from the slots of its nodes' flat indices to the
   contiguous slots ``ctx + 1 .. ctx + a``, and the step's input ids become the chain
   layout ``[root, path..., rejected]``, so the speculator's first pass
   (``StandaloneARSpeculator._prefill``, over the verified tokens plus the new one) sees
   the chain it would have seen had the path been drafted as one, and rewrites the draft
   model's KV of those positions.

On CUDA (issue 34) the same three patches run unchanged in what they compute: the masks
set in step 1 are the step-scoped ``cpu_ops.attention.query_masks`` that the
``triton_attention_tree_route`` patch reads in V2's ``TritonAttentionImpl`` layers (V2
builds the same ``TritonAttentionMetadata`` for them; ``glue/cuda_tree_attention.py``),
the compaction moves K/V with the CUDA backend's ``copy_slots`` (``Backend.copy_slots``,
device indexing), the step's input ids and positions are read back to the host once per
step (one sync each, only when a request may be a tree), and the host-to-device writes
go from pinned memory. A tree config on CUDA runs eager (``enforce_eager``: no CUDA
graph, whose replay would skip the route; checked again in ``runner_hook.new_tree_state``).

A step is verified as the chain V2 scheduled (always correct, only accepting less) when
a request in it has a structured output (V2's grammar masks the scheduled chain's rows)
or a logits processor that reads the output tokens (penalties, bad words, logit bias /
allowed tokens / min_tokens, a thinking budget, a custom processor):
:func:`v2_chain_only_reason`, counted in ``TreeStats.chain_fallback_steps``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specx.glue.patch_base import VllmPatch
from vllm_specx.glue.tree_step import (
    StepTree,
    TreeState,
    TreeStep,
    _target_kv_caches,
    _to_device,
    tree_depths,
    tree_query_mask,
)

_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"

__all__ = ["V2_TREE_STEP_PATCHES", "v2_chain_only_reason"]


@dataclass
class _V2StepContext:
    """What the three V2 patches pass one another within one step."""

    scheduler_output: Any = None
    positions: torch.Tensor | None = None  # the step's input_batch.positions
    masks: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


def _state(runner: Any) -> TreeState | None:
    return getattr(runner, "specx_tree_state", None)


def _context(runner: Any) -> _V2StepContext:
    ctx = getattr(runner, "specx_v2_tree_context", None)
    if ctx is None:
        ctx = runner.specx_v2_tree_context = _V2StepContext()
    return ctx


def v2_chain_only_reason(runner: Any, input_batch: Any, scheduler_output: Any) -> str | None:
    """Why this V2 step's drafts must be verified as chains, or None (the V1 rule,
    ``tree_step.chain_only_reason``, over V2's per-request sampler state): V2 applies
    these along the chain's output tokens, a tree's rows would need them along each
    node's path."""
    if getattr(scheduler_output, "has_structured_output_requests", False):
        return "structured output"
    sampler = runner.sampler
    idx = np.asarray(input_batch.idx_mapping_np[: input_batch.num_reqs])
    for processor in sampler.logits_processors:
        flags = getattr(processor, "use_penalty", getattr(processor, "use_logit_bias", None))
        if flags is None and hasattr(processor, "num_bad_words"):
            flags = processor.num_bad_words.np > 0
        if flags is None:
            return type(processor).__name__  # a custom processor may read the outputs
        if bool(np.any(flags[idx])):
            return type(processor).__name__
    budget = getattr(sampler, "thinking_budget_state", None)
    if getattr(budget, "enabled", False) and bool(np.any(budget.use_thinking_budget[idx])):
        return "thinking budget"
    return None


def begin_step(state: TreeState, runner: Any, input_batch: Any,
               slot_mappings: torch.Tensor) -> None:
    """Step 1 of the module doc: tree positions and masks (slots already computed)."""
    from vllm_specx.cpu_ops.attention import QueryMasks, query_masks

    ctx = _context(runner)
    state.step = None
    per_req = input_batch.num_draft_tokens_per_req
    if per_req is None or input_batch.num_draft_tokens == 0 or not state.drafted:
        return
    reason = v2_chain_only_reason(runner, input_batch, ctx.scheduler_output)
    if reason is not None:
        state.stats.chain_fallback_steps += 1
        return
    num_reqs = input_batch.num_reqs
    qsl = input_batch.query_start_loc_np
    scheduled = input_batch.num_scheduled_tokens
    positions = input_batch.positions
    candidates = [r for r in range(num_reqs)
                  if int(per_req[r]) and int(scheduled[r]) == int(per_req[r]) + 1
                  and not bool(input_batch.is_prefilling_np[r])]
    if not candidates:
        return
    # V2 built the step's input ids and positions on the device (Triton kernels): one
    # host copy of each for the whole step (a sync on CUDA, after V2's kernels ran on
    # this stream), not a read per request.
    num_tokens = int(qsl[num_reqs])
    ids_host = input_batch.input_ids[:num_tokens].to("cpu", torch.int64)
    pos_host = positions[:num_tokens].to("cpu", torch.int64)
    trees: list[StepTree] = []
    masks: dict[int, torch.Tensor] = {}
    for r in candidates:
        n = int(per_req[r])
        start = int(qsl[r])
        # The drafts as V2 feeds them (from its req_states.draft_tokens): the scheduler
        # got placeholders, so the fed tokens are what must be the drafted tree.
        fed = ids_host[start + 1: start + 1 + n].tolist()
        tree = state.tree_for(input_batch.req_ids[r], n, fed)
        if tree is None:
            continue
        tokens, parents = tree
        root = int(pos_host[start])
        # RoPE position of node i: root + depth(i); its KV slot stays root + 1 + i
        # (onto a GPU from pinned memory, without blocking the host).
        positions[start + 1: start + 1 + n] = _to_device(root + tree_depths(parents),
                                                         positions)
        slots = {gid: slot_mappings[gid, start: start + n + 1].clone()
                 for gid in range(slot_mappings.shape[0])}
        trees.append(StepTree(r, start, root, parents, tokens, slots,
                              state_index=int(input_batch.idx_mapping_np[r])))
        masks[r] = tree_query_mask(parents)
    if trees:
        step = TreeStep(trees, QueryMasks.causal_except(
            [int(x) for x in scheduled[:num_reqs]], masks))
        state.step = step
        ctx.positions = positions
        ctx.masks.enter_context(query_masks(step.masks))


def end_forward(state: TreeState, runner: Any) -> None:
    """Step 2's end: masks cleared, chain positions back (the step stays for step 3)."""
    ctx = _context(runner)
    ctx.masks.close()
    ctx.scheduler_output = None
    step, positions, ctx.positions = state.step, ctx.positions, None
    if step is None or positions is None:
        return
    for tree in step.trees:
        n = tree.parents.shape[0]
        positions[tree.start + 1: tree.start + 1 + n] = torch.arange(
            tree.ctx + 1, tree.ctx + 1 + n, dtype=positions.dtype, device=positions.device)


def finish_step(state: TreeState, runner: Any, input_batch: Any) -> None:
    """Step 3: the accepted path's K/V into contiguous slots, chain-layout input ids."""
    step, state.step = state.step, None
    if step is None:
        return
    # An EAGLE head's next first pass moves the accepted nodes' hidden rows the same way
    # (v2_eagle: path_rows_to_chain); draft-model speculators never read it.
    state.last_step = step
    layers = _target_kv_caches(runner, getattr(runner.speculator, "draft_attn_layer_names", ()))
    input_ids = input_batch.input_ids
    for tree in step.trees:
        nodes = state.compact_path_kv(step, tree, layers)
        a = nodes.shape[0]
        if a:
            input_ids[tree.start + 1: tree.start + 1 + a] = _to_device(tree.tokens[nodes],
                                                                       input_ids)


class V2TreeStepInputs(VllmPatch):
    name = "v2_tree_step_inputs"
    target = f"{_RUNNER}.prepare_attn"
    replaces = ("Model Runner V2's GPUModelRunner.prepare_attn, which gathers the block "
                "tables and computes the step's slot mapping from the positions")
    why = ("draft trees on V2: after vLLM's slot mapping (nodes keep their chain slots), a "
           "tree request's nodes get the RoPE position ctx + depth and the step's "
           "ancestor-only query masks are set (the CPU attention op reads them; on CUDA the "
           "triton_attention_tree_route patch does); a no-op without a tree config")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def prepare_attn(self_: Any, input_batch: Any, *args: Any, **kw: Any) -> Any:
            out = original(self_, input_batch, *args, **kw)
            state = _state(self_)
            if state is not None and self_.pcp_manager is None:
                begin_step(state, self_, input_batch, out[1])
            return out

        return prepare_attn


class V2TreeStepForward(VllmPatch):
    name = "v2_tree_step_forward"
    target = f"{_RUNNER}.execute_model"
    replaces = ("Model Runner V2's GPUModelRunner.execute_model, which prepares the step's "
                "inputs and runs the target model's forward")
    why = ("draft trees on V2: the tree masks set for the target's forward are cleared and "
           "the chain positions put back when the call ends (V2's sampler and the "
           "speculator read them); keeps the step's scheduler output for the tree inputs; a "
           "no-op without a tree config")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def execute_model(self_: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
            state = _state(self_)
            if state is None:
                return original(self_, scheduler_output, *args, **kw)
            _context(self_).scheduler_output = scheduler_output
            try:
                return original(self_, scheduler_output, *args, **kw)
            finally:
                end_forward(state, self_)

        return execute_model


class V2TreeStepCompaction(VllmPatch):
    name = "v2_tree_step_compaction"
    target = f"{_RUNNER}.sample"
    replaces = ("Model Runner V2's GPUModelRunner.sample, which computes the logits and runs "
                "the rejection sampler (here the specx V2 sampler)")
    why = ("draft trees on V2: right after verification the accepted path's target K/V "
           "moves to the contiguous slots after the root and the step's input ids are "
           "rewritten in the chain layout the speculator's first pass reads; a no-op "
           "without a tree step")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def sample(self_: Any, hidden_states: Any, input_batch: Any, *args: Any,
                   **kw: Any) -> Any:
            out = original(self_, hidden_states, input_batch, *args, **kw)
            state = _state(self_)
            if state is not None:
                finish_step(state, self_, input_batch)
            return out

        return sample


V2_TREE_STEP_PATCHES: tuple[VllmPatch, ...] = (V2TreeStepInputs(), V2TreeStepForward(),
                                               V2TreeStepCompaction())
