"""``specx_mtp``: drafting with the target's own MTP layer, with an optional adaptive stop.

``MtpProposer`` is vLLM's ``EagleProposer`` (the proposer vLLM 0.32's V1 runner builds for
``mtp``; checked on vLLM 0.32) running the chain-draft round of
:class:`~.chain_drafter.ChainDrafter` with the MTP layer as the draft:

* the **first pass** is vLLM's: the MTP layer over the verified tokens (each row sees the
  target's final hidden state at position ``i`` and the token at ``i + 1``), which keeps
  the MTP layer's KV cache in sync and gives every request's first draft ``Y_1``;
* **lookahead passes** feed ``Y_j`` together with the MTP layer's own post-norm hidden state
  of the step before (vLLM's recursion: ``K > 1`` reuses the one MTP layer), over the
  requests STILL DRAFTING only (the same positions and KV slots as vLLM's chain).

Its hooks: a pass returns the MTP layer's pre-norm output (read by the LM head) and its
post-norm hidden state (fed to the next pass, read by the acceptance head); every request
drafts the argmax; the stop rule is fixed K unless ``adaptive``.

Drafts are the MTP layer's argmax for every request (the vLLM-Ascend MTP developer guide's
and vLLM's MTP drafting), so ``q`` is one-hot: no draft probabilities reach the sampler and
the specx sampler's ``standard`` rule accepts ``Y_j`` with probability ``p_j(Y_j)`` and, at
a rejection, resamples from ``p_j`` with ``Y_j`` removed and renormalised; greedy requests
are verified greedily (output equal to no speculation).

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
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_specx.algorithms.draft_stop import AlwaysContinue, DraftStopRule
from vllm_specx.glue.chain_drafter import ChainDrafter
from vllm_specx.glue.proposer_contract import refuse_unsupported_options


class MtpProposer(ChainDrafter, EagleProposer):
    """MTP chain drafting with a per-request stop and a shrinking batch (see module doc)."""

    # The next pass reads the MTP layer's post-norm hidden state of the step before.
    feeds_hidden = True

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        refuse_unsupported_options(
            self, vllm_config, "specx_mtp",
            [f"vLLM method {self.method!r} (specx_mtp drafts with 'mtp')"]
            if self.method != "mtp" else [],
        )

    # -- hooks --------------------------------------------------------------------------

    def stop_rule(self, k_max: int) -> DraftStopRule:
        """Fixed K without ``adaptive``; else the adaptive rule of the round."""
        if not self.settings.get("adaptive"):
            return AlwaysContinue(k_max)
        return super().stop_rule(k_max)

    def drafts_argmax(self) -> bool:
        # Every request drafts the MTP argmax (one-hot q); the probabilities the draw
        # returns (warped for sampled requests) feed the confidence rule only.
        return True

    def read_pass(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``out`` is ``[pre-norm | post-norm]`` (see :meth:`run_model`): the LM head
        reads the first half, the next step and the acceptance head the second."""
        width = out.shape[-1] // 2
        return out[:, :width], out[:, width:]

    def feed_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden_states[: hidden.shape[0]] = hidden

    def run_model(self, model_kwargs: dict[str, Any], num_input_tokens: int) -> torch.Tensor:
        """One MTP forward. The lookahead passes build draft-model inputs; the MTP layer
        also reads the hidden-state buffer (:meth:`feed_hidden` fills it before each
        pass). Returns ``[pre-norm | post-norm]`` concatenated on the last dim, so the
        shared passes can slice rows of both at once."""
        model_kwargs.setdefault("hidden_states", self.hidden_states[:num_input_tokens])
        out = super().run_model(model_kwargs, num_input_tokens)
        pre, post = out if self.model_returns_tuple() else (out, out)
        return torch.cat([pre, post], dim=-1)
