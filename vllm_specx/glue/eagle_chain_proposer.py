"""Chain drafting over vLLM's ``EagleProposer``: the target's MTP layers (``specx_mtp``) and
EAGLE / EAGLE-3 heads (``specx_eagle``, ``specx_eagle3``), with an optional adaptive stop.

:class:`EagleChainProposer` is vLLM's ``EagleProposer`` (the proposer vLLM 0.32's V1 runner
builds for ``mtp``, ``eagle`` and ``eagle3``; checked on vLLM 0.32) running the chain-draft
round of :class:`~.chain_drafter.ChainDrafter`. The three drafts differ only in what vLLM
already handles: their model class and, for EAGLE-3, the ``fc`` over the target's auxiliary
hidden states (``combine_hidden_states``, applied before the first pass as vLLM does):

* the **first pass** is vLLM's: the draft over the verified tokens (each row sees the
  target's hidden state at position ``i`` -- the final one for MTP and EAGLE, the
  ``fc``-combined auxiliary layers for EAGLE-3 -- and the token at ``i + 1``), which keeps
  the draft's KV cache in sync and gives every request's first draft ``Y_1``;
* **lookahead passes** feed ``Y_j`` together with the draft's own hidden state of the step
  before (vLLM's recursion: ``K > 1`` reuses the one layer), over the requests STILL
  DRAFTING only (the same positions and KV slots as vLLM's chain).

Its hooks: a pass returns the output the LM head reads (MTP: pre-norm; EAGLE-3: post-norm)
and the hidden state vLLM feeds to the next pass (MTP: post-norm; EAGLE-3: pre-norm; EAGLE
returns one tensor for both), which the acceptance head also reads; every request drafts the
argmax; the stop rule is fixed K unless ``adaptive``.

Drafts are the argmax for every request (vLLM's own MTP and EAGLE drafting), so ``q`` is
one-hot: no draft probabilities reach the sampler and the specx sampler's ``standard`` rule
accepts ``Y_j`` with probability ``p_j(Y_j)`` and, at a rejection, resamples from ``p_j``
with ``Y_j`` removed and renormalised; greedy requests are verified greedily (output equal
to no speculation). An EAGLE-3 head's reduced draft vocabulary reaches the stop rule as
vLLM's ``compute_logits`` returns it: full-vocabulary logits, ``-inf`` outside the draft
vocabulary.

With ``adaptive: true`` each request stops on its own (``algorithms/draft_stop.py``): the
training-free rule on the draft's own (warped) probability of its token, or SpecDec++'s
head on the hidden state above when an ``acceptance_head`` is given. The proposer returns
one list per request of the length it drafted, so the scheduler receives exactly those
tokens (no padding; synchronous scheduling, as for ``adaptive``). Without ``adaptive``
every request drafts ``K``.

vLLM private names relied on (beyond those of ``draft_passes.py``): the proposer's
``hidden_states`` input buffer and ``model_returns_tuple``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_specx.algorithms.draft_stop import AlwaysContinue, DraftStopRule
from vllm_specx.config import specx_settings
from vllm_specx.glue.chain_drafter import ChainDrafter, ChainRound
from vllm_specx.glue.cost_model import CostControl
from vllm_specx.glue.draft_passes import DraftKVHoles
from vllm_specx.glue.eagle_tree_proposer import EagleTreeRound
from vllm_specx.glue.head_kv_holes import HeadKVHoles
from vllm_specx.glue.proposer_contract import refuse_unsupported_options
from vllm_specx.methods import METHODS


class EagleRoundHooks(ChainRound):
    """The chain round's hooks for MTP layers and EAGLE heads (see the module doc), over
    any runner: :class:`EagleChainProposer` on V1 and the Model Runner V2 speculators of
    ``glue/v2_eagle.py``. Needs ``hidden_states`` (the buffer the next pass reads)."""

    # The next pass reads the draft's hidden state of the step before.
    feeds_hidden = True
    hidden_states: torch.Tensor
    method: str  # vLLM's draft method: "eagle3" combines auxiliary layers with its fc

    def stop_rule(self, k_max: int) -> DraftStopRule:
        """Fixed K without ``adaptive``; else the adaptive rule of the round."""
        if not self.settings.get("adaptive"):
            return AlwaysContinue(k_max)
        return super().stop_rule(k_max)

    def cost_control(self, k_max: int) -> CostControl | None:
        """Only over the adaptive stop: without ``adaptive`` every request drafts K."""
        if not self.settings.get("adaptive"):
            return None
        return super().cost_control(k_max)

    def drafts_argmax(self) -> bool:
        # Every request drafts the argmax (one-hot q); the probabilities the draw returns
        # (warped for sampled requests) feed the confidence rule only.
        return True

    def read_pass(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``out`` is ``[LM-head input | fed-back hidden state]`` (see :meth:`run_model`):
        the LM head reads the first half, the next step and the acceptance head the
        second."""
        width = out.shape[-1] // 2
        return out[:, :width], out[:, width:]

    def feed_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden_states[: hidden.shape[0]] = hidden

    def first_pass_hidden(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """An EAGLE-3 head's ``fc`` over the target's auxiliary hidden states (vLLM's
        ``propose`` applies it before its first pass): what a catch-up feeds the kept
        rows through (``HeadKVHoles``), on V1 also the first pass, chain or tree step."""
        if self.method == "eagle3":
            return self.model.combine_hidden_states(target_hidden_states)
        return target_hidden_states


class EagleChainProposer(EagleTreeRound, EagleRoundHooks, ChainDrafter, EagleProposer):
    """Chain drafting with a per-request stop and a shrinking batch over vLLM's
    ``EagleProposer`` (see the module doc); the specx method's ``vllm_method`` says which
    draft (``mtp``, ``eagle`` or ``eagle3``) vLLM built. With ``draft_tree`` (EAGLE
    heads) the round drafts a tree instead (``glue/eagle_tree_proposer.py``).

    A step where cost control plans no drafts for anyone (a chain planned at zero, a tree
    at depth 0) skips the head's first pass: the head keeps that pass's inputs (the
    target's hidden states and the tokens) and feeds them before its next first pass
    (``glue/head_kv_holes.py``)."""

    skips_idle_first_pass = True

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        specx_method = (specx_settings(vllm_config) or {}).get("method", "specx_mtp")
        expected = METHODS[specx_method].vllm_method
        refuse_unsupported_options(
            self, vllm_config, specx_method,
            [f"vLLM method {self.method!r} ({specx_method} drafts with {expected!r})"]
            if self.method != expected else [],
        )

    def kv_holes_class(self) -> type[DraftKVHoles]:
        return HeadKVHoles

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]] | torch.Tensor:
        """vLLM's ``propose``. After a tree step the accepted nodes' rows are first moved
        into the chain layout. An EAGLE-3 head's auxiliary hidden states are combined by
        its ``fc`` only when the first pass runs (:meth:`first_pass_hidden`), so a
        skipped step does not pay it (its kept rows are combined when the catch-up feeds
        them)."""
        if self.tree_state is not None:
            if "target_hidden_states" in kwargs:
                kwargs["target_hidden_states"] = self.path_rows_in_chain_order(
                    kwargs["target_hidden_states"])
            else:  # positional: (K, token ids, positions, hidden states, ...)
                args = (*args[:3], self.path_rows_in_chain_order(args[3]), *args[4:])
        return super().propose(*args, **kwargs)

    def run_model(self, model_kwargs: dict[str, Any], num_input_tokens: int) -> torch.Tensor:
        """One draft forward. The lookahead passes build draft-model inputs; the draft also
        reads the hidden-state buffer (:meth:`feed_hidden` fills it before each pass).
        Returns ``[LM-head input | fed-back hidden state]`` concatenated on the last dim
        (vLLM's ``(last_hidden_states, hidden_states)`` when the model returns a tuple),
        so the shared passes can slice rows of both at once."""
        model_kwargs.setdefault("hidden_states", self.hidden_states[:num_input_tokens])
        out = super().run_model(model_kwargs, num_input_tokens)
        for_lm_head, fed_back = out if self.model_returns_tuple() else (out, out)
        out = torch.cat([for_lm_head, fed_back], dim=-1)
        self.keep_tree_pass_output(out)
        return out
