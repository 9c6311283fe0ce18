"""The specx draft-model methods (``adaptive``, ``mtad``) as Model Runner V2 speculators
(vLLM glue, checked on vLLM 0.32's ``vllm/v1/worker/gpu/``).

V2 builds one speculator per runner (``BaseSpeculator``: ``propose(...) -> [num_reqs,
K]``); for vLLM's ``draft_model`` it is ``StandaloneARSpeculator``. The specx speculators
here are that class with the specx round in place of its fixed K-step chain, the same
round the V1 drafters run (no copy):

* the **first pass** is exactly vLLM's V2 one (``StandaloneARSpeculator._prefill``: the
  verified tokens, the token the target just emitted and the rejected drafts' slots, for
  the whole batch; it keeps the draft KV cache in sync). Its sampling hook is where the
  round picks up the draft's final hidden state at each request's new token;
* the **round** is the V1 drafter's own mixin: :class:`~.chain_drafter.ChainRound`
  (``adaptive``: per-request stop, shrinking batch) or :class:`~.mtad_proposer.MTADRound`
  (``mtad``: beam search), run on a :class:`~.draft_passes.RoundStart` built from V2's
  batch;
* its **lookahead passes** (:class:`V2LookaheadPasses`) are the V1 ones over V2's
  structures: slots from V2's block tables (``BlockTables.block_tables``, indexed by the
  batch's request-state rows), attention metadata from V2's ``build_attn_metadata`` with
  the speculator's draft attention groups, the forward through vLLM's
  ``StandaloneARSpeculator._run_model``.

Ragged drafts (``adaptive``): the round returns one list per request; ``propose`` writes
them into V2's ``[num_reqs, K]`` draft buffer and keeps each request's length for
``take_draft_lengths()``, which the ``v2_ragged_draft_lengths`` patch
(``glue/v2_patches.py``) reads to hand the scheduler exactly those lengths.

CUDA graphs: like vLLM's own ``StandaloneARSpeculator`` (0.32: "CUDA graph not yet
supported for standalone AR speculator"), these speculators capture nothing and run
eager inside a runner whose target model is captured as usual; their passes change shape
from round to round (a shrinking batch, beams), which no captured graph could replay.

What differs from V1:

* The draft probabilities reach the specx sampler on V2 by request-state row
  (``glue/v2_sampler.store_draft_q``), not through ``take_last_draft_probs``. Without
  that sampler (:attr:`SpecxV2DraftSpeculator.sampler_reads_draft_probs` False: vLLM's
  V2 ``RejectionSampler`` treats drafts as one-hot, lossless only for argmax drafts)
  sampled requests draft the argmax.
* A draft with another tokenizer never reaches V2: vLLM 0.32 itself keeps
  heterogeneous-vocabulary drafts on V1 (logged), and refuses a forced
  ``VLLM_USE_V2_MODEL_RUNNER=1`` for them before start (checked with ``mtad``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata, build_slot_mappings_by_layer
from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

from vllm_specx.glue.chain_drafter import ChainRound
from vllm_specx.glue.draft_passes import DraftKVHoles, RoundStart, fed_tokens
from vllm_specx.glue.mtad_proposer import DraftTreeRound, MTADRound

# vLLM's slot id for "write no KV" (vllm.v1.worker.gpu.block_table's PAD_SLOT_ID).
PAD_SLOT_ID = -1
# Draft generators' seeds: (V2's request seed, position of the request's new token).
_SEED_MIX = 1_000_003

__all__ = ["AdaptiveV2Speculator", "DraftTreeV2Speculator", "MTADV2Speculator",
           "SpecxV2DraftSpeculator", "V2LookaheadPasses"]


@dataclass(frozen=True)
class V2Batch:
    """A V2 round's batch, where the V1 rounds read a ``CommonAttentionMetadata``: its
    size, each row's request-state index (V2's block tables are indexed by it) and the
    draft layers' block-table rows (MTAD's per-beam rows start from them)."""

    num_reqs: int
    idx_mapping: torch.Tensor  # [num_reqs] request-state rows, on the device
    block_table_tensor: torch.Tensor  # [num_reqs, W]: the draft KV-cache group's rows

    def batch_size(self) -> int:
        return self.num_reqs


class V2CommittedTokens:
    """Each batch row's committed token ids as ``DraftKVHoles`` reads them
    (``tokens[row, a:b]``, a numpy array): V2 keeps them per request-state row in
    ``req_states.all_token_ids`` (the step's sampled tokens included once ``propose``
    runs); only the slices a catch-up feeds are read."""

    def __init__(self, all_token_ids: torch.Tensor, state_rows: np.ndarray) -> None:
        self.all_token_ids = all_token_ids
        self.state_rows = state_rows

    def __getitem__(self, key: tuple[int, slice]) -> np.ndarray:
        row, cols = key
        return self.all_token_ids[int(self.state_rows[row]), cols].to("cpu").numpy()


@dataclass(frozen=True)
class V2Sampling:
    """The sampling parameters a round reads (V1's ``SamplingMetadata`` fields), one row
    per request of the batch; ``temperature`` None means every request is greedy (V1's
    convention)."""

    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: dict[int, torch.Generator]


class V2LookaheadPasses:
    """The V1 :class:`~.draft_passes.LookaheadPasses` contract over Model Runner V2:
    ``run(rows, tails, start)`` feeds request ``rows[i]`` the tokens
    ``tails[i, start[i]:]`` at positions ``P+1+start[i] .. P+j`` and returns the draft's
    final hidden state after each row's last token."""

    def __init__(self, speculator: SpecxV2DraftSpeculator, batch: V2Batch,
                 sample_positions: torch.Tensor, base_seq_lens: torch.Tensor) -> None:
        self.s = speculator
        self.device = sample_positions.device
        self.positions_cpu = sample_positions.to("cpu", torch.int64)  # P per request
        self.base_seq_cpu = base_seq_lens.to("cpu", torch.int64)  # P + 1 per request
        tables = speculator.block_tables
        # [num_reqs, W] per KV-cache group: the batch's rows of the request-state tables.
        self.tables = [t.gpu[batch.idx_mapping] for t in tables.block_tables]
        self.block_sizes = list(tables.block_sizes)

    def run(self, rows: torch.Tensor, tails: torch.Tensor, start: torch.Tensor,
            block_table: torch.Tensor | None = None) -> torch.Tensor:
        """``block_table`` ([len(rows), W]) replaces the rows' block-table rows (MTAD's
        beams in their own KV slots, ``glue/beam_kv.py``; only with one block size, so
        every group reads it: the draft layers read their own group's)."""
        s = self.s
        n, j = tails.shape
        q_lens = j - start
        cols = torch.arange(j)
        feed = cols.unsqueeze(0) >= start.unsqueeze(1)
        token_ids = fed_tokens(tails, feed)
        positions = (self.positions_cpu[rows].unsqueeze(1) + 1 + cols.unsqueeze(0))[feed]
        seq_lens = self.base_seq_cpu[rows] + j
        # Near max_model_len (as V1's drafter): clamp, write nothing out of range.
        too_far = positions >= s.max_model_len
        positions = positions.clamp(max=s.max_model_len - 1)
        seq_lens = seq_lens.clamp(max=s.max_model_len)
        qsl_cpu = torch.zeros(n + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(q_lens, 0).to(torch.int32)
        num_tokens = int(qsl_cpu[-1])

        dev = self.device
        req_of_token = torch.repeat_interleave(torch.arange(n), q_lens).to(dev)
        dev_rows = rows.to(dev)
        dev_pos = positions.to(dev)
        tables, slots = [], []
        for table_all, block_size in zip(self.tables, self.block_sizes):
            table = table_all[dev_rows] if block_table is None else block_table
            block_idx = torch.clamp(dev_pos // block_size, max=table.shape[1] - 1)
            blocks = table[req_of_token, block_idx].to(torch.int64)
            slot = blocks * block_size + dev_pos % block_size
            slots.append(slot.masked_fill(too_far.to(dev), PAD_SLOT_ID))
            tables.append(table)
        slot_mappings = torch.stack(slots) if slots else torch.empty(0, num_tokens)
        attn_metadata = build_attn_metadata(
            attn_groups=s.attn_groups,
            num_reqs=n,
            num_tokens=num_tokens,
            query_start_loc_gpu=qsl_cpu.to(dev),
            query_start_loc_cpu=qsl_cpu,
            max_query_len=int(q_lens.max()),
            seq_lens=seq_lens.to(device=dev, dtype=torch.int32),
            max_seq_len=s.max_model_len,
            block_tables=tables,
            slot_mappings=slot_mappings,
            kv_cache_config=s.kv_cache_config,
            seq_lens_cpu_upper_bound=seq_lens.to(torch.int32),
            positions=dev_pos,
            is_prefilling=torch.zeros(n, dtype=torch.bool),
        )
        hidden = s._run_model(
            token_ids.to(device=dev, dtype=torch.int32),
            dev_pos,
            attn_metadata,
            build_slot_mappings_by_layer(slot_mappings, s.kv_cache_config),
            None,
        )
        last = (qsl_cpu[1:] - 1).to(device=dev, dtype=torch.long)
        return hidden[last]


class SpecxV2DraftSpeculator(StandaloneARSpeculator):
    """vLLM's V2 draft-model speculator with a specx round after its first pass (see the
    module doc). A method's speculator mixes its round in before this class."""

    # The validated specx settings: set by install_v2_speculator before load_model.
    settings: dict[str, Any]
    # True: ``propose`` asks the round for its plan before the first pass
    # (``plan_before_first_pass``, as V1's ``SpecxPasses.propose``) and hands it to the
    # round as ``start.plan``; False: the round plans after the first pass, if at all.
    plans_before_first_pass: bool = False
    # True (with plans_before_first_pass): a step whose plan drafts nothing for anyone
    # skips V2's first pass too, and DraftKVHoles catches the draft KV up (V1's
    # SpecxPasses.skips_idle_first_pass; a draft model's first pass reads token ids only).
    skips_idle_first_pass: bool = False

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device)
        self.runner = runner
        # What the V1 rounds and specx refusals read off a V1 proposer.
        self.parallel_drafting = bool(self.speculative_config.parallel_drafting)
        self.uses_mrope = bool(vllm_config.model_config.uses_mrope)
        self.use_heterogeneous_vocab = False  # vLLM 0.32 keeps those drafts on V1
        self.max_batch_size = self.max_num_reqs
        self._last_draft_probs: torch.Tensor | None = None
        self._draft_lengths: dict[str, int] | None = None
        self._first_pass: tuple[torch.Tensor, torch.Tensor] | None = None
        self._catch_first_pass = False

    @property
    def sampler_reads_draft_probs(self) -> bool:
        """True when the runner verifies with the specx sampler on V2, which reads the
        round's draft probabilities (``store_draft_q``); vLLM's V2 sampler treats drafts
        as one-hot, so sampled requests then draft the argmax (see the module doc)."""
        from vllm_specx.glue.v2_sampler import SpecxV2RejectionSampler

        return isinstance(getattr(self.runner, "rejection_sampler", None),
                          SpecxV2RejectionSampler)

    # -- what the rounds use -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """The draft layers' KV block size (MTAD's scratch region is cut in it)."""
        return int(self.block_tables.block_sizes[self._draft_group()])

    @property
    def _draft_attn_layer_names(self) -> set[str]:
        # V1's name for it (glue/beam_kv.py reads the draft layers' caches by it).
        return self.draft_attn_layer_names

    @property
    def num_speculative_tokens(self) -> int:
        """vLLM's K under V1's name (V2 calls it ``num_speculative_steps``): the width of
        the draft buffer, a draft tree's node budget with ``draft_tree``."""
        return int(self.num_speculative_steps)

    def _draft_group(self) -> int:
        """The KV-cache group of the draft model's attention layers."""
        for i, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if self.draft_attn_layer_names & set(group.layer_names):
                return i
        return 0

    def lookahead_passes(self, cad: V2Batch, sample_positions: torch.Tensor,
                         base_seq_lens: torch.Tensor) -> V2LookaheadPasses:
        return V2LookaheadPasses(self, cad, sample_positions, base_seq_lens)

    def take_last_draft_probs(self) -> torch.Tensor | None:
        probs, self._last_draft_probs = self._last_draft_probs, None
        return probs

    def take_draft_lengths(self) -> dict[str, int] | None:
        """Request id -> drafted tokens of the last round, when the drafts were ragged
        (read once by the ``v2_ragged_draft_lengths`` patch); None: K for every request."""
        lengths, self._draft_lengths = self._draft_lengths, None
        return lengths

    def sampling_view(self, input_batch: Any, temperature: torch.Tensor, seeds: torch.Tensor,
                      sample_positions: torch.Tensor) -> V2Sampling:
        """The batch's sampling parameters, one row per request (V2 keeps them per
        request-state row).

        V2 has no per-request ``torch.Generator``: every request has a seed (its own, or
        one V2 drew). A sampled request draws its drafts from a generator seeded with (that
        seed, the position of its new token), so a seeded request's drafts, and with them
        its output, are the same run to run, as on V1."""
        num_reqs = input_batch.num_reqs
        idx = input_batch.idx_mapping[:num_reqs]
        temp = temperature[idx].to(torch.float32)
        if bool((temp < 1e-5).all()):
            return V2Sampling(None, None, None, {})
        top_k = top_p = None
        states = getattr(getattr(self.runner, "sampler", None), "sampling_states", None)
        if states is not None:
            top_k = states.top_k.gpu[idx].to(torch.int64)
            top_p = states.top_p.gpu[idx]
        generators: dict[int, torch.Generator] = {}
        request_seeds = seeds[idx].tolist()
        positions = sample_positions.tolist()
        for row in (temp >= 1e-5).nonzero().flatten().tolist():
            gen = torch.Generator(device=self.device)
            gen.manual_seed((int(request_seeds[row]) * _SEED_MIX + int(positions[row]))
                            % (2**63 - 1))
            generators[row] = gen
        return V2Sampling(temp, top_k, top_p, generators)

    # -- vLLM's first pass, caught ---------------------------------------------------------

    def sample_draft(self, hidden_states: torch.Tensor, sample_src_positions: torch.Tensor,
                     *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self._catch_first_pass:
            return super().sample_draft(hidden_states, sample_src_positions, *args, **kwargs)
        # The first pass's rows at each request's new token: the round starts here.
        self._first_pass = (hidden_states.clone(), sample_src_positions.to(torch.int64))
        return torch.zeros(hidden_states.shape[0], dtype=torch.int64,
                           device=hidden_states.device)

    @torch.inference_mode()
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any,
                last_hidden_states: torch.Tensor, aux_hidden_states: Any,
                num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                temperature: torch.Tensor, seeds: torch.Tensor, dp_sync_state: Any = None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs: Any = None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        if dummy_run:
            # Profiling and warm-up: vLLM's own chain over the same draft model.
            return super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
                dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                mm_inputs=mm_inputs, is_profile=is_profile,
                num_speculative_tokens=num_speculative_tokens,
            )
        num_reqs = input_batch.num_reqs
        k = self.num_speculative_steps if num_speculative_tokens is None else int(
            num_speculative_tokens)
        num_tokens_across_dp = (
            dp_sync_state.num_tokens_across_dp if dp_sync_state is not None else None
        )
        self._copy_request_inputs(num_reqs, input_batch.idx_mapping, temperature, seeds)
        req_ids = tuple(input_batch.req_ids[:num_reqs])
        idx_mapping = input_batch.idx_mapping[:num_reqs]
        batch = V2Batch(num_reqs, idx_mapping,
                        self.block_tables.block_tables[self._draft_group()].gpu[idx_mapping])
        plan = None
        if self.plans_before_first_pass and k > 0:
            plan, skipped = self.plan_or_skip_first_pass(
                input_batch, k, req_ids, num_rejected, batch)
            if skipped:
                return self._no_drafts(input_batch, num_reqs)
        self._catch_first_pass = True
        try:
            self._prefill(input_batch, num_rejected, last_sampled, num_reqs, False,
                          num_tokens_across_dp)
        finally:
            self._catch_first_pass = False
        assert self._first_pass is not None
        out, sample_positions = self._first_pass
        self._first_pass = None
        self._last_draft_probs = None
        if plan is not None and plan.skip_first_pass:
            # Nobody drafts and the first pass ran (a drafter that does not skip it): the
            # plan already ended the round.
            return self._no_drafts(input_batch, num_reqs)
        start = RoundStart(
            k, num_reqs, out, sample_positions, batch,
            int(input_batch.num_tokens) + num_reqs,
            sample_positions + 1,
            req_ids, num_rejected[:num_reqs], int(input_batch.num_tokens), plan,
        )
        drafts = self.draft_round(
            start, self.sampling_view(input_batch, temperature, seeds, sample_positions))
        buf = self.draft_tokens[:num_reqs]
        if isinstance(drafts, list):
            # Ragged: the scheduler gets each request's length (take_draft_lengths); the
            # slots past it are never read.
            buf.zero_()
            for row, ids in enumerate(drafts):
                if ids:
                    buf[row, : len(ids)] = torch.tensor(ids, dtype=buf.dtype)
            self._draft_lengths = {
                req_id: len(ids) for req_id, ids in zip(input_batch.req_ids, drafts)
            }
        else:
            buf[:, : drafts.shape[1]] = drafts.to(device=buf.device, dtype=buf.dtype)
            self._draft_lengths = None
        if self.sampler_reads_draft_probs:
            # The specx sampler on V2 reads q by request-state row (glue/v2_sampler.py).
            from vllm_specx.glue.v2_sampler import store_draft_q

            store_draft_q(self, input_batch.idx_mapping[:num_reqs], self.take_last_draft_probs(),
                          self.max_num_reqs)
        return buf

    def plan_or_skip_first_pass(
        self, input_batch: Any, k: int, req_ids: tuple[str, ...], num_rejected: torch.Tensor,
        batch: V2Batch, keep: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[Any, bool]:
        """Before V2's first pass, as V1's ``SpecxPasses.propose``: the round's plan
        (``plan_before_first_pass``; mtad's depth for the step too: it plans nowhere
        else), and, for a speculator that ``skips_idle_first_pass``, either the skip of
        that pass (a plan that drafts nothing for anyone: returns ``(plan, True)``; the
        caller hands the scheduler zero-length drafts) or the catch-up of the KV the
        skipped passes did not write, before the pass runs (the record is
        :meth:`kv_holes`, its passes :class:`V2LookaheadPasses`).

        A hole record that refuses a skip (``may_skip``: an EAGLE/MTP head's hole past
        its bound) gets no plan here: the round plans after the first pass. ``keep``:
        called with each request's rejected drafts ([R], host) on a skipped step, before
        the record's ``skip``: what an EAGLE/MTP head keeps of the pass's inputs."""
        num_reqs = len(req_ids)
        holes = self.kv_holes() if self.skips_idle_first_pass else None
        first_pos = input_batch.num_computed_tokens_np[:num_reqs].astype(np.int64)
        qsl = input_batch.query_start_loc_np
        query_lens = (qsl[1:num_reqs + 1] - qsl[:num_reqs]).astype(np.int64)
        plan = None
        if holes is not None:
            holes.admit(self, req_ids)
        if holes is None or holes.may_skip(self, req_ids, first_pos, query_lens):
            plan = self.plan_before_first_pass(k, req_ids, num_rejected[:num_reqs],
                                               int(input_batch.num_tokens))
        # Without a plan (cost control off) and no hole left, there is nothing to do.
        if holes is None or (plan is None and not holes.start):
            return plan, False
        tokens = V2CommittedTokens(self.runner.req_states.all_token_ids.gpu,
                                   input_batch.idx_mapping_np[:num_reqs])
        if plan is not None and plan.skip_first_pass:
            # A request rejected drafts only if its query held some (more than its one new
            # token). While nobody drafts no query does, and the device is not read: that
            # read would wait for the step that just ran, every step.
            if (query_lens > 1).any():
                rejected = num_rejected[:num_reqs].to("cpu").numpy().astype(np.int64)
            else:
                rejected = np.zeros(num_reqs, dtype=np.int64)
            if keep is not None:
                keep(rejected)
            # Committed after this step (V1's num_tokens_no_spec): the verified query
            # tokens and the token just sampled.
            holes.skip(self, batch, req_ids, first_pos, query_lens,
                       first_pos + query_lens - rejected + 1, tokens)
            return plan, True
        holes.catch_up(self, batch, req_ids, first_pos, tokens)
        return plan, False

    def _no_drafts(self, input_batch: Any, num_reqs: int) -> torch.Tensor:
        """A step where nobody drafts: zero-length drafts for every request (the scheduler
        gets none through ``take_draft_lengths``), no draft probabilities."""
        buf = self.draft_tokens[:num_reqs]
        buf.zero_()
        self._draft_lengths = {req_id: 0 for req_id in input_batch.req_ids[:num_reqs]}
        self._last_draft_probs = None
        if self.sampler_reads_draft_probs:
            from vllm_specx.glue.v2_sampler import store_draft_q

            store_draft_q(self, input_batch.idx_mapping[:num_reqs], None, self.max_num_reqs)
        return buf

    def kv_holes(self) -> DraftKVHoles:
        """The record of draft KV that skipped first passes did not write (as V1's
        ``SpecxPasses.kv_holes``): the draft's KV block size and vLLM's prefix caching."""
        holes = getattr(self, "_kv_holes", None)
        if holes is None:
            holes = self._kv_holes = self.kv_holes_class()(
                self.block_size, bool(self.vllm_config.cache_config.enable_prefix_caching))
        return holes

    def kv_holes_class(self) -> type[DraftKVHoles]:
        """A draft model's record (its first pass reads committed token ids only); an
        EAGLE/MTP head's keeps that pass's inputs (``glue/v2_eagle.py``)."""
        return DraftKVHoles

    @property
    def catch_up_pass_tokens(self) -> int:
        """The most tokens one catch-up pass feeds (``DraftKVHoles``): a step's budget."""
        return int(self.max_num_tokens)

    def draft_round(self, start: RoundStart, sampling: Any) -> Any:  # pragma: no cover
        raise NotImplementedError(f"{type(self).__name__} drafts no round")


class AdaptiveV2Speculator(ChainRound, SpecxV2DraftSpeculator):
    """``adaptive`` on Model Runner V2: the chain round with the per-request stop
    (``glue/chain_drafter.py``) after vLLM's V2 first pass. With cost control the lengths
    are planned before the first pass, which a step where nobody drafts skips (as V1)."""

    plans_before_first_pass = True
    skips_idle_first_pass = True

    def drafts_argmax(self) -> bool:
        return super().drafts_argmax() or not self.sampler_reads_draft_probs


class MTADV2Speculator(MTADRound, SpecxV2DraftSpeculator):
    """``mtad`` on Model Runner V2: the beam-search round (``glue/mtad_proposer.py``)
    after vLLM's V2 first pass, every beam of a depth in one pass in its own KV slots
    (``glue/beam_kv.py``'s scratch region, as on V1). With ``cost_control`` the step's
    depth ``0..K`` is planned before the first pass (``MTADRound.plan_before_first_pass``)
    and a shallower round reaches the scheduler as ragged lists (``take_draft_lengths``);
    depth 0 skips the first pass (as V1)."""

    plans_before_first_pass = True
    skips_idle_first_pass = True


class DraftTreeV2Speculator(DraftTreeRound, SpecxV2DraftSpeculator):
    """``adaptive`` with ``draft_tree`` on Model Runner V2: V1's round
    (``mtad_proposer.DraftTreeRound``: the top-k tree pruned by cost control, or i.i.d.
    children for a sampled batch) after vLLM's V2 first pass. Each request's tree reaches
    the scheduler as its ragged draft list (BFS order; a request pruned to nothing as an
    empty one) and the runner's tree state (``glue/v2_tree_step.py``) verifies it as a
    tree. The i.i.d. children's q rows (``[R, N, V]``) reach the specx sampler by
    request-state row (``store_draft_q``), which then verifies those trees with the
    ``"sampled"`` (SpecInfer) rule (``SpecxV2RejectionSampler.verify_trees``), as V1's
    sampler does."""

    def may_draft_sampled_children(self) -> bool:
        # Only with the specx sampler on V2: it is what reads the q rows (a tree config
        # always installs it; without it the i.i.d. children would meet a one-hot rule).
        return self.sampler_reads_draft_probs
