"""``specx_mtp`` and ``specx_eagle3`` as Model Runner V2 speculators (vLLM glue, checked on
vLLM 0.32's ``vllm/v1/worker/gpu/spec_decode/``).

V2 drafts MTP layers and EAGLE heads with ``MTPSpeculator`` / ``EagleSpeculator`` (both
``TargetDependentARSpeculator``): a first pass over the verified tokens (the target's
hidden states, for EAGLE-3 combined by the head's ``fc``), then K - 1 fixed decode steps.
The speculators here are those classes:

* at a **fixed K** (no ``adaptive``) they are vLLM's speculators unchanged, CUDA-graph
  capture included: ``propose`` is vLLM's;
* with ``adaptive: true`` the first pass is still vLLM's (its ``propose`` asked for one
  token), and the rest of the round is the V1 chain drafter's own round and hooks
  (:class:`~.chain_drafter.ChainRound`, :class:`~.eagle_chain_proposer.EagleRoundHooks`:
  per-request stop, a batch that shrinks as requests stop, the draft's own hidden state
  fed back), with the draft-model speculators' V2 lookahead passes
  (:class:`~.v2_speculators.V2LookaheadPasses`, over V2's block tables) and their
  ragged-length hand-over to the scheduler (``take_draft_lengths``, read by the
  ``v2_ragged_draft_lengths`` patch). Those passes run eager: their batch shrinks
  within a round. With cost control the round's lengths are planned before the first
  pass, as on V1 (``plan_or_skip_first_pass``, shared with the draft-model speculators);
  a step where nobody drafts skips vLLM's first pass, keeping what it would have read
  (:class:`~.head_kv_holes.HeadKVHoles`: V2's query tokens shifted by one, the token just
  sampled, the target's hidden states, EAGLE-3's auxiliary layers uncombined), and the
  head's KV is caught up through the lookahead passes before the next first pass that
  runs (and at block ends under prefix caching);
* with ``draft_tree`` (``specx_eagle3`` / ``specx_eagle`` / ``specx_mtp``) the rest of the
  round is V1's head-tree round (:class:`~.eagle_tree_proposer.EagleTreeRound`: one pass
  per depth over every node fed so far, ancestor masks, RoPE position ``P + depth``) over
  the same lookahead passes, and the runner's V2 tree step verifies the trees; with cost
  control a round whose depth is chosen 0 skips vLLM's first pass as a chain step does.

Drafts are the argmax (one-hot ``q``), verified by the specx sampler on V2.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

from vllm_specx.glue.draft_passes import DraftKVHoles, RoundStart
from vllm_specx.glue.eagle_chain_proposer import EagleRoundHooks
from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound
from vllm_specx.glue.head_kv_holes import HeadKVHoles
from vllm_specx.glue.v2_speculators import SpecxV2DraftSpeculator, V2Batch

__all__ = ["EagleChainV2Speculator", "MtpChainV2Speculator"]


class _ChainOverTargetDependentAR(EagleRoundHooks):
    """The adaptive round over a V2 ``TargetDependentARSpeculator`` (see the module doc).
    Mixed in before vLLM's speculator class."""

    # The validated specx settings: set by install_v2_speculator before load_model.
    settings: dict[str, Any]

    # The draft-model speculators' V2 plumbing, shared as is (plain functions of the
    # speculator's attributes: runner, device, block_tables, kv_cache_config).
    lookahead_passes = SpecxV2DraftSpeculator.lookahead_passes
    sampling_view = SpecxV2DraftSpeculator.sampling_view
    take_draft_lengths = SpecxV2DraftSpeculator.take_draft_lengths
    take_last_draft_probs = SpecxV2DraftSpeculator.take_last_draft_probs
    _draft_group = SpecxV2DraftSpeculator._draft_group
    # ... and their skip of an idle first pass (the plan before it, the hole record, the
    # catch-up over the lookahead passes, the zero-length drafts).
    plan_or_skip_first_pass = SpecxV2DraftSpeculator.plan_or_skip_first_pass
    kv_holes = SpecxV2DraftSpeculator.kv_holes
    block_size = SpecxV2DraftSpeculator.block_size
    catch_up_pass_tokens = SpecxV2DraftSpeculator.catch_up_pass_tokens
    sampler_reads_draft_probs = SpecxV2DraftSpeculator.sampler_reads_draft_probs
    _no_drafts = SpecxV2DraftSpeculator._no_drafts
    # A step whose plan drafts nothing for anyone (a chain planned at zero, a tree at
    # depth 0) skips vLLM's first pass (HeadKVHoles keeps its inputs and catches the
    # head's KV up).
    skips_idle_first_pass = True

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device)
        self.runner = runner
        self._last_draft_probs: torch.Tensor | None = None
        self._draft_lengths: dict[str, int] | None = None
        self._first_lm_in: torch.Tensor | None = None
        self._catch_first_pass = False

    def sample_draft(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
                     ) -> torch.Tensor:
        if not self._catch_first_pass:
            return super().sample_draft(hidden_states, *args, **kwargs)
        # vLLM's first pass: the LM-head input at each request's new token. The round
        # draws Y_1 from it itself.
        self._first_lm_in = hidden_states.clone()
        return torch.zeros(hidden_states.shape[0], dtype=torch.int64,
                           device=hidden_states.device)

    def _run_model(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``_run_model(num_tokens, ...)``, or, called by the V2 lookahead passes
        as the draft-model speculators' ``_run_model(input_ids, positions, attn_metadata,
        slot_mappings, num_tokens_across_dp)``, one lookahead pass: the tokens go to
        the input buffers, the draft reads ``hidden_states`` (:meth:`feed_hidden`), and
        the result is ``[LM-head input | fed-back hidden state]`` per token."""
        if not isinstance(first, torch.Tensor):
            return super()._run_model(first, *args, **kwargs)
        positions, attn_metadata, slot_mappings = args[0], args[1], args[2]
        n = first.shape[0]
        rope = getattr(self, "_tree_rope", None)
        if rope is not None:
            # A head-tree pass (glue/eagle_tree_proposer.py): the KV slots stay the
            # lookahead slots the passes computed, the RoPE position is P + depth.
            positions = positions.clone()
            positions[: rope.shape[0]] = rope.to(positions.device, positions.dtype)
        self.input_buffers.input_ids[:n] = first.to(self.input_buffers.input_ids.dtype)
        self.input_buffers.positions[:n] = positions.to(self.input_buffers.positions.dtype)
        for_lm_head, fed_back = super()._run_model(n, attn_metadata, slot_mappings, None)
        out = torch.cat([for_lm_head[:n], fed_back[:n]], dim=-1)
        keep = getattr(self, "keep_tree_pass_output", None)
        if keep is not None:
            keep(out)  # a tree pass reads several rows per request
        return out

    @torch.inference_mode()
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any,
                last_hidden_states: torch.Tensor, aux_hidden_states: Any,
                num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                temperature: torch.Tensor, seeds: torch.Tensor, dp_sync_state: Any = None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs: Any = None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        k = self.num_speculative_steps if num_speculative_tokens is None else int(
            num_speculative_tokens)
        args = (input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds)
        kwargs = dict(dp_sync_state=dp_sync_state, dummy_run=dummy_run,
                      skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
                      is_profile=is_profile)
        self._draft_lengths = None
        tree_state = getattr(self, "tree_state", None)
        if not dummy_run and tree_state is not None:
            step, tree_state.last_step = tree_state.last_step, None
            if step is not None:
                # After a tree step V2 rewrote the step's tokens in the chain layout
                # (v2_tree_step.finish_step): the first pass reads the accepted nodes'
                # target hidden states in the same rows.
                from vllm_specx.glue.eagle_tree_proposer import path_rows_to_chain

                path_rows_to_chain(step, last_hidden_states)
                for aux in aux_hidden_states or ():
                    path_rows_to_chain(step, aux)
        round_on = self.settings.get("adaptive") or tree_state is not None
        if dummy_run or not round_on or k <= 1:
            return super().propose(*args, num_speculative_tokens=num_speculative_tokens,
                                   **kwargs)
        num_reqs = input_batch.num_reqs
        req_ids = tuple(input_batch.req_ids[:num_reqs])
        batch = V2Batch(num_reqs, input_batch.idx_mapping[:num_reqs],
                        self.block_tables.block_tables[self._draft_group()].gpu[
                            input_batch.idx_mapping[:num_reqs]])
        # The round plans before the first pass, as on V1 (cost control: the pass is the
        # round's; None without it): a chain's lengths, a tree's depth. A step where
        # nobody drafts skips the pass.
        def keep(rejected: np.ndarray) -> None:
            self._keep_first_pass_inputs(input_batch, last_hidden_states,
                                         aux_hidden_states, num_sampled, last_sampled,
                                         next_prefill_tokens, rejected)

        plan, skipped = self.plan_or_skip_first_pass(
            input_batch, k, req_ids, num_rejected, batch, keep)
        if skipped:
            return self._no_drafts(input_batch, num_reqs)
        self._catch_first_pass = True
        try:
            super().propose(*args, num_speculative_tokens=1, **kwargs)
        finally:
            self._catch_first_pass = False
        assert self._first_lm_in is not None
        lm_in, self._first_lm_in = self._first_lm_in, None
        # P: the first pass's position of each request's last row (the next pass feeds
        # Y_1 at P + 1, as vLLM's decode steps do); _prefill left it in the buffers.
        sample_positions = self.input_buffers.positions[:num_reqs].to(torch.int64).clone()
        fed_back = self.hidden_states[:num_reqs].clone()
        start = RoundStart(
            k, num_reqs, torch.cat([lm_in, fed_back], dim=-1), sample_positions, batch,
            int(input_batch.num_tokens), sample_positions + 1, req_ids,
            num_rejected[:num_reqs], int(input_batch.num_tokens), plan,
        )
        drafts = self.draft_round(
            start, self.sampling_view(input_batch, temperature, seeds, sample_positions))
        buf = self.draft_tokens[:num_reqs]
        buf.zero_()
        for row, ids in enumerate(drafts):
            if ids:
                buf[row, : len(ids)] = torch.tensor(ids, dtype=buf.dtype)
        self._draft_lengths = {req_id: len(ids)
                               for req_id, ids in zip(input_batch.req_ids, drafts)}
        return buf

    def kv_holes_class(self) -> type[DraftKVHoles]:
        return HeadKVHoles

    def _keep_first_pass_inputs(self, input_batch: Any, last_hidden_states: torch.Tensor,
                                aux_hidden_states: Any, num_sampled: torch.Tensor,
                                last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                                rejected: np.ndarray) -> None:
        """On a skipped step: what vLLM's V2 first pass would have read
        (``prepare_prefill_inputs``), kept by the hole record at each request's accepted
        rows: V2 pads every query with its rejected drafts, so the last accepted row is the
        query's last minus the rejected ones; the token fed there is the one just sampled
        (a request still in its prefill: the next prompt token); the hidden states are
        the target's final ones, or EAGLE-3's auxiliary layers uncombined (the ``fc``
        runs when a catch-up feeds them, as on V1)."""
        num_reqs = input_batch.num_reqs
        qsl = torch.from_numpy(input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64))
        last = qsl[1:] - 1 - torch.from_numpy(rejected)
        idx = input_batch.idx_mapping[:num_reqs]
        # Read as vLLM's kernel reads them, flat at the request-state row: its buffers are
        # [max_num_reqs, 1] and [lookahead, max_num_reqs] (the first row: the next token).
        next_tokens = torch.where(num_sampled[:num_reqs] > 0, last_sampled.reshape(-1)[idx],
                                  next_prefill_tokens.reshape(-1)[idx])
        self.kv_holes().keep_rows(
            input_batch.req_ids[:num_reqs], input_batch.input_ids[: input_batch.num_tokens],
            next_tokens, list(aux_hidden_states) if aux_hidden_states else last_hidden_states,
            qsl[:-1], last, input_batch.num_computed_tokens_np[:num_reqs],
            self.runner.req_states.req_id_to_index)


class _HeadTreeOverV2(EagleTreeRound, _ChainOverTargetDependentAR):
    """The head-tree round (``glue/eagle_tree_proposer.py``, over
    :class:`~.v2_speculators.V2LookaheadPasses`) with ``draft_tree``, the adaptive round
    with ``adaptive: true``, vLLM's own drafting otherwise; the runner's V2 tree step
    (``glue/v2_tree_step.py``) verifies. Mixed in before vLLM's speculator class."""

    def take_last_draft_probs(self) -> torch.Tensor | None:
        # No q with a tree, as on V1: the "deterministic" tree rule reads none.
        if self.tree_state is not None:
            self._last_draft_probs = None
            return None
        return super().take_last_draft_probs()


class MtpChainV2Speculator(_HeadTreeOverV2, MTPSpeculator):
    """``specx_mtp`` on Model Runner V2: vLLM's ``MTPSpeculator``, with the adaptive round
    when ``adaptive: true`` and the head-tree round with ``draft_tree``. The MTP layer
    takes what an EAGLE head takes (a token's embedding and a hidden state: the target's
    last one at the first pass, its own fed-back output after), and vLLM's V2
    ``_run_model`` calls it without ``spec_step_idx``, so every tree depth runs the first
    MTP layer, as on V1. An MLA target is refused before start
    (``mtp_proposer.require_tree_target``): the tree step's masks reach plain attention
    only."""


class EagleChainV2Speculator(_HeadTreeOverV2, EagleSpeculator):
    """``specx_eagle3`` / ``specx_eagle`` on Model Runner V2: vLLM's ``EagleSpeculator``,
    with the adaptive round when ``adaptive: true`` and the head-tree round with
    ``draft_tree``."""
