"""Adaptive-length drafting inside vLLM (SpecDec++ stop rule, EMS-SD unpadded batches).

``AdaptiveProposer`` is vLLM's ``DraftModelProposer`` (V1 model runner, checked on vLLM
0.32) running the chain-draft round of :class:`~.chain_drafter.ChainDrafter`: up to
``K_max`` tokens per request, every request deciding on its own after each draft step
whether to go on (the stop rules are pure functions in ``vllm_specx.algorithms.draft_stop``),
over a batch that shrinks as requests stop. It takes the round's default hooks: the draft's
final hidden state (after its final norm) feeds both its LM head and the acceptance head,
and only the token is fed to the next pass.

Drafts: greedy requests draft the draft's argmax. Sampled requests draw from the draft's
warped distribution ``q`` (temperature, top-k, top-p in vLLM's order) and leave the full
``q`` rows for ``take_last_draft_probs()``, so the specx sampler runs standard rejection
sampling against ``q`` (lossless for any ``q``). With ``draft_sampling: "greedy"`` sampled
requests draft the argmax too and are verified with the one-hot rule. Seeded requests draw
from their own ``torch.Generator``.

The drafts are ragged (one list per request), so the method's spec turns vLLM's async
scheduling off, and refuses an explicit ``async_scheduling: true``.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_specx.glue.chain_drafter import ChainDrafter
from vllm_specx.glue.draft_passes import SpecxDraftModelProposer
from vllm_specx.glue.proposer_contract import refuse_unsupported_options


class AdaptiveProposer(ChainDrafter, SpecxDraftModelProposer):
    """Chain drafting with a per-request stop and a shrinking batch. See the module doc."""

    # A draft model's first pass reads only token ids: a step where cost control plans
    # no drafts skips it, and the next first pass catches the draft KV up.
    skips_idle_first_pass = True

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config, device, runner)
        refuse_unsupported_options(
            self, vllm_config, "adaptive drafting",
            ["drafts with another tokenizer"] if self.use_heterogeneous_vocab else [],
        )
