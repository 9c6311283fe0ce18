"""MTAD drafting inside vLLM: beam search of width B and depth K in the draft model.

``MTADProposer`` is vLLM's ``DraftModelProposer`` (checked on vLLM 0.32.0, V1 model
runner) with a different ``propose``: instead of one chain of K tokens it runs, for every
request of the batch, the beam search of ``vllm_specx.algorithms.beam_draft`` and returns
the best beam's K tokens, ``[num_reqs, K]`` like the base class. The chosen beam's
per-token draft probabilities ``q_j`` are left for ``take_last_draft_probs()`` as a
``[num_reqs, K]`` float32 tensor; the runner slices ``[row, :num_draft]`` per request and
concatenates them into the 1-D ``[T]`` tensor the specx sampler's MTAD rule reads.

Draft KV cache: "recompute the tail"
------------------------------------
The B beams of one request write different tokens at the same positions, but a request
owns only one set of KV slots. We therefore keep vLLM's slot layout untouched and use
only the positions vLLM's own draft-model drafter writes (the request's lookahead slots
``P+1 .. P+K-1``, where ``P`` is the position of the token the target just emitted):

* the first pass is exactly the base class's (the target's verified tokens plus the new
  token, one pass for the whole batch) and gives every request's first-token logits;
* at depth ``j`` (1..K-1) each beam's ``j``-token tail must be the content of the lookahead
  slots when its next-token logits are computed. Beams of one request cannot share a
  forward pass (the KV write of one would be read by the other), so depth ``j`` runs B
  passes; pass ``b`` carries beam ``b`` of every request, as a ragged query of that
  beam's tail at positions ``P+1+s .. P+j`` (``seq_len = P+1+j``).
* ``s`` is how much of the tail is already in the slots: the proposer remembers which
  tokens it last wrote there, and the KV at ``P+i`` is still valid when the first ``i``
  tail tokens agree (causality). Beams are visited in lexicographic order of their tails
  so that siblings follow each other; a sibling then costs one token instead of ``j``.
  Without that reuse the cost is ``B * K * (K-1) / 2`` draft tokens per request per round
  on top of the first pass (``reuse_kv_prefix = False`` measures it).

The visiting order, the reuse (where each tail's feed starts) and the split of a pass
into passes that fit the drafter's token buffers are pure functions in
:mod:`vllm_specx.algorithms.beam_tails`, tested there; this module only runs the passes.

Nothing is allocated beyond what vLLM already reserves, and the slots written are the
ones vanilla drafting writes, so prefix caching, chunked prefill and preemption see the
same KV-cache bookkeeping as with ``method="draft_model"``: the next round's first pass
rewrites the draft KV of every verified token anyway.

Warping: each request's own temperature, top-k and top-p (vLLM's order); greedy requests
(temperature 0) run deterministic top-B beam search on the unwarped draft log-probs.
Seeded requests draw from their own ``torch.Generator``. Not applied to the draft (as in
vLLM's own drafter): penalties, bad words, logit bias and other logits processors.

Heterogeneous vocabularies (``use_heterogeneous_vocab``, a draft with another
tokenizer): the base class builds vLLM's ``VocabMapping`` and its first pass already
feeds the draft the target's tokens translated into draft ids. The beam search then runs
entirely in draft ids (the tails it writes are draft tokens) on draft logits constrained
to the shared vocabulary, so every beam is expressible in the target's vocabulary; only
the chosen beam is translated into target ids. The draft probabilities ``q_j`` stay the
draft's own (renormalised over the shared vocabulary): the MTAD rule needs only the
chosen tokens' probabilities, not a distribution over the target's vocabulary, which is
why sampled requests work here while vLLM's own hetero-vocab drafting is greedy-only.

Not supported (refused at construction with the reason): parallel drafting, data
parallelism, decode context parallelism and M-RoPE draft models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_specx.algorithms.beam_draft import (
    BeamSearchState,
    greedy_mask_from_temperature,
    recompute_tail_cost,
    warp_logprobs,
)
from vllm_specx.algorithms.beam_tails import (
    lexicographic_order,
    split_rows_by_token_budget,
    tail_feed_start,
)
from vllm_specx.glue.draft_passes import LookaheadPasses, SpecxDraftModelProposer


@dataclass
class MTADDraftStats:
    """Draft-model work, counted in tokens fed to the draft model.

    ``first_pass_tokens``: the base-class pass over the verified tokens (what vanilla
    draft-model drafting also spends). ``tail_tokens``: the beam-tail recomputation at
    depths 1..K-1 (vanilla would spend ``num_reqs * (K-1)`` there). ``full_recompute``:
    what the tail passes would cost without KV-prefix reuse (``B*K*(K-1)/2`` per request).
    """

    rounds: int = 0
    requests: int = 0  # sum over rounds of the requests drafted for
    first_pass_tokens: int = 0
    tail_tokens: int = 0
    tail_forward_passes: int = 0
    full_recompute_tail_tokens: int = 0

    def record(self, num_reqs: int, k: int, b: int, first: int, tail: int, passes: int) -> None:
        full = num_reqs * recompute_tail_cost(b, k)
        self.rounds += 1
        self.requests += num_reqs
        self.first_pass_tokens += first
        self.tail_tokens += tail
        self.tail_forward_passes += passes
        self.full_recompute_tail_tokens += full

    def as_dict(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "requests": self.requests,
            "first_pass_tokens": self.first_pass_tokens,
            "tail_tokens": self.tail_tokens,
            "tail_forward_passes": self.tail_forward_passes,
            "full_recompute_tail_tokens": self.full_recompute_tail_tokens,
        }


class MTADProposer(SpecxDraftModelProposer):
    """Draft-model proposer that drafts by beam search (MTAD). See the module docstring."""

    # Skip recomputing the part of a beam's tail already in the lookahead slots.
    reuse_kv_prefix: bool = True

    # The validated mtad settings (``num_beams``, ``acceptance_threshold``, ...): set by
    # the runner hook (vllm_specx.glue.runner_hook) right after construction.
    settings: dict[str, Any]

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        self._refuse_unsupported(vllm_config)
        self.stats = MTADDraftStats()
        # Position P of the token each request's draft continues (last round), for
        # tests and debugging: the draft context is the request's tokens [0, P].
        self.last_sample_positions: torch.Tensor | None = None

    @property
    def num_beams(self) -> int:
        """Beam width B, from the validated settings."""
        return int(self.settings["num_beams"])

    @num_beams.setter
    def num_beams(self, value: int) -> None:
        # Tests and the draft-cost script sweep B on one running engine.
        self.settings = {**self.settings, "num_beams": int(value)}

    def _refuse_unsupported(self, vllm_config: Any) -> None:
        reasons = []
        if self.parallel_drafting:
            reasons.append("parallel drafting drafts all positions in one pass, not a beam")
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            reasons.append(
                "data parallelism: ranks would have to agree on every beam pass's batch shape"
            )
        if getattr(parallel, "decode_context_parallel_size", 1) > 1:
            reasons.append("decode context parallelism (KV shards per rank)")
        if self.uses_mrope:
            reasons.append("M-RoPE draft models")
        if reasons:
            raise NotImplementedError(
                "vllm-specx MTAD drafting does not support: " + "; ".join(reasons)
            )

    # ----------------------------------------------------------------------------------
    # propose
    # ----------------------------------------------------------------------------------

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
        slot_mappings: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        k = int(num_speculative_tokens)
        self.num_speculative_tokens = k
        self._last_draft_probs = None
        num_reqs = common_attn_metadata.batch_size()

        first_hidden, sample_positions, cad, first_tokens = self._first_pass(
            target_token_ids=target_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            next_token_ids=next_token_ids,
            token_indices_to_sample=token_indices_to_sample,
            common_attn_metadata=common_attn_metadata,
            mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        logits = self.model.compute_logits(first_hidden)
        self.last_sample_positions = sample_positions
        if k == 0:
            # Same contract as the base class: the pass above keeps the draft KV in sync.
            return torch.empty(num_reqs, 0, device=logits.device, dtype=torch.int64)

        greedy = greedy_mask_from_temperature(
            sampling_metadata.temperature, num_reqs, device=logits.device
        )
        generators = sampling_metadata.generators or None

        mapping = self.vocab_mapping if self.use_heterogeneous_vocab else None

        def warp(lg: torch.Tensor) -> torch.Tensor:
            md = sampling_metadata
            if mapping is not None:
                # Draft-only tokens have no target id: no beam may contain one.
                lg = mapping.constrain_draft_logits(lg)
            if md.temperature is None:
                # All greedy: vLLM may still carry top-k/top-p rows for them, but greedy
                # beam search ranks by the unwarped draft log-probs.
                return warp_logprobs(lg)
            return warp_logprobs(lg, md.temperature, md.top_k, md.top_p)

        state = BeamSearchState.start(num_reqs, self.num_beams, logits.device)
        state = state.step(warp(logits), greedy, generators)

        # The request's sequence length once its first j lookahead positions are filled:
        # the first pass's seq_lens, minus the rejected drafts still counted there
        # (padded drafter batch), is P + 1.
        base_seq_lens = cad.seq_lens
        if num_rejected_tokens_gpu is not None:
            base_seq_lens = base_seq_lens - num_rejected_tokens_gpu
        tail = _TailWriter(self, cad, sample_positions, base_seq_lens, k)
        tail_tokens = tail_passes = 0
        for depth in range(1, k):
            # Host copy once per depth: the pass layouts are built on the host anyway.
            tails = state.tokens.to("cpu")  # [R, B, depth]
            order = lexicographic_order(tails)
            # Beams are fed to the selector one at a time: memory O(R * V), not O(R*B*V).
            selector = state.selector(greedy, generators)
            for i in range(self.num_beams):
                beam_cpu = order[:, i]  # one beam per request in this pass
                beam_tails = tails.gather(1, beam_cpu.view(-1, 1, 1).expand(-1, 1, depth))
                beam_logits, n_tok, n_pass = tail.run(beam_tails.squeeze(1))
                tail_tokens += n_tok
                tail_passes += n_pass
                selector.add(beam_cpu.to(logits.device), warp(beam_logits))
            state = state.apply(selector.result())

        draft_tokens, q = state.best()
        if mapping is not None:
            draft_tokens = mapping.map_draft_to_target_ids(draft_tokens)
        self._last_draft_probs = q.to(torch.float32).contiguous()
        self.stats.record(num_reqs, k, self.num_beams, first_tokens, tail_tokens, tail_passes)
        return draft_tokens


class _TailWriter:
    """Runs "beam tail" passes for one drafting round and remembers what the lookahead
    slots of every request hold, so a pass only recomputes what is not there yet.

    The passes themselves are :class:`~vllm_specx.glue.draft_passes.LookaheadPasses`
    (shared with the adaptive drafter); what to feed is planned by
    :mod:`vllm_specx.algorithms.beam_tails`. Host-side bookkeeping: the tails are small
    ([R, j] ints), and every pass needs its token count on the host anyway.
    """

    def __init__(
        self,
        proposer: MTADProposer,
        cad: CommonAttentionMetadata,
        sample_positions: torch.Tensor,
        base_seq_lens: torch.Tensor,
        k: int,
    ) -> None:
        self.p = proposer
        self.passes = LookaheadPasses(proposer, cad, sample_positions, base_seq_lens)
        self.num_reqs = cad.batch_size()
        # Tokens whose KV sits in the lookahead slots P+1.. (valid for the first
        # `held_len` of them); nothing is held at the start of a round.
        self.held = torch.zeros(self.num_reqs, max(k - 1, 1), dtype=torch.int64)
        self.held_len = torch.zeros(self.num_reqs, dtype=torch.int64)
        # Rows per pass: every pass must fit the proposer's token buffers.
        self.max_tokens = proposer.max_num_tokens

    def run(self, tails: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Make ``tails[r]`` ([R, j]) the content of request r's lookahead slots and return
        the draft logits after its last token ([R, V]), tokens fed, passes run."""
        tails_cpu = tails.to("cpu", torch.int64)
        j = tails_cpu.shape[1]
        start = tail_feed_start(self.held, self.held_len, tails_cpu, reuse=self.p.reuse_kv_prefix)
        q_lens = j - start
        logits_parts = []
        for lo, hi in split_rows_by_token_budget(q_lens, self.max_tokens):
            rows = torch.arange(lo, hi, dtype=torch.int64)
            hidden = self.passes.run(rows, tails_cpu[lo:hi], start[lo:hi])
            logits_parts.append(self.p.model.compute_logits(hidden))
        tokens, passes = int(q_lens.sum()), len(logits_parts)
        self.held[:, :j] = tails_cpu
        self.held_len.fill_(j)
        return torch.cat(logits_parts, dim=0), tokens, passes
