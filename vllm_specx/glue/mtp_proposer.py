"""``specx_mtp``: drafting with the target's own MTP layer, with an optional adaptive stop.

``MtpProposer`` is vLLM's ``EagleProposer`` (the proposer vLLM 0.32's V1 runner builds for
``mtp``; checked on vLLM 0.32), drafting the way the adaptive drafter does
(``glue/adaptive_proposer.py``) but with the MTP layer as the draft:

* the **first pass** is the base class's: the MTP layer over the verified tokens (each row
  sees the target's final hidden state at position ``i`` and the token at ``i + 1``), which
  keeps the MTP layer's KV cache in sync and gives every request's first draft ``Y_1``;
* **lookahead passes** feed ``Y_j`` together with the MTP layer's own post-norm hidden state
  of the step before (vLLM's recursion: ``K > 1`` reuses the one MTP layer), over the
  requests STILL DRAFTING only, through the shared :class:`~.draft_passes.LookaheadPasses`
  (the same positions and KV slots as vLLM's chain).

Drafts are the MTP layer's argmax for every request (the seed's and vLLM's MTP drafting),
so ``q`` is one-hot: no draft probabilities reach the sampler and the specx sampler's
``standard`` rule accepts ``Y_j`` with probability ``p_j(Y_j)`` and, at a rejection,
resamples from ``p_j`` with ``Y_j`` removed and renormalised; greedy requests are verified
greedily (output equal to no speculation).

With ``adaptive: true`` each request stops on its own (``algorithms/draft_stop.py``): the
training-free rule on the MTP layer's own (warped) probability of its token, or SpecDec++'s
head on the MTP layer's post-norm hidden state (the tensor its LM head reads) when an
``acceptance_head`` is given. The proposer returns one list per request of the length it
drafted, so the scheduler receives exactly those tokens (no padding; synchronous scheduling,
as for ``adaptive``). Without ``adaptive`` every request drafts ``K``.

vLLM private names relied on (beyond those of ``draft_passes.py``): the proposer's
``hidden_states`` input buffer and ``model_returns_tuple``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_specx.algorithms.beam_draft import greedy_mask_from_temperature
from vllm_specx.algorithms.draft_sampling import draw_draft_tokens
from vllm_specx.algorithms.draft_stop import AlwaysContinue, DraftStopRule
from vllm_specx.glue.adaptive_proposer import AdaptiveDraftStats
from vllm_specx.glue.draft_passes import (
    LookaheadPasses,
    SpecxDraftModelProposer,
    load_acceptance_head,
    round_stop_rule,
)


class MtpProposer(EagleProposer):
    """MTP chain drafting with a per-request stop and a shrinking batch (see module doc)."""

    settings: dict[str, Any]

    # The shared first pass (the base class's, spelled out); it only uses attributes
    # every vLLM proposer has, so it serves the EAGLE-style proposer as it is.
    _first_pass = SpecxDraftModelProposer._first_pass

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        reasons = []
        if self.method != "mtp":
            reasons.append(f"vLLM method {self.method!r} (specx_mtp drafts with 'mtp')")
        if self.parallel_drafting:
            reasons.append("parallel drafting drafts all positions in one pass")
        if vllm_config.parallel_config.data_parallel_size > 1:
            reasons.append("data parallelism: ranks would have to agree on each pass's batch")
        if self.uses_mrope:
            reasons.append("M-RoPE models")
        if reasons:
            raise NotImplementedError(
                "vllm-specx specx_mtp does not support: " + "; ".join(reasons)
            )
        self.stats = AdaptiveDraftStats()
        self.head: Any = None

    # -- set-up -----------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        dtype = next(self.model.parameters()).dtype
        self.head = load_acceptance_head(self.settings, self.device, dtype)

    def stop_rule(self, k_max: int) -> DraftStopRule:
        """Fixed K without ``adaptive``; else the adaptive rule of the round."""
        if not self.settings.get("adaptive"):
            return AlwaysContinue(k_max)
        return round_stop_rule(self.settings, k_max, self.head)

    def specx_stats(self) -> dict[str, Any]:
        return self.stats.as_dict()

    # -- passes -------------------------------------------------------------------------

    def _draft_forward(
        self,
        per_layer_attn_metadata: Any,
        num_tokens: int,
        padding: tuple[Any, int, Any],
        slot_mapping: Any,
        model_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """One MTP forward. The lookahead passes build draft-model inputs; the MTP layer
        also reads the hidden-state buffer, which :meth:`propose` fills before each pass.
        Returns ``[pre-norm | post-norm]`` concatenated on the last dim, so the shared
        passes can slice rows of both at once (logits read the first half, the next step
        and the acceptance head the second)."""
        model_kwargs.setdefault("hidden_states", self.hidden_states[: padding[1]])
        out = SpecxDraftModelProposer._draft_forward(
            self, per_layer_attn_metadata, num_tokens, padding, slot_mapping, model_kwargs
        )
        pre, post = out if self.model_returns_tuple() else (out, out)
        return torch.cat([pre, post], dim=-1)

    # -- propose ------------------------------------------------------------------------

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
        self._last_draft_probs = None  # one-hot q: the sampler's one-hot rule applies
        num_reqs = common_attn_metadata.batch_size()

        both, sample_positions, cad, first_tokens = self._first_pass(
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
            return torch.empty(num_reqs, 0, device=both.device, dtype=torch.int64)

        device = both.device
        width = both.shape[-1] // 2
        pre, post = both[:, :width], both[:, width:]
        # Every request drafts the MTP argmax (one-hot q); the probabilities
        # draw_draft_tokens returns (warped for sampled requests) feed the confidence
        # rule only.
        greedy = greedy_mask_from_temperature(sampling_metadata.temperature, num_reqs, device)
        draw_greedy = torch.ones_like(greedy)
        rule = self.stop_rule(k_max)
        state = rule.start(num_reqs, device)
        tokens = torch.zeros(num_reqs, k_max, dtype=torch.int64)  # host: tails come from it
        lengths = torch.zeros(num_reqs, dtype=torch.int64)
        post_by_req = post.clone()  # [R, H]: each request's latest post-norm MTP hidden
        live = torch.arange(num_reqs)

        base_seq_lens = cad.seq_lens
        if num_rejected_tokens_gpu is not None:
            base_seq_lens = base_seq_lens - num_rejected_tokens_gpu
        passes = LookaheadPasses(self, cad, sample_positions, base_seq_lens)
        n_passes = n_rows = 0
        depth = 0
        while True:
            logits = self.model.compute_logits(pre)
            y, probs = draw_draft_tokens(
                logits, live, draw_greedy, {}, sampling_metadata.temperature,
                sampling_metadata.top_k, sampling_metadata.top_p,
            )
            tokens[live, depth] = y.to("cpu")
            lengths[live] = depth + 1
            if depth + 1 >= k_max:
                break
            dev_live = live.to(device)
            y_prob = probs.gather(1, y.view(-1, 1)).squeeze(1)
            new_state, keep = rule.step(
                state[dev_live], depth, next_token_probs=y_prob, next_probs=probs,
                hidden=post if rule.needs_hidden else None,
            )
            state[dev_live] = new_state.to(state.dtype)
            live = live[keep.to("cpu")]
            if live.numel() == 0:
                break
            depth += 1
            # Feed Y_depth with the hidden state of the step that drew it, to the requests
            # still drafting only (the batch shrinks).
            self.hidden_states[: live.numel()] = post_by_req[live.to(device)]
            start = torch.full((live.numel(),), depth - 1, dtype=torch.int64)
            both = passes.run(live, tokens[live, :depth], start)
            pre, post = both[:, :width], both[:, width:]
            post_by_req[live.to(device)] = post
            n_passes += 1
            n_rows += live.numel()

        self.stats.record(lengths.tolist(), k_max, first_tokens, n_passes, n_rows)
        return [tokens[r, : int(lengths[r])].tolist() for r in range(num_reqs)]
