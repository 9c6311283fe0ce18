"""Draft trees in vLLM's V1 model runner on CPU: ONE target pass over every request's tree.

A tree drafter (``mtad`` or ``adaptive`` with ``draft_tree``) hands the scheduler each
request's tree as its draft tokens, flattened in breadth-first order, so the scheduler, the KV-cache
bookkeeping and vLLM's spec-decode counters see a chain of ``n`` drafts (draft count =
tree size). What makes the step a tree step is done here, around three methods of the
runner (the ``tree_step_*`` patches below, all no-ops unless the runner carries a
:class:`TreeState`, i.e. a tree config is on):

1. ``_prepare_inputs`` (after vLLM's): each tree request's query tokens are [root (the
   last accepted token), nodes in BFS order]; vLLM already mapped node ``i`` to KV slot
   ``ctx + 1 + i`` (its chain position), which stays. Its RoPE position becomes
   ``ctx + depth(i)``, and the step's ancestor-only query masks are built
   (:class:`vllm_specx.cpu_ops.attention.QueryMasks`).
2. ``_model_forward`` (the target's forward only): runs inside
   ``attention.query_masks(...)``, the CPU attention op's named side channel, set before
   and cleared after. The drafter's passes never see it.
3. ``_sample`` (after vLLM's, i.e. after the specx sampler ran the tree rule and left the
   accepted nodes in :attr:`TreeStep.accepted`): the accepted path's target K/V is moved
   from the slots of its nodes' flat indices to the contiguous slots ``ctx + 1 ..
   ctx + a`` of every target attention layer, and the step's input ids and positions are
   rewritten into the chain layout ``[root, path..., rejected]`` at chain positions, so
   the drafter's first pass (vLLM's, over "the verified tokens plus the new token") sees
   exactly the chain it would see had the path been drafted as one. Rejected siblings'
   K/V lies past the request's sequence length from then on and is overwritten before it
   could be read. The draft model's own KV needs no compaction: its first pass rewrites
   the draft KV of every verified token each round.

On CPU the masks go to this project's CPU attention op; on CUDA (vLLM's ``TRITON_ATTN``
backend, either runner) the same step-scoped masks route every target attention layer
to the Triton tree kernel (``glue/cuda_tree_attention.py``, the
``triton_attention_tree_route`` patch). The compaction moves K/V with the selected
device backend's ``copy_slots`` (``backends/cpu.py``, ``backends/cuda.py``);
host-to-device copies go from pinned memory without a host sync. A tree
config on Ascend is refused before start (``vllm_specx.config``). Model Runner V2 runs the same
step through its own three seams (``glue/v2_tree_step.py``), sharing the pure parts here:
the tree's depths and mask, which drafted tree a request's scheduled drafts are
(:meth:`TreeState.tree_for`) and the KV move (:func:`compact_path_kv`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specx.glue.patch_base import VllmPatch

logger = logging.getLogger("vllm.specx")

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth (1 = child of the root) of every node of one tree in BFS order."""
    depth = torch.zeros(parents.shape[0], dtype=torch.int64)
    for i, p in enumerate(parents.tolist()):
        depth[i] = 1 if p < 0 else int(depth[p]) + 1
    return depth


def tree_query_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[n + 1, n + 1]`` ancestor mask over the query rows [root, node 0, ...]: a row sees
    the root, its ancestors and itself."""
    n = parents.shape[0]
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    mask[0, 0] = True
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i + 1] = mask[p + 1]
        mask[i + 1, i + 1] = True
    return mask


def is_chain(parents: torch.Tensor) -> bool:
    """True when the tree is a single path in order (node i's parent is i - 1)."""
    return bool(torch.equal(parents, torch.arange(-1, parents.shape[0] - 1)))


@dataclass
class StepTree:
    """One tree request of the step."""

    row: int  # the request's index in the batch
    start: int  # its root's index among the step's query tokens
    ctx: int  # the root's position (the request's computed tokens)
    parents: torch.Tensor  # [n] int64, BFS order, -1 = child of the root
    tokens: torch.Tensor  # [n] the node tokens
    slots: dict[int, torch.Tensor]  # KV cache group -> [n + 1] slots of root + nodes
    state_index: int = -1  # Model Runner V2: the request's request-state row


@dataclass
class TreeStep:
    """What the runner hooks and the sampler share for one step."""

    trees: list[StepTree]
    masks: Any  # cpu_ops.attention.QueryMasks
    # row -> the accepted nodes (indices within the request, root to leaf): the sampler's
    accepted: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class TreeStats:
    """Tree steps seen by the runner (for tests and the bench)."""

    tree_requests: int = 0  # request-steps verified as a tree
    tree_nodes: int = 0  # their draft nodes
    accepted: int = 0  # their accepted nodes
    compacted: int = 0  # request-steps whose path had to be moved
    chain_fallback_steps: int = 0  # steps verified as chains (chain_only_reason)


def chain_only_reason(sampling_metadata: Any) -> str | None:
    """Why this step's drafts must be verified as chains, or None: something in the batch
    changes the target's logits along the output tokens (see ``TreeState.begin_step``)."""
    md = sampling_metadata
    if not md.no_penalties:
        return "penalties"
    if md.bad_words_token_ids:
        return "bad words"
    if md.allowed_token_ids_mask is not None:
        return "allowed_token_ids"
    for processor in md.logitsprocs.non_argmax_invariant:
        # vLLM's built-in ones are idle unless a request set min_tokens / logit_bias.
        state = getattr(processor, "min_toks", getattr(processor, "biases", None))
        if state is None or state:
            return type(processor).__name__
    return None


class TreeState:
    """Per runner: the trees the drafter drafted (by request id, until it drafts again for
    that request) and the current step's trees. Built by the runner hook when a tree
    config is on; the drafter, the sampler and the three patches below share it."""

    def __init__(self) -> None:
        self.drafted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tokens, parents)
        self.step: TreeStep | None = None
        # The step verified last (None: no tree request in it), kept after the step for
        # the EAGLE heads' drafter: its first pass reads the target's hidden states in
        # the chain layout too (glue/eagle_tree_proposer.py, ``path_rows_in_chain_order``).
        self.last_step: TreeStep | None = None
        self.stats = TreeStats()

    def record_round(self, req_ids: list[str], tokens: list[torch.Tensor],
                     parents: list[torch.Tensor], live_req_ids: Any = None) -> None:
        """The drafter's round: request ``req_ids[i]`` drafted ``tokens[i]`` with
        ``parents[i]`` (BFS). Entries of requests no longer alive are dropped."""
        for rid, tok, par in zip(req_ids, tokens, parents):
            self.drafted[rid] = (tok.to("cpu", torch.int64), par.to("cpu", torch.int64))
        if live_req_ids is not None:
            for rid in [r for r in self.drafted if r not in live_req_ids]:
                del self.drafted[rid]

    def tree_for(self, req_id: str, n: int, scheduled: Any
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (tokens, parents) of request ``req_id``'s drafted tree as the ``n`` drafts
        the step verifies, or None: verify them as the chain vLLM scheduled.

        ``scheduled``: the step's draft tokens of the request as the runner will feed
        them. The scheduler may cut the BFS list (a prefix of a BFS list is a tree) or a
        grammar may invalidate drafts (-1): anything but the drafted tokens is verified
        as the chain vLLM scheduled, which is always correct; so is a tree that is a
        chain."""
        drafted = self.drafted.get(req_id)
        if n == 0 or drafted is None:
            return None
        tokens, parents = drafted[0][:n], drafted[1][:n]
        if tokens.shape[0] != n or [int(t) for t in scheduled] != tokens.tolist():
            return None
        if is_chain(parents):
            return None
        return tokens, parents

    # -- 1. before the target forward ---------------------------------------------------
    def begin_step(self, runner: Any, scheduler_output: Any,
                   num_scheduled_tokens: np.ndarray, spec_decode_metadata: Any) -> None:
        from vllm_specx.cpu_ops.attention import QueryMasks

        self.step = None
        if spec_decode_metadata is None or not self.drafted:
            return
        reason = chain_only_reason(runner.input_batch.sampling_metadata)
        if reason is not None:
            # Penalties, bad words, allowed tokens and non-argmax-invariant logits
            # processors are applied along the chain's output tokens (vLLM's rejection
            # sampler); a tree's rows would need them along each node's path. The step's
            # drafts are then verified as the chain vLLM scheduled (BFS order), which is
            # always correct, only less likely to be accepted.
            self.stats.chain_fallback_steps += 1
            return
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.np[: num_reqs + 1]
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        trees: list[StepTree] = []
        masks: dict[int, torch.Tensor] = {}
        for r, (req_id, n) in enumerate(zip(batch.req_ids[:num_reqs],
                                            spec_decode_metadata.num_draft_tokens)):
            if int(num_scheduled_tokens[r]) != n + 1:
                continue
            tree = self.tree_for(req_id, n, scheduled.get(req_id, []))
            if tree is None:
                continue
            tokens, parents = tree
            if _uses_structured_output(runner, req_id):
                # vLLM's grammar checks the drafts and builds each row's bitmask along the
                # scheduled chain (BFS order), not along each node's path: verified as that
                # chain, which is what the bitmask is right for.
                continue
            start = int(qsl[r])
            # The root's position, from the host copy (runner.positions is on the GPU
            # on CUDA; synchronous scheduling, so the host count is exact).
            ctx = int(batch.num_computed_tokens_cpu[r])
            # RoPE position of node i: ctx + depth(i); its KV slot stays ctx + 1 + i.
            runner.positions[start + 1: start + 1 + n] = _to_device(
                ctx + tree_depths(parents), runner.positions)
            slots = {
                gid: batch.block_table[gid].slot_mapping.gpu[start: start + n + 1].clone()
                for gid in range(len(runner.kv_cache_config.kv_cache_groups))
            }
            trees.append(StepTree(r, start, ctx, parents, tokens, slots))
            masks[r] = tree_query_mask(parents)
        if trees:
            self.step = TreeStep(
                trees, QueryMasks.causal_except([int(x) for x in num_scheduled_tokens[:num_reqs]],
                                                masks))

    # -- 3. after verification -------------------------------------------------------------
    def finish_step(self, runner: Any) -> None:
        step, self.step = self.step, None
        self.last_step = step
        if step is None:
            return
        layers = _target_kv_caches(
            runner, getattr(runner.drafter, "_draft_attn_layer_names", ()))
        for tree in step.trees:
            n = tree.parents.shape[0]
            nodes = self.compact_path_kv(step, tree, layers)
            a = nodes.shape[0]
            # The chain layout for the drafter's first pass: [root, path..., rest].
            s = tree.start
            if a:
                for buf in _input_id_buffers(runner):
                    buf[s + 1: s + 1 + a] = _to_device(tree.tokens[nodes], buf)
            runner.positions[s + 1: s + 1 + n] = torch.arange(
                tree.ctx + 1, tree.ctx + 1 + n, dtype=runner.positions.dtype,
                device=runner.positions.device)

    def compact_path_kv(self, step: TreeStep, tree: StepTree,
                        layers: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """Move ``tree``'s accepted path's target K/V (at the slots of its nodes' flat
        indices) to the contiguous slots after the root in every layer of ``layers``
        (KV cache group -> caches), count it, and return the path's node indices."""
        path = step.accepted.get(tree.row)
        if path is None:
            raise RuntimeError(
                f"vllm-specx: the sampler left no verdict for tree request row {tree.row}")
        a = len(path)
        self.stats.tree_requests += 1
        self.stats.tree_nodes += tree.parents.shape[0]
        self.stats.accepted += a
        nodes = torch.tensor(path, dtype=torch.int64)
        if a and not torch.equal(nodes, torch.arange(a)):
            self.stats.compacted += 1
            copy_slots = _copy_slots()
            for gid, caches in layers.items():
                slots = tree.slots[gid]
                src = slots[1 + _to_device(nodes, slots)]
                dst = slots[1: 1 + a]
                for kv in caches:
                    copy_slots(kv, src, dst)
        return nodes


def _copy_slots() -> Any:
    """The K/V move of the selected device backend (``Backend.copy_slots``: the CPU
    attention's layout on CPU, vLLM's Triton backend's on CUDA, the backend a CUDA tree
    config runs on), for both runners' compaction; the device is chosen in one place,
    ``backends.select_backend``."""
    from vllm_specx.backends import select_backend

    return select_backend().copy_slots


def _to_device(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (a host tensor) as ``like``'s device and dtype; onto a GPU from pinned
    memory without blocking the host (the caching host allocator keeps the pinned block
    until the copy ran)."""
    values = values.to(like.dtype)
    if like.device.type != "cuda":
        return values.to(like.device)
    return values.pin_memory().to(like.device, non_blocking=True)


def _uses_structured_output(runner: Any, req_id: str) -> bool:
    state = runner.requests.get(req_id)
    params = getattr(state, "sampling_params", None)
    return getattr(params, "structured_outputs", None) is not None


def _input_id_buffers(runner: Any) -> list[torch.Tensor]:
    bufs = [runner.input_ids.gpu]
    if runner.input_ids.cpu.data_ptr() != runner.input_ids.gpu.data_ptr():
        bufs.append(runner.input_ids.cpu)
    return bufs


def _target_kv_caches(runner: Any, draft_layer_names: Any) -> dict[int, list[torch.Tensor]]:
    """The target's attention KV caches per KV cache group (the drafter's layers, named
    in ``draft_layer_names``, share the groups but not the tensors, and need no
    compaction). V1 and V2 runners alike (``vllm_config``, ``kv_cache_config``)."""
    ctx = runner.vllm_config.compilation_config.static_forward_context
    draft_layers = set(draft_layer_names or ())
    out: dict[int, list[torch.Tensor]] = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        caches = []
        for name in group.layer_names:
            if name in draft_layers or name not in ctx:
                continue
            kv = ctx[name].kv_cache
            caches.append(kv[0] if isinstance(kv, (list, tuple)) else kv)
        out[gid] = caches
    return out


def _state(runner: Any) -> TreeState | None:
    return getattr(runner, "specx_tree_state", None)


class TreeStepInputs(VllmPatch):
    name = "tree_step_inputs"
    target = f"{_RUNNER}._prepare_inputs"
    replaces = ("GPUModelRunner._prepare_inputs (also run by CPUModelRunner), which lays "
                "out the step's query tokens, positions and slot mapping")
    why = ("draft trees: after vLLM's layout, a tree request's nodes get the RoPE position "
           "ctx + depth (their KV slots stay ctx + 1 + flat index) and the step's "
           "ancestor-only query masks are built; a no-op without a tree config")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def _prepare_inputs(self_: Any, scheduler_output: Any, num_scheduled_tokens: Any,
                            *args: Any, **kw: Any) -> Any:
            out = original(self_, scheduler_output, num_scheduled_tokens, *args, **kw)
            state = _state(self_)
            if state is not None:
                state.begin_step(self_, scheduler_output, num_scheduled_tokens, out[1])
            return out

        return _prepare_inputs


class TreeStepMasks(VllmPatch):
    name = "tree_step_masks"
    target = f"{_RUNNER}._model_forward"
    replaces = "GPUModelRunner._model_forward, the target model's forward call"
    why = ("draft trees: the target's forward runs with the step's ancestor-only query "
           "masks set on the CPU attention op (cpu_ops.attention.query_masks), cleared "
           "after; the drafter's passes never see them; a no-op without a tree step")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def _model_forward(self_: Any, *args: Any, **kw: Any) -> Any:
            state = _state(self_)
            step = state.step if state is not None else None
            if step is None:
                return original(self_, *args, **kw)
            from vllm_specx.cpu_ops.attention import query_masks

            with query_masks(step.masks):
                return original(self_, *args, **kw)

        return _model_forward


class TreeStepCompaction(VllmPatch):
    name = "tree_step_compaction"
    target = f"{_RUNNER}._sample"
    replaces = ("GPUModelRunner._sample, which runs the rejection sampler (here the specx "
                "sampler) on the step's logits")
    why = ("draft trees: right after verification, the accepted path's target K/V moves "
           "to the contiguous slots after the root and the step's inputs are rewritten in "
           "the chain layout the drafter's first pass reads; a no-op without a tree step")
    lazy = True

    def wrap(self, original: Any) -> Any:
        def _sample(self_: Any, *args: Any, **kw: Any) -> Any:
            out = original(self_, *args, **kw)
            state = _state(self_)
            if state is not None:
                state.finish_step(self_)
            return out

        return _sample


TREE_STEP_PATCHES: tuple[VllmPatch, ...] = (TreeStepInputs(), TreeStepMasks(),
                                            TreeStepCompaction())
