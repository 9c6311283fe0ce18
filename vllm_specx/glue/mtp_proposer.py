"""``specx_mtp``'s drafter: the target's own MTP layer, with an optional adaptive stop.

The round and its hooks are :class:`~.eagle_chain_proposer.EagleChainProposer`'s (shared
with the EAGLE heads; see that module for the MTP layer's first pass, lookahead passes,
argmax drafts and the adaptive stop). An MTP layer's pass returns its pre-norm output (read
by the LM head) and its post-norm hidden state (fed to the next pass, read by the
acceptance head).
"""

from __future__ import annotations

from vllm_specx.glue.eagle_chain_proposer import EagleChainProposer


class MtpProposer(EagleChainProposer):
    """``specx_mtp``'s drafter: :class:`EagleChainProposer` over vLLM's ``mtp`` draft
    (its own name, so logs and ``vllm-specx bench`` say which draft ran)."""
