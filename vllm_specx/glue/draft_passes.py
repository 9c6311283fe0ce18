"""Draft forward passes the specx drafters share (vLLM glue, checked on vLLM 0.32 V1).

Every specx drafter (:class:`SpecxPasses` mixed into a vLLM V1 proposer:
``DraftModelProposer`` for a draft model, ``EagleProposer`` for MTP layers) drafts a round
the same way:

1. the **first pass**: exactly the base class's, one pass over the target's verified
   tokens plus the token the target just emitted, for the whole batch; it keeps the draft
   KV cache in sync and gives each request's first-token logits;
2. **lookahead passes**: passes over a chosen subset of requests, each fed some tokens at
   its lookahead positions ``P+1, P+2, ...`` (``P``: the position of the token the target
   just emitted). These are the slots vLLM's own chain drafter writes, so prefix caching,
   chunked prefill and preemption see the same KV bookkeeping as ``draft_model``.

MTAD feeds beam tails (several tokens per request, one beam per pass); the chain
drafters (``glue/chain_drafter.py``) feed one token per request over the requests still
drafting (the batch shrinks as requests stop). Both are a :class:`LookaheadPasses` call
with different rows.

vLLM private names relied on here: ``DraftModelProposer.set_inputs_first_pass``,
``build_model_inputs_first_pass``, ``build_per_group_and_layer_attn_metadata``,
``_determine_batch_execution_and_padding``, ``_get_slot_mapping``, ``_get_positions``,
``input_ids``/``positions``/``inputs_embeds`` buffers, ``CommonAttentionMetadata.replace``;
and ``spec_decode.utils.eagle_step_update_slot_mapping_and_metadata`` (vLLM's fused EAGLE
step kernel, which the chain passes launch once per pass on CUDA and CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.spec_decode.utils import (
    PADDING_SLOT_ID,
    eagle_step_update_slot_mapping_and_metadata,
)

from vllm_specx.algorithms.draft_stop import DraftStopRule, make_stop_rule
from vllm_specx.methods import METHODS


def load_acceptance_head(
    settings: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> torch.nn.Module | None:
    """The ``acceptance_head`` setting's head on the drafter's device and dtype, or None.

    A directory that does not exist was let through by config validation as a hub id
    (org/name): it is fetched here, at engine start, the way vLLM fetches models, not at
    the first request."""
    head_dir = settings.get("acceptance_head")
    if not head_dir:
        return None
    from pathlib import Path

    from vllm_specx.algorithms.acceptance_head import load_head

    if not Path(head_dir).expanduser().exists():
        from huggingface_hub import snapshot_download

        head_dir = snapshot_download(head_dir, allow_patterns=["*.json", "*.safetensors"])
    return load_head(head_dir, device=device, dtype=dtype)


def round_stop_rule(
    settings: dict[str, Any], k_max: int, head: torch.nn.Module | None
) -> DraftStopRule:
    """The adaptive stop rule for one round. ``k_max`` is what the runner asks for this step
    (vLLM may ask for fewer than the configured K), so ``min_speculative_tokens`` is
    clamped to it. A setting missing from ``settings`` takes the method's own knob default
    (``specx_mtp``'s confidence threshold is not ``adaptive``'s)."""
    spec = METHODS.get(settings.get("method", ""))
    defaults = {knob.name: knob.default for knob in spec.knobs} if spec is not None else {}
    round_settings = {**defaults, **settings, "num_speculative_tokens": k_max}
    round_settings["min_speculative_tokens"] = min(
        int(round_settings["min_speculative_tokens"]), k_max
    )
    return make_stop_rule(round_settings, head)


@dataclass(frozen=True)
class RoundStart:
    """What a round's first pass leaves every specx drafter."""

    k: int  # K for this round (vLLM may ask for fewer than the configured K)
    num_reqs: int
    out: torch.Tensor  # the draft's output at each request's new token, [R, ...]
    sample_positions: torch.Tensor  # P: the position of each request's new token, [R]
    cad: CommonAttentionMetadata  # the first pass's attention metadata
    first_tokens: int  # tokens the first pass fed
    # P + 1 per request once the round starts: the first pass's seq_lens minus the
    # rejected drafts still counted there (padded drafter batch).
    base_seq_lens: torch.Tensor
    # For cost control (glue/cost_model.py): the batch's request ids, each request's
    # rejected drafts in the step just verified ([R]) and the target's query tokens of
    # that step (None where a runner does not say).
    req_ids: tuple[str, ...] | None = None
    num_rejected: torch.Tensor | None = None
    target_tokens: int | None = None
    # The round's plan when the drafter made it before the first pass
    # (:meth:`SpecxPasses.plan_before_first_pass`); None: the round plans for itself.
    plan: Any = None

    def no_drafts(self) -> torch.Tensor:
        """The ``[R, 0]`` drafts of a round with K = 0 (vLLM's proposers return that)."""
        return torch.empty(self.num_reqs, 0, device=self.out.device, dtype=torch.int64)


class SpecxPasses(SpecDecodeBaseProposer):
    """The passes every specx drafter runs, over any vLLM V1 proposer: vLLM's first pass
    and its forward call as separate steps, so a drafter can run the first pass and then
    its own passes: :meth:`propose` runs the first pass and hands the rest of the round to
    the drafter's :meth:`draft_round`. Mix it in before the vLLM proposer class
    (``class P(SpecxPasses, DraftModelProposer)``); it uses only what vLLM's proposer base
    (``SpecDecodeBaseProposer``) has.

    ``settings`` are the validated specx settings of the method (the runner hook sets
    them right after construction; see ``glue/runner_hook.py``).
    """

    settings: dict[str, Any]
    # True: a step whose plan (made before the first pass) drafts nothing for anyone skips
    # the first pass too, and the draft KV it would have written is caught up
    # (:class:`DraftKVHoles`) before the next first pass that runs. Only a drafter whose
    # first pass reads nothing but token ids can catch up (a draft model); an EAGLE or
    # MTP head reads the target's hidden states of those positions, which are gone.
    skips_idle_first_pass: bool = False

    def propose(  # type: ignore[override]
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> list[list[int]] | torch.Tensor:
        """vLLM's V1 ``propose``: record K, clear the last round's draft probabilities,
        run the round's first pass, then the drafter's own :meth:`draft_round`.

        The first pass is the base class's (its ``propose`` fuses it with chain drafting,
        so it is spelled out): the draft over the verified tokens + the new token of every
        request, for the whole batch; it keeps the draft KV cache in sync."""
        k = int(num_speculative_tokens)
        self.num_speculative_tokens = k
        self._last_draft_probs = None
        num_reqs = common_attn_metadata.batch_size()
        target_tokens = int(common_attn_metadata.num_actual_tokens)
        runner = getattr(self, "runner", None)
        req_ids = (tuple(runner.input_batch.req_ids[:num_reqs])
                   if runner is not None and hasattr(runner, "input_batch") else None)
        plan = None
        holes = self.kv_holes() if self.skips_idle_first_pass and req_ids is not None else None
        if holes is not None and k > 0:
            first_pos = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
            query_lens = (common_attn_metadata.query_start_loc_cpu[1:num_reqs + 1]
                          - common_attn_metadata.query_start_loc_cpu[:num_reqs]).numpy()
            holes.admit(self, req_ids)
            # A drafter that cannot catch this step up later (HeadKVHoles: a hole it would
            # not store) does not plan before the first pass: the round plans after it.
            if holes.may_skip(self, req_ids, first_pos, query_lens):
                plan = self.plan_before_first_pass(
                    k, req_ids, num_rejected_tokens_gpu, target_tokens)
            if plan is not None and plan.skip_first_pass:
                # Nobody drafts: a plain decode step; the drafter does no work beyond
                # keeping what a later catch-up needs (an EAGLE/MTP head: this step's
                # first-pass inputs) and catching up blocks vLLM caches this step
                # (DraftKVHoles.skip).
                holes.keep_first_pass_inputs(
                    self, req_ids, target_token_ids, next_token_ids, target_hidden_states,
                    token_indices_to_sample, common_attn_metadata)
                holes.skip(self, common_attn_metadata, req_ids, first_pos, query_lens,
                           runner.input_batch.num_tokens_no_spec[:num_reqs],
                           runner.input_batch.token_ids_cpu)
                return [[] for _ in range(num_reqs)]
            merged = holes.catch_up(
                self, common_attn_metadata, req_ids, first_pos,
                runner.input_batch.token_ids_cpu,
                merge_room=self.first_pass_room(num_reqs, target_token_ids, target_positions))
            if merged:
                # The holes ride in this first pass, before each request's query tokens:
                # no catch-up pass of their own (issue 32).
                target_token_ids, target_positions, common_attn_metadata = (
                    holes.first_pass_with_holes(
                        self, merged, runner.input_batch.token_ids_cpu, target_token_ids,
                        target_positions, common_attn_metadata))
        target_hidden_states = self.first_pass_hidden(target_hidden_states)
        num_tokens, token_indices_to_sample, cad = self.set_inputs_first_pass(
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(cad)
        padding = self._determine_batch_execution_and_padding(num_tokens)
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(
            num_tokens, padding[1], mm_embed_inputs
        )
        out = self._draft_forward(
            per_layer_attn_metadata,
            num_tokens,
            padding,
            self._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
            model_kwargs,
        )
        sample_positions = self.positions[token_indices_to_sample].clone()
        base_seq_lens = cad.seq_lens
        if num_rejected_tokens_gpu is not None:
            base_seq_lens = base_seq_lens - num_rejected_tokens_gpu
        start = RoundStart(k, num_reqs, out[token_indices_to_sample], sample_positions, cad,
                           int(num_tokens), base_seq_lens, req_ids, num_rejected_tokens_gpu,
                           target_tokens, plan)
        return self.draft_round(start, sampling_metadata)

    def prepare_inputs_padded(  # type: ignore[override]
        self,
        common_attn_metadata: CommonAttentionMetadata,
        spec_decode_metadata: Any,
        valid_sampled_tokens_count: torch.Tensor,
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        """vLLM's padded input preparation, without its kernel launch after a step where no
        request verified drafts (cost control planned zero for everyone): nothing was
        rejected, and each request's token to sample from is its last query token, which
        is what the kernel computes for zero drafts. The metadata is the base class's
        for any step."""
        if spec_decode_metadata.max_spec_len > 0:
            return super().prepare_inputs_padded(
                common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)
        cad = common_attn_metadata
        num_reqs = cad.num_reqs
        qsl_cpu = cad.query_start_loc_cpu
        total = int(qsl_cpu[-1])
        spec_cad = CommonAttentionMetadata(
            query_start_loc=cad.query_start_loc,
            seq_lens=cad.seq_lens,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu_upper_bound=cad.seq_lens_cpu_upper_bound,
            num_reqs=num_reqs,
            num_actual_tokens=total,
            max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()),
            max_seq_len=cad.max_seq_len,
            block_table_tensor=cad.block_table_tensor,
            slot_mapping=cad.slot_mapping[:total],
            causal=True,
            dcp_local_seq_lens=cad.dcp_local_seq_lens,
        )
        device = valid_sampled_tokens_count.device
        token_indices = (cad.query_start_loc[1:num_reqs + 1] - 1).to(torch.int32)
        num_rejected = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        return spec_cad, token_indices, num_rejected

    def prepare_next_token_ids_padded(  # type: ignore[override]
        self,
        sampled_token_ids: torch.Tensor,
        requests: dict[str, Any],
        gpu_input_batch: Any,
        discard_request_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's next-token ids and valid counts, without its kernel on the host after a
        step where no request verified drafts (one sampled column): a row's next token is
        its sampled token (count 1) unless the row is discarded (a prompt chunk) or its
        token is invalid, which take the backup token (count 0), as the kernel does. The
        backup tokens are read for those rows only (vLLM reads one per request, in Python,
        every step). Other steps, and device tensors, take the base class's kernel."""
        if sampled_token_ids.shape[1] != 1 or sampled_token_ids.device.type != "cpu":
            return super().prepare_next_token_ids_padded(
                sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        num_reqs = sampled_token_ids.shape[0]
        tokens = sampled_token_ids[:, 0]
        valid = ((tokens != -1) & (tokens < gpu_input_batch.vocab_size)
                 & ~discard_request_mask[:num_reqs])
        next_token_ids = tokens.to(torch.int32, copy=True)
        for i in torch.nonzero(~valid).flatten().tolist():
            next_token_ids[i] = requests[gpu_input_batch.req_ids[i]].get_token_id(
                int(gpu_input_batch.num_tokens_no_spec[i]) - 1)
        return next_token_ids, valid.to(torch.int32)

    def first_pass_room(self, num_reqs: int, target_token_ids: torch.Tensor,
                        target_positions: torch.Tensor) -> int:
        """How many hole positions this step's first pass can take in front of its query
        tokens (``DraftKVHoles.catch_up``'s ``merge_room``): what its buffers hold beyond
        the target's tokens and each request's extra slot. 0 where the first pass is not
        a draft model's (vLLM's extra-slot layout over token ids alone: an EAGLE/MTP head
        also reads hidden states of those positions, a multimodal draft embeddings) or its
        positions are not one row per token (M-RoPE)."""
        if (not getattr(self, "needs_extra_input_slots", False)
                or self.pass_hidden_states_to_model or self.supports_mm_inputs
                or target_positions.dim() != 1):
            return 0
        used = int(target_token_ids.shape[0]) + num_reqs * int(self.extra_slots_per_request)
        return max(int(self.input_ids.shape[0]) - used, 0)

    def first_pass_hidden(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the first pass reads them, made only once the
        pass runs (a skipped step keeps them as the runner handed them over): unchanged
        here; an EAGLE-3 head combines its auxiliary layers with its ``fc``."""
        return target_hidden_states

    def kv_holes(self) -> DraftKVHoles:
        """The drafter's record of draft KV that skipped first passes did not write
        (:meth:`kv_holes_class`'s)."""
        holes = getattr(self, "_kv_holes", None)
        if holes is None:
            cache = getattr(getattr(self, "vllm_config", None), "cache_config", None)
            holes = self._kv_holes = self.kv_holes_class()(
                self.block_size, bool(getattr(cache, "enable_prefix_caching", True)))
        return holes

    def kv_holes_class(self) -> type[DraftKVHoles]:
        """The hole record a skipping drafter keeps: a draft model's first pass reads only
        committed token ids (:class:`DraftKVHoles`); an EAGLE/MTP head's also reads the
        target's hidden states, which its record keeps (``glue/head_kv_holes.py``)."""
        return DraftKVHoles

    def plan_before_first_pass(
        self, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor | None,
        target_tokens: int,
    ) -> Any:
        """The round's plan made before its first pass (a ``RoundPlan``:
        ``skip_first_pass`` skips it, nobody drafts), or None (no plan: the first pass
        runs and the round plans for itself). Drafters that plan (cost control) override
        it; the plan then reaches :meth:`draft_round` as ``start.plan``."""
        return None

    def draft_round(
        self, start: RoundStart, sampling_metadata: SamplingMetadata
    ) -> list[list[int]] | torch.Tensor:
        """The drafter's round after the first pass: ``[R, K]`` drafts, or one list per
        request when they are ragged (K = 0: ``start.no_drafts()``)."""
        raise NotImplementedError(f"{type(self).__name__} drafts no round")

    def lookahead_passes(
        self, cad: Any, sample_positions: torch.Tensor, base_seq_lens: torch.Tensor
    ) -> LookaheadPasses:
        """The round's lookahead passes (``run(rows, tails, start, block_table)``). The
        rounds (``ChainRound``, ``MTADRound``) build their passes only through this hook,
        so the same round runs on Model Runner V2, whose speculators return their own
        passes over V2's block tables (``glue/v2_speculators.py``)."""
        return LookaheadPasses(self, cad, sample_positions, base_seq_lens)

    def _draft_forward(
        self,
        per_layer_attn_metadata: Any,
        num_tokens: int,
        padding: tuple[Any, int, Any],
        slot_mapping: Any,
        model_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One draft forward pass the way the base class runs one: EPLB bookkeeping, then
        the model inside vLLM's forward context. ``padding`` is
        ``_determine_batch_execution_and_padding(num_tokens)``'s result."""
        cudagraph_runtime_mode, num_input_tokens, num_tokens_across_dp = padding
        if self.eplb_state is not None:
            self.eplb_state.prepare_forward(self.draft_model_config, num_tokens)
        with set_forward_context(
            per_layer_attn_metadata,
            self.vllm_config,
            num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp,
            cudagraph_runtime_mode=cudagraph_runtime_mode,
            slot_mapping=slot_mapping,
        ):
            return self.run_model(model_kwargs, num_input_tokens)

    def run_model(self, model_kwargs: dict[str, Any], num_input_tokens: int) -> torch.Tensor:
        """The draft model's call in one pass (inside vLLM's forward context): what a
        drafter whose model takes more inputs, or returns more, overrides."""
        return self.model(**model_kwargs)


class SpecxDraftModelProposer(SpecxPasses, DraftModelProposer):
    """vLLM's ``DraftModelProposer`` with the specx passes: the base of the draft-model
    drafters (``adaptive``, ``mtad``)."""


# Devices where vLLM's fused EAGLE step kernel runs (Triton on CUDA, vLLM's CPU op).
_FUSED_STEP_DEVICES = ("cuda", "cpu")


def fed_tokens(tails: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
    """``tails[feed]`` (row-major) with ``feed`` a host bool mask and ``tails`` on the host
    or the device: a gather at host-computed indices, so drafts that stay on the device
    are fed without reading them back (a boolean-mask index on a device tensor syncs)."""
    flat = feed.reshape(-1).nonzero().squeeze(1)
    return tails.reshape(-1).index_select(0, flat.to(tails.device))


class LookaheadPasses:
    """Draft passes over the lookahead slots of chosen requests, for one round.

    ``cad`` is the first pass's attention metadata (one row per request of the batch),
    ``sample_positions`` the position ``P`` of each request's new token and
    ``base_seq_lens`` its sequence length ``P + 1`` once the round starts.
    """

    def __init__(
        self,
        proposer: SpecxPasses,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
    ) -> None:
        self.p = proposer
        self.cad = cad
        self.device = sample_positions.device
        self.max_model_len = proposer.max_model_len
        self.block_size = proposer.block_size
        self.num_reqs = int(sample_positions.shape[0])
        # P and P + 1 per request: on the device for the chain passes (their positions,
        # sequence lengths and slots are computed there, no copy per pass), and on the
        # host (one read for both, once per round) for what the host must know: the
        # metadata's host-side sequence lengths and the general passes' positions.
        self.positions_dev = sample_positions.to(torch.int64)
        self.base_seq_dev = base_seq_lens.to(torch.int64)
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None
        # The chain passes' host-side sequence lengths are upper bounds, as vLLM's own
        # chain drafter keeps them: the first pass's (which count the step's rejected
        # drafts) + depth, so a round of chain passes reads nothing back.
        self._upper_cpu = getattr(cad, "seq_lens_cpu_upper_bound", None)
        # The chain passes' query layout (one token per row), made once per round.
        # On the device: the proposer's own arange where it has one (vLLM's chain takes
        # its query_start_loc from it too), so no host-to-device copy per round.
        self._qsl_cpu = torch.arange(self.num_reqs + 1, dtype=torch.int32)
        arange = getattr(proposer, "arange", None)
        if (isinstance(arange, torch.Tensor) and arange.dtype == torch.int32
                and arange.shape[0] > self.num_reqs and arange.device == self.device):
            self._qsl_dev = arange[: self.num_reqs + 1]
        else:
            self._qsl_dev = self._qsl_cpu.to(self.device)
        # (positions, sequence lengths) of the last chain pass over the whole batch.
        self._step_state: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def positions_cpu(self) -> torch.Tensor:
        """P per request on the host (the general passes build positions there): read
        once per round, on first use, with ``base_seq_cpu`` (one read for both)."""
        if self._host is None:
            host = torch.stack([self.positions_dev, self.base_seq_dev]).cpu()
            self._host = (host[0], host[1])
        return self._host[0]

    @property
    def base_seq_cpu(self) -> torch.Tensor:
        """P + 1 per request on the host (see :attr:`positions_cpu`)."""
        self.positions_cpu  # noqa: B018 -- fills self._host
        assert self._host is not None
        return self._host[1]

    def run_chain(self, rows: torch.Tensor, dev_rows: torch.Tensor | None,
                  fed: torch.Tensor, depth: int) -> torch.Tensor:
        """:meth:`run` for a chain round's pass at ``depth`` (>= 1): request ``rows[i]``
        is fed one token, ``fed[i]`` (on the device), at position ``P + depth`` (the
        earlier ``depth - 1`` drafts' KV is in its slots). The same inputs as
        ``run(rows, tails, start=depth - 1)`` with ``tails[:, -1] == fed``, built with
        fewer ops and no host-to-device copy of positions: positions, sequence lengths
        and slots are computed on the device from the round's ``P``; only the query
        layout and the host-side sequence lengths are built on the host.
        ``dev_rows`` None: ``rows`` is every request of the batch, in order."""
        n = int(rows.shape[0])
        block_table = self.cad.block_table_tensor
        if dev_rows is not None:
            block_table = block_table[dev_rows]
        block_table = block_table[:n]
        upper = self._upper_cpu if self._upper_cpu is not None else self.base_seq_cpu
        upper = upper[: self.num_reqs] if dev_rows is None else upper[rows]
        seq_cpu = (upper + depth).clamp(max=self.max_model_len)
        padding = self.p._determine_batch_execution_and_padding(n)
        in_place = self.device.type in _FUSED_STEP_DEVICES
        if in_place:
            pos, seq_lens, slot_mapping = self._chain_step_fused(
                dev_rows, block_table, depth, padding[1])
        else:
            pos, seq_lens, slot_mapping = self._chain_step(dev_rows, block_table, depth)
        qsl_cpu = self._qsl_cpu[: n + 1]  # n <= the batch's requests
        cad = self._pass_metadata(self._qsl_dev[: n + 1], qsl_cpu, seq_lens, seq_cpu, n, 1,
                                  block_table, slot_mapping)
        return self._forward(cad, depth, n, fed, pos, slot_mapping, padding, in_place)[:n]

    def _pass_metadata(self, qsl_dev: torch.Tensor, qsl_cpu: torch.Tensor,
                       seq_lens: torch.Tensor, seq_cpu: torch.Tensor, num_tokens: int,
                       max_query_len: int, block_table: torch.Tensor,
                       slot_mapping: torch.Tensor, num_reqs: int | None = None,
                       ) -> CommonAttentionMetadata:
        """The step's attention metadata re-cut for one lookahead pass: its query layout,
        sequence lengths (device, and host upper bounds), block table and slots; the
        fields derived from the step's own layout (positions, prefill flags, DCP lengths,
        vLLM's cached per-token maps) are dropped so nothing reads the step's values."""
        return self.cad.replace(
            query_start_loc=qsl_dev,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_cpu.to(torch.int32),
            num_reqs=num_tokens if num_reqs is None else num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=int(seq_cpu.max()),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            positions=None,
            is_prefilling=None,
            dcp_local_seq_lens=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )

    def _chain_step(self, dev_rows: torch.Tensor | None, block_table: torch.Tensor,
                    depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, sequence lengths, slots) of a chain pass at ``depth`` on the
        device, in torch ops (devices without vLLM's fused step kernel)."""
        pos = self.positions_dev if dev_rows is None else self.positions_dev[dev_rows]
        seq_lens = self.base_seq_dev if dev_rows is None else self.base_seq_dev[dev_rows]
        pos = pos + depth
        seq_lens = (seq_lens + depth).clamp(max=self.max_model_len)
        # Near max_model_len: vLLM's drafter clamps and writes nothing out of range.
        too_far = pos >= self.max_model_len
        pos = pos.clamp(max=self.max_model_len - 1)
        block_idx = (pos // self.block_size).clamp(max=block_table.shape[1] - 1)
        blocks = block_table.gather(1, block_idx.view(-1, 1)).view(-1).to(torch.int64)
        slot_mapping = (blocks * self.block_size + pos % self.block_size).masked_fill(
            too_far, PADDING_SLOT_ID)
        return pos, seq_lens.to(self.cad.seq_lens.dtype), slot_mapping

    def _chain_step_fused(self, dev_rows: torch.Tensor | None, block_table: torch.Tensor,
                          depth: int, num_input_tokens: int,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_chain_step` in one launch of vLLM's own EAGLE step kernel (its chain
        drafter's, CUDA/Triton or the CPU op): from the previous pass's positions and
        sequence lengths (kept while the rows stay the whole batch; else rebuilt from
        ``P``), position + 1, the slot from the block table and sequence length + 1,
        with vLLM's handling near ``max_model_len`` (slot padded: nothing written).
        Like vLLM's, it writes the positions and slots straight into the drafter's input
        buffers (padding slots up to ``num_input_tokens`` included): no copy per pass."""
        if depth == 1 or dev_rows is not None or self._step_state is None:
            pos = self.positions_dev if dev_rows is None else self.positions_dev[dev_rows]
            seq = self.base_seq_dev if dev_rows is None else self.base_seq_dev[dev_rows]
            if depth > 1:
                pos, seq = pos + (depth - 1), seq + (depth - 1)
            # A new tensor (the kernel updates it in place; P + 1 stays as it is).
            seq_lens = seq.to(self.cad.seq_lens.dtype, copy=True)
        else:
            pos, seq_lens = self._step_state
        n = pos.shape[0]
        out_pos = self.p.positions[:n]
        out_slots = self.p._slot_mapping_buffer[:num_input_tokens]
        eagle_step_update_slot_mapping_and_metadata(
            pos, block_table, seq_lens, self.block_size, self.max_model_len,
            out_pos, out_slots, input_batch_size=num_input_tokens)
        # seq_lens was updated in place; the next pass reads the positions from the
        # buffer, as vLLM's chain does.
        self._step_state = (out_pos, seq_lens) if dev_rows is None else None
        return out_pos, seq_lens, out_slots[:n]

    def _forward(self, cad: CommonAttentionMetadata, draft_index: int, num_tokens: int,
                 token_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, padding: Any = None,
                 in_place: bool = False) -> torch.Tensor:
        """One draft forward over ``cad`` with the pass's tokens and positions (on the
        host or the device): the final hidden state of every fed token. ``in_place``:
        the positions and slots are already in the drafter's buffers (padding slots
        included; ``padding`` is then the one they were written for)."""
        p = self.p
        dev = self.device
        _, per_layer_attn_metadata = p.build_per_group_and_layer_attn_metadata(
            cad, draft_index=draft_index)
        if padding is None:
            padding = p._determine_batch_execution_and_padding(num_tokens)
        num_input_tokens = padding[1]
        p.input_ids[:num_tokens] = token_ids.to(device=dev, dtype=p.input_ids.dtype)
        if not in_place:
            p.positions[:num_tokens] = positions.to(dev)
        if p.supports_mm_inputs:
            p.inputs_embeds[:num_tokens] = p.model.embed_input_ids(p.input_ids[:num_tokens])
            input_ids, inputs_embeds = None, p.inputs_embeds[:num_input_tokens]
        else:
            input_ids, inputs_embeds = p.input_ids[:num_input_tokens], None
        return p._draft_forward(
            per_layer_attn_metadata,
            num_tokens,
            padding,
            p._get_slot_mapping(num_input_tokens, None if in_place else slot_mapping),
            dict(
                input_ids=input_ids,
                positions=p._get_positions(num_input_tokens),
                inputs_embeds=inputs_embeds,
            ),
        )

    def run(
        self,
        rows: torch.Tensor,
        tails: torch.Tensor,
        start: torch.Tensor,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft forward pass: request ``rows[i]`` is fed ``tails[i, start[i]:]`` at
        positions ``P+1+start[i] .. P+j`` (``j = tails.shape[1]``; the earlier tail tokens'
        KV is already in its slots). Returns the final hidden state after each row's last
        token, ``[len(rows), H]``. ``rows``, ``start``: CPU int64 tensors; ``tails``: int64
        on the host or the device (the chain round keeps its drafts on the device).

        ``rows`` may repeat a request (MTAD feeds several beams of one request in one
        pass); each such row then needs its own KV slots: ``block_table`` ([len(rows), W]
        on the device) replaces the rows' block-table rows (default: the request's own).
        """
        n, j = tails.shape
        q_lens = j - start
        cols = torch.arange(j)
        feed = cols.unsqueeze(0) >= start.unsqueeze(1)  # [n, j]
        token_ids = fed_tokens(tails, feed)  # row-major: each request's tokens contiguous
        positions = (self.positions_cpu[rows].unsqueeze(1) + 1 + cols.unsqueeze(0))[feed]
        seq_lens = self.base_seq_cpu[rows] + j
        # Near max_model_len: vLLM's drafter clamps and writes nothing out of range;
        # drafts there are never scheduled, they only must not crash or corrupt.
        too_far = positions >= self.max_model_len
        positions = positions.clamp(max=self.max_model_len - 1)
        seq_lens = seq_lens.clamp(max=self.max_model_len)
        qsl_cpu = torch.zeros(n + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(q_lens, 0).to(torch.int32)
        num_tokens = int(qsl_cpu[-1])

        dev = self.device
        req_of_token = torch.repeat_interleave(torch.arange(n), q_lens)
        if block_table is None:
            block_table = self.cad.block_table_tensor[rows.to(dev)]
        n_blocks = block_table.shape[1]
        block_idx = torch.clamp(positions // self.block_size, max=n_blocks - 1)
        blocks = block_table[req_of_token.to(dev), block_idx.to(dev)].to(torch.int64)
        slot_mapping = blocks * self.block_size + (positions % self.block_size).to(dev)
        slot_mapping = slot_mapping.masked_fill(too_far.to(dev), PADDING_SLOT_ID)

        cad = self._pass_metadata(qsl_cpu.to(dev), qsl_cpu,
                                  seq_lens.to(device=dev, dtype=self.cad.seq_lens.dtype),
                                  seq_lens, num_tokens, int(q_lens.max()), block_table,
                                  slot_mapping, num_reqs=n)
        hidden_states = self._forward(cad, j, num_tokens, token_ids, positions, slot_mapping)
        last = (qsl_cpu[1:] - 1).to(device=dev, dtype=torch.long)
        return hidden_states[last]


class DraftKVHoles:
    """Draft KV that skipped first passes did not write, per request, and the catch-up
    pass that writes it (issue 32: a step where nobody drafts costs a plain decode step).

    A draft model's first pass writes the draft KV of every position the target computed
    that step and of the token the target just emitted. A skipped first pass leaves the
    positions from that step's first query token on unwritten (the record keeps, per
    request id, the first such position ``h``; it is conservative: the last round's
    lookahead passes may have written some of them already). Before the next first pass
    that runs, one pass feeds each such request its committed tokens at ``h .. Q-1``
    (``Q``: the first position of the step's target query, from where the first pass
    itself feeds), the way a chunked prefill would: the draft then reads exactly the KV
    it would have had without the skip.

    With prefix caching, vLLM caches a block once the target has computed all of it with
    committed tokens, and another request (a chat's next turn) may reuse it, draft KV
    included: a skipped step catches up, for the requests whose hole reaches into such a
    block, the hole up to that block's end (committed tokens the runner holds), so no
    cached block lacks draft KV; the other requests cost nothing.

    Retired requests: a request that has gone :attr:`retire_after` skipped steps in a row
    (nobody drafted, and no probe would have paid) stops its draft KV upkeep for good:
    no catch-up, nothing kept, and the cost control plans it zero drafts from then on
    (``CostControl``'s ``retired``), so no draft ever reads its gaps. Where drafting
    cannot pay at the batch size (batch 8-32 on a CPU host) the upkeep was all the
    drafter still cost. A request that arrives after :attr:`retire_after` plans in a row
    drafted nothing, at a batch size where not even one certainly accepted draft token
    would pay (``CostControl.retires_arrivals``), is retired on arrival (:meth:`admit`):
    in a stream of requests (a server) each new one would otherwise pay the upkeep, its
    prompt's draft KV included, for its first :attr:`retire_after` steps, which for short
    requests is their whole life. Output stays the target's (verification decides every
    token); what is given up is drafting for that request if the batch later shrinks,
    and, with prefix caching, the draft KV of the blocks it fills after retiring: a later
    request reusing them (a chat's next turn) drafts over those gaps, lossless, with fewer
    drafts accepted, which its own acceptance history then shows.

    The same judgement retires the requests already in the batch (:meth:`admit`): once
    :attr:`idle_batch_plans` plans in a row drafted nothing for anyone at a batch size
    where not even a sure draft token pays, every request of the batch stops its upkeep
    then, not after its own :attr:`retire_after` skipped steps. Nothing could make one of
    them draft before the batch shrinks (no probe pays either), and until then each of
    them paid the catch-ups at its block ends and the plan's weighing every step: a closed
    batch of 8 x 32 tokens on a CPU host (real pair, T = 1) never reached 48 idle steps and
    ran at 0.95x of no speculation with nothing drafted.
    """

    # Skipped steps in a row after which a request retires: three probe intervals
    # (``AcceptanceHistory.probe_interval``), less than the interval after two rejected
    # probes (the probes back off: at batch 1 a request whose drafts do not pay retires
    # instead of probing for its whole life), and short enough that a head's decode-only
    # hole (one position a step, plus the verified rows of its first skipped step) stays
    # within ``HeadKVHoles.max_hole`` (64) until then.
    retire_after = 48
    # Idle plans in a row after which, where not even a sure draft token pays at the batch
    # size, the batch's requests retire (arrivals on arrival; :attr:`idle_batch_plans`):
    # one probe interval, enough for the cost model to have measured the step it judges by.
    retire_idle_batch_after = 16

    def __init__(self, block_size: int, prefix_caching: bool) -> None:
        self.block_size = max(int(block_size), 1)
        self.prefix_caching = prefix_caching
        self.start: dict[str, int] = {}  # request id -> first position without draft KV
        # Request id -> skipped steps in a row (its current run).
        self.idle_steps: dict[str, int] = {}
        self.retired: set[str] = set()  # requests without draft KV upkeep, never to draft
        self.retirements = 0
        self.retired_on_arrival = 0  # of those, retired at their first step (admit)
        self.retired_idle_batch = 0  # of those, retired with their batch (admit)
        self.admitted: set[str] = set()  # requests seen and not retired on arrival
        self.skipped_first_passes = 0
        self.block_end_catch_ups = 0  # skipped steps that caught up blocks vLLM caches
        self.catch_up_steps = 0  # first passes preceded by a catch-up
        self.catch_up_passes = 0
        self.catch_up_tokens = 0
        self.merged_catch_ups = 0  # first passes that fed holes in front of their queries
        # Most tokens one catch-up pass feeds (None: the drafter's token buffer). Tests
        # set it small to exercise holes caught up over several passes.
        self.pass_tokens: int | None = None
        # False: holes are always caught up by passes of their own, never in the first
        # pass (catch_up). Tests set it to exercise those passes on V1.
        self.merge_catch_ups = True

    @property
    def idle_batch_plans(self) -> int:
        """Idle plans in a row after which a batch where no sure token pays retires (see
        the class doc): :attr:`retire_idle_batch_after`, never later than a request's own
        :attr:`retire_after`."""
        return min(self.retire_after, self.retire_idle_batch_after)

    def admit(self, proposer: Any, req_ids: Sequence[str]) -> None:
        """At the start of every step, before :meth:`may_skip`: where nothing could pay now
        (see the class doc) retire the batch's new requests at once, so that no first
        pass, catch-up or kept input is ever spent on them, and the requests already in
        it; admit new ones otherwise."""
        live = [rid for rid in req_ids if rid not in self.retired]
        if not live:
            return
        controls_batch = getattr(proposer, "controls_batch", None)
        if controls_batch is not None and not controls_batch(req_ids):
            # A batch the cost control does not weigh (mtad's "greedy" with a sampled
            # request): its requests draft as configured, so none may retire (a retired
            # request drafts nothing).
            return
        # A tree drafter's tree control judges by its trees (TreeCostControl), a chain
        # drafter's chain control by its lengths (CostControl).
        control = (getattr(proposer, "_tree_cost", None)
                   if getattr(proposer, "tree_state", None) is not None
                   else getattr(proposer, "_cost_control", None))
        idle = control is not None and control.retires_arrivals(len(req_ids),
                                                                self.idle_batch_plans)
        new = [rid for rid in live if rid not in self.admitted]
        if idle:
            for rid in live:
                self._retire(rid)
            self.retired_on_arrival += len(new)
            self.retired_idle_batch += len(live) - len(new)
            return
        if not new:
            return
        self.admitted.update(new)
        if len(self.admitted) > 4 * max(len(req_ids), 64):
            # Finished requests never come back (a preempted one dropped here is only
            # judged again when it resumes).
            self.admitted &= set(req_ids)

    def skip(self, proposer: SpecxPasses, cad: CommonAttentionMetadata,
             req_ids: Sequence[str], first_pos: np.ndarray, query_lens: np.ndarray,
             committed: np.ndarray, token_ids_cpu: np.ndarray) -> None:
        """This step's first pass is skipped: the positions from each request's first query
        token on lack draft KV (unless an earlier skip's hole already starts before). With
        prefix caching, the blocks vLLM caches by this step (those the target completes
        with committed tokens: below ``min(first_pos + query_lens, committed)``, rounded
        down to a block) are caught up now for the requests whose hole reaches into them,
        so no cached block lacks draft KV; only those requests' tokens are fed."""
        bs = self.block_size
        spans: dict[int, list[int]] = {}
        for i, (rid, q, n, c) in enumerate(zip(req_ids, first_pos.tolist(),
                                               query_lens.tolist(), committed.tolist())):
            if rid in self.retired:
                continue
            if self.retires(rid):
                self._retire(rid)
                continue
            self.idle_steps[rid] = self.idle_steps.get(rid, 0) + 1
            # min: a request recomputed from before its hole (resumed after preemption)
            # lacks draft KV from its first query position on.
            h = min(self.start.get(rid, int(q)), int(q))
            if self.prefix_caching:
                cut = (min(int(q) + int(n), int(c)) // bs) * bs
                if h < cut:
                    spans[i] = [h, cut]
                    h = cut
            self.start[rid] = h
        if spans:
            self.block_end_catch_ups += 1
            self._catch_up_spans(proposer, cad, len(req_ids), spans, token_ids_cpu)
        self.skipped_first_passes += 1
        if len(self.start) + len(self.idle_steps) + len(self.retired) > 4 * max(len(req_ids),
                                                                               64):
            # Finished requests never come back: keep the batch's.
            live = set(req_ids)
            self.start = {r: self.start[r] for r in req_ids if r in self.start}
            self.idle_steps = {r: c for r, c in self.idle_steps.items() if r in live}
            self.retired &= live

    def retires(self, rid: str) -> bool:
        """Whether one more skipped step takes request ``rid`` to :attr:`retire_after`."""
        return self.idle_steps.get(rid, 0) + 1 >= self.retire_after

    def _retire(self, rid: str) -> None:
        self.retired.add(rid)
        self.retirements += 1
        self.start.pop(rid, None)
        self.idle_steps.pop(rid, None)
        self.forget(rid)

    def forget(self, rid: str) -> None:
        """A request retired: drop what the record keeps for its catch-ups (nothing beyond
        its hole's start, for a draft model)."""

    def may_skip(self, proposer: SpecxPasses, req_ids: Sequence[str], first_pos: np.ndarray,
                 query_lens: np.ndarray) -> bool:
        """Whether this step's first pass may be skipped (if the plan drafts nothing):
        always for a draft model, whose catch-up reads committed tokens only."""
        return True

    def keep_first_pass_inputs(self, proposer: SpecxPasses, req_ids: Sequence[str],
                               target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                               target_hidden_states: torch.Tensor,
                               token_indices_to_sample: torch.Tensor | None,
                               cad: CommonAttentionMetadata) -> None:
        """On a skipped step, before :meth:`skip`: keep what a later catch-up needs beyond
        the committed tokens the runner holds (nothing, for a draft model)."""

    def catch_up(self, proposer: SpecxPasses, cad: CommonAttentionMetadata,
                 req_ids: Sequence[str], first_pos: np.ndarray,
                 token_ids_cpu: np.ndarray, merge_room: int = 0) -> dict[int, list[int]]:
        """Before a first pass: the missing draft KV of the batch's requests.

        Where the first pass can take them (``merge_room``: the hole positions its
        buffers hold, :meth:`SpecxPasses.first_pass_room`; and :attr:`merge_catch_ups`),
        they are returned, ``{batch row: [h, Q]}``, for that pass to feed in front of each
        request's query tokens (:meth:`first_pass_with_holes`): no pass of their own.
        Otherwise (Model Runner V2, whose first pass is vLLM's own, or holes too long)
        they are written here and ``{}`` returned: ``LookaheadPasses`` over the target's
        attention metadata ``cad``, each row fed its committed tokens right-aligned so its
        last one sits just before where the row's piece ends, in one pass when the
        drafter's token buffer holds them all, else in passes that each take the next
        piece of every row (a row's pieces in order)."""
        for rid in req_ids:  # the first pass runs: nobody's run of skipped steps goes on
            self.idle_steps.pop(rid, None)
        if not self.start:
            return {}
        todo: dict[int, list[int]] = {}  # batch row -> [next position to write, Q]
        for i, rid in enumerate(req_ids):
            h = self.start.pop(rid, None)
            q = int(first_pos[i])
            if h is not None and h < q:
                todo[i] = [h, q]
        self.catch_up_steps += bool(todo)
        positions = sum(q - h for h, q in todo.values())
        if todo and self.merge_catch_ups and positions <= merge_room:
            self.merged_catch_ups += 1
            self.catch_up_tokens += positions
            return todo
        self._catch_up_spans(proposer, cad, len(req_ids), todo, token_ids_cpu)
        return {}

    def first_pass_with_holes(
        self, proposer: SpecxPasses, holes: dict[int, list[int]], token_ids_cpu: np.ndarray,
        target_token_ids: torch.Tensor, target_positions: torch.Tensor,
        cad: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
        """The target's step inputs as the first pass reads them, with each hole
        ``holes[row] = [h, Q]`` (:meth:`catch_up`'s) in front of its row's query: the
        committed tokens at positions ``h .. Q-1``, then the query from ``Q``, as a
        chunked prefill of that request would feed them. The draft then writes the hole's
        KV in the same pass that writes the step's, and reads exactly the KV it would
        have had without the skips. The query lengths, token count and slot mapping grow
        by the holes; sequence lengths, the block table and the rejected tokens (at each
        query's end) are the target's. The hole's rows are the cost of skipping
        (``MeasuredCosts.merged_catch_up``): one row a position in a pass that runs
        anyway, where a pass of its own cost a whole draft pass (3.8 ms on the real pair
        at batch 1) that no plan could weigh well (docs/cost-control.md)."""
        qsl = cad.query_start_loc_cpu.numpy().astype(np.int64)
        lens = np.zeros(len(qsl) - 1, dtype=np.int64)
        for i, (h, q) in holes.items():
            lens[i] = q - h
        before = np.concatenate([[0], np.cumsum(lens)])  # hole positions before row i
        total = int(before[-1])
        n_old = int(target_token_ids.shape[0])
        # Each old token moves by the holes up to and including its own row's; tokens
        # past the last query (padding) by all of them.
        row_of = np.searchsorted(qsl[1:], np.arange(n_old), side="right")
        old_dest = np.arange(n_old) + before[np.minimum(row_of + 1, len(lens))]
        rows = sorted(holes)
        hole_dest = np.concatenate(
            [qsl[i] + before[i] + np.arange(lens[i]) for i in rows])
        hole_pos = np.concatenate([np.arange(*holes[i]) for i in rows])
        hole_tok = torch.cat([self.fed_tokens(i, *holes[i], token_ids_cpu) for i in rows])
        device = target_token_ids.device
        old_dest_t = torch.from_numpy(old_dest).to(device)
        hole_dest_t = torch.from_numpy(hole_dest).to(device)
        hole_pos_t = torch.from_numpy(hole_pos).to(device)
        token_ids = target_token_ids.new_empty(n_old + total)
        token_ids[old_dest_t] = target_token_ids
        token_ids[hole_dest_t] = hole_tok.to(device=device, dtype=token_ids.dtype)
        positions = target_positions.new_empty(n_old + total)
        positions[old_dest_t] = target_positions
        positions[hole_dest_t] = hole_pos_t.to(positions.dtype)
        # The holes' slots, from the request's block table (vLLM recomputes the draft
        # model's from the positions; kept right for any other reader).
        bs = int(proposer.block_size)
        hole_rows = torch.from_numpy(np.repeat(rows, lens[rows])).to(device)
        blocks = cad.block_table_tensor[hole_rows, hole_pos_t // bs]
        slot_mapping = cad.slot_mapping.new_full((n_old + total,), PADDING_SLOT_ID)
        n_slots = min(int(cad.slot_mapping.shape[0]), n_old)
        slot_mapping[old_dest_t[:n_slots]] = cad.slot_mapping[:n_slots]
        slot_mapping[hole_dest_t] = (blocks * bs + hole_pos_t % bs).to(slot_mapping.dtype)
        new_qsl = qsl + before
        qsl_cpu = torch.from_numpy(new_qsl).to(cad.query_start_loc_cpu.dtype)
        new_cad = cad.replace(
            query_start_loc=qsl_cpu.to(device=cad.query_start_loc.device, non_blocking=True),
            query_start_loc_cpu=qsl_cpu,
            num_actual_tokens=int(cad.num_actual_tokens) + total,
            max_query_len=int(np.diff(new_qsl).max()),
            slot_mapping=slot_mapping,
            positions=positions if cad.positions is not None else None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        control = (getattr(proposer, "_cost_control", None)
                   or getattr(proposer, "_tree_cost", None))
        if control is not None:
            control.costs.merged_catch_up(total)
        return token_ids, positions, new_cad

    def _catch_up_spans(self, proposer: SpecxPasses, cad: CommonAttentionMetadata,
                        num_reqs: int, todo: dict[int, list[int]],
                        token_ids_cpu: np.ndarray) -> None:
        """Feed batch row ``i`` its committed tokens at ``todo[i] = [start, end)``, through
        the drafter's own lookahead passes (V1: :class:`LookaheadPasses` over ``cad``;
        Model Runner V2: ``glue/v2_speculators.V2LookaheadPasses`` over its batch)."""
        # The cost model does not count catch-ups as this step's cost (MeasuredCosts.exclude):
        # the chain control's, or a tree drafter's tree control's.
        control = (getattr(proposer, "_cost_control", None)
                   or getattr(proposer, "_tree_cost", None))
        clock = control.costs.clock if control is not None else None
        started = clock() if clock is not None and todo else None
        positions = sum(q - h for h, q in todo.values())
        tokens = getattr(proposer, "catch_up_pass_tokens", None) or proposer.input_ids.shape[0]
        budget = max(int(self.pass_tokens or tokens), 1)
        device = proposer.device
        while todo:
            rows: list[int] = []
            pieces: list[tuple[int, int]] = []
            left = budget
            for i, (h, q) in todo.items():
                if left == 0:
                    break
                n = min(q - h, left)
                rows.append(i)
                pieces.append((h, h + n))
                left -= n
            lens = torch.tensor([b - a for a, b in pieces], dtype=torch.int64)
            j = int(lens.max())
            fed = [self.fed_tokens(i, a, b, token_ids_cpu) for i, (a, b) in zip(rows, pieces)]
            tails = torch.zeros(len(rows), j, dtype=torch.int64, device=fed[0].device)
            for r, (a, b) in enumerate(pieces):
                tails[r, j - (b - a):] = fed[r]
            self.before_catch_up_pass(proposer, rows, pieces)
            rows_t = torch.tensor(rows, dtype=torch.int64)
            # LookaheadPasses feeds row r at positions P_r + 1 + col (col >= start_r) over a
            # sequence of P_r + 1 + j: P_r = b_r - 1 - j puts the last token at b_r - 1.
            base = torch.zeros(num_reqs, dtype=torch.int64)
            base[rows_t] = torch.tensor([b - j for _, b in pieces], dtype=torch.int64)
            passes = proposer.lookahead_passes(cad, (base - 1).to(device), base.to(device))
            passes.run(rows_t, tails, j - lens)
            self.catch_up_passes += 1
            self.catch_up_tokens += int(lens.sum())
            for i, (_, b) in zip(rows, pieces):
                if b >= todo[i][1]:
                    del todo[i]
                else:
                    todo[i][0] = b
        if started is not None:
            control.costs.exclude(clock() - started, positions)

    def fed_tokens(self, row: int, a: int, b: int, token_ids_cpu: np.ndarray) -> torch.Tensor:
        """The tokens a catch-up feeds batch row ``row`` at positions ``a .. b-1`` (int64):
        a draft model's first pass feeds the committed token at each position."""
        return torch.from_numpy(token_ids_cpu[row, a:b].astype(np.int64))

    def before_catch_up_pass(self, proposer: SpecxPasses, rows: list[int],
                             pieces: list[tuple[int, int]]) -> None:
        """Called before each catch-up pass with its batch rows and their ``[a, b)``
        pieces (fed in that order): a head puts its hidden-state inputs in place."""

    def as_dict(self) -> dict[str, int]:
        return {"skipped_first_passes": self.skipped_first_passes,
                "block_end_catch_ups": self.block_end_catch_ups,
                "catch_up_steps": self.catch_up_steps,
                "catch_up_passes": self.catch_up_passes,
                "catch_up_tokens": self.catch_up_tokens,
                "merged_catch_ups": self.merged_catch_ups,
                "retired_requests": self.retirements,
                "retired_on_arrival": self.retired_on_arrival,
                "retired_idle_batch": self.retired_idle_batch,
                "retire_after": self.retire_after,
                "retire_idle_batch_after": self.idle_batch_plans}
