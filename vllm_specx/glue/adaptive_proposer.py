"""Adaptive-length drafting inside vLLM (SpecDec++ stop rule, EMS-SD unpadded batches).

``AdaptiveProposer`` is vLLM's ``DraftModelProposer`` (V1 model runner, checked on vLLM
0.32) drafting a chain of up to ``K_max`` tokens per request, where every request decides
on its own, after each draft step, whether to go on (the stop rules are pure functions in
``vllm_specx.algorithms.draft_stop``):

* the base class's first pass gives ``q_1``; every request draws ``Y_1``;
* at depth ``j`` (0..K_max-2) each live request holds ``Y_1..Y_{j+1}`` (the last one just
  drawn) and the stop rule says whether it goes on. Those that go on feed ``Y_{j+1}`` to the
  draft in one pass over the requests STILL DRAFTING only (the batch shrinks as requests
  stop: no forward work for a request that stopped), which gives the final hidden state
  ``h_{j+1}`` (the acceptance head's input) and ``q_{j+2}``, from which ``Y_{j+2}`` is drawn.

A stop keeps the token already drawn: it cost its draft forward already and may be
accepted, so a request that drafts ``n`` tokens costs exactly ``n`` draft forwards (the
first pass and ``n - 1`` lookahead passes), like a fixed-length draft of ``n``.

The proposer returns ``list[list[int]]`` (one list per request, of the length it drafted),
the same ragged form vLLM's ngram proposer returns, so the scheduler receives exactly the
drafted tokens and verification costs exactly the drafted positions: nothing is padded to
the longest draft. That needs synchronous scheduling (with async scheduling the scheduler
reserves ``K`` placeholder slots per request before the drafts exist): the method's spec
turns vLLM's async scheduling off, and refuses an explicit ``async_scheduling: true``.

Drafts: greedy requests draft the draft's argmax. Sampled requests draw from the draft's
warped distribution ``q`` (temperature, top-k, top-p in vLLM's order) and leave the full
``q`` rows for ``take_last_draft_probs()``, so the specx sampler runs standard rejection
sampling against ``q`` (lossless for any ``q``). With ``draft_sampling: "greedy"`` sampled
requests draft the argmax too and are verified with the one-hot rule. Seeded requests draw
from their own ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_specx.algorithms.beam_draft import greedy_mask_from_temperature
from vllm_specx.algorithms.draft_sampling import draw_draft_tokens
from vllm_specx.algorithms.draft_stop import DraftStopRule
from vllm_specx.glue.draft_passes import (
    LookaheadPasses,
    SpecxDraftModelProposer,
    load_acceptance_head,
    round_stop_rule,
)


@dataclass
class AdaptiveDraftStats:
    """What the adaptive drafter did, for ``vllm-specx bench`` (``specx_stats()``).

    ``draft_tokens``: tokens drafted (what the scheduler receives). ``lookahead_rows``:
    request-rows fed to the lookahead passes (with a padded batch it would be
    ``requests * (K_max - 1)``). ``length_histogram[n]``: requests that drafted n tokens.
    """

    rounds: int = 0
    requests: int = 0
    draft_tokens: int = 0
    first_pass_tokens: int = 0
    lookahead_passes: int = 0
    lookahead_rows: int = 0
    padded_lookahead_rows: int = 0
    length_histogram: dict[int, int] = field(default_factory=dict)

    def record(self, lengths: list[int], k_max: int, first: int, passes: int, rows: int) -> None:
        self.rounds += 1
        self.requests += len(lengths)
        self.draft_tokens += sum(lengths)
        self.first_pass_tokens += first
        self.lookahead_passes += passes
        self.lookahead_rows += rows
        self.padded_lookahead_rows += len(lengths) * max(k_max - 1, 0)
        for n in lengths:
            self.length_histogram[n] = self.length_histogram.get(n, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        # Keys read by the bench (``DrafterStats``): the scheduler receives exactly the
        # drafted tokens, and draft forwards are counted per request (first pass +
        # one lookahead row per step the request was still drafting).
        return {
            "drafted_tokens": self.draft_tokens,
            "scheduled_tokens": self.draft_tokens,
            "draft_forward_passes": self.requests + self.lookahead_rows,
            "rounds": self.rounds,
            "requests": self.requests,
            "batched_forward_passes": self.rounds + self.lookahead_passes,
            "first_pass_tokens": self.first_pass_tokens,
            "lookahead_rows": self.lookahead_rows,
            "padded_lookahead_rows": self.padded_lookahead_rows,
            "length_histogram": {str(k): v for k, v in sorted(self.length_histogram.items())},
        }


class AdaptiveProposer(SpecxDraftModelProposer):
    """Chain drafting with a per-request stop and a shrinking batch. See the module doc."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        reasons = []
        if self.parallel_drafting:
            reasons.append("parallel drafting drafts all positions in one pass")
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            reasons.append("data parallelism: ranks would have to agree on each pass's batch")
        if self.uses_mrope:
            reasons.append("M-RoPE draft models")
        if self.use_heterogeneous_vocab:
            reasons.append("drafts with another tokenizer")
        if reasons:
            raise NotImplementedError(
                "vllm-specx adaptive drafting does not support: " + "; ".join(reasons)
            )
        self.stats = AdaptiveDraftStats()
        self.head: Any = None

    # -- set-up -----------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        dtype = next(self.model.parameters()).dtype
        self.head = load_acceptance_head(self.settings, self.device, dtype)

    def stop_rule(self, k_max: int) -> DraftStopRule:
        """The round's rule (``k_max``: what the runner asks for this step)."""
        return round_stop_rule(self.settings, k_max, self.head)

    def specx_stats(self) -> dict[str, Any]:
        return self.stats.as_dict()

    # -- propose ----------------------------------------------------------------------

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
        k_max = int(num_speculative_tokens)
        self.num_speculative_tokens = k_max
        self._last_draft_probs = None
        num_reqs = common_attn_metadata.batch_size()

        hidden, sample_positions, cad, first_tokens = self._first_pass(
            target_token_ids=target_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            next_token_ids=next_token_ids,
            token_indices_to_sample=token_indices_to_sample,
            common_attn_metadata=common_attn_metadata,
            mm_embed_inputs=mm_embed_inputs,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        if k_max == 0:
            # Same contract as the base class: the pass above keeps the draft KV in sync.
            return torch.empty(num_reqs, 0, device=hidden.device, dtype=torch.int64)

        device = hidden.device
        greedy = greedy_mask_from_temperature(sampling_metadata.temperature, num_reqs, device)
        greedy_drafts = self.settings.get("draft_sampling") == "greedy"
        # Sampled requests need their full q for the residual; greedy ones never read it.
        keep_q = not greedy_drafts and not bool(greedy.all())
        draw_greedy = torch.ones_like(greedy) if greedy_drafts else greedy
        generators = sampling_metadata.generators or {}

        rule = self.stop_rule(k_max)
        state = rule.start(num_reqs, device)
        tokens = torch.zeros(num_reqs, k_max, dtype=torch.int64)  # host: tails are fed from it
        lengths = torch.zeros(num_reqs, dtype=torch.int64)
        q_full = None
        live = torch.arange(num_reqs)  # host indices of the requests still drafting

        base_seq_lens = cad.seq_lens
        if num_rejected_tokens_gpu is not None:
            base_seq_lens = base_seq_lens - num_rejected_tokens_gpu
        passes = LookaheadPasses(self, cad, sample_positions, base_seq_lens)
        n_passes = n_rows = 0
        depth = 0
        while True:
            # Y_{depth+1} is drawn from q_{depth+1} (the first pass's logits at depth 0,
            # else those after feeding Y_depth) and joins the draft of every live request.
            logits = self.model.compute_logits(hidden)
            y, probs = draw_draft_tokens(
                logits, live, draw_greedy, generators, sampling_metadata.temperature,
                sampling_metadata.top_k, sampling_metadata.top_p,
            )
            if q_full is None and keep_q:
                q_full = torch.zeros(num_reqs, k_max, probs.shape[-1], dtype=torch.float32,
                                     device=device)
            tokens[live, depth] = y.to("cpu")
            lengths[live] = depth + 1
            if q_full is not None:
                q_full[live.to(device), depth] = probs
            if depth + 1 >= k_max:
                break
            # Go on (feed Y_{depth+1}) or stop with depth + 1 tokens, per request.
            dev_live = live.to(device)
            y_prob = probs.gather(1, y.view(-1, 1)).squeeze(1)
            new_state, keep = rule.step(
                state[dev_live], depth, next_token_probs=y_prob, next_probs=probs,
                hidden=hidden if rule.needs_hidden else None,
            )
            state[dev_live] = new_state.to(state.dtype)
            live = live[keep.to("cpu")]
            if live.numel() == 0:
                break
            depth += 1
            # Feed Y_depth to the requests still drafting (their KV for Y_1..Y_{depth-1}
            # was written by the earlier passes of this round): the batch shrinks.
            start = torch.full((live.numel(),), depth - 1, dtype=torch.int64)
            hidden = passes.run(live, tokens[live, :depth], start)
            n_passes += 1
            n_rows += live.numel()

        self.stats.record(lengths.tolist(), k_max, first_tokens, n_passes, n_rows)
        if q_full is not None:
            # The runner slices [row, :num_draft] per request: rows past a request's
            # length are never read.
            self._last_draft_probs = q_full
        return [tokens[r, : int(lengths[r])].tolist() for r in range(num_reqs)]
