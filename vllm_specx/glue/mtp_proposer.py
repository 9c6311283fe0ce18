"""``specx_mtp``'s drafter: the target's own MTP layer, with an optional adaptive stop or a
draft tree.

The round and its hooks are :class:`~.eagle_chain_proposer.EagleChainProposer`'s (shared
with the EAGLE heads; see that module for the MTP layer's first pass, lookahead passes,
argmax drafts and the adaptive stop). An MTP layer's pass returns its pre-norm output (read
by the LM head) and its post-norm hidden state (fed to the next pass, read by the
acceptance head).

**Trees** (``draft_tree``) are the EAGLE heads' round, :class:`~.eagle_tree_proposer.
EagleTreeRound`, unchanged: an MTP layer takes what an EAGLE head takes (the previous
token's embedding and a hidden state: the target's at the first pass, its own output's
after), so a tree node is fed its token and its parent's output. Depth ``d > 1`` reuses the
one MTP layer, as vLLM 0.32's ``EagleProposer`` does for ``K > 1`` drafts: it calls the
model without ``spec_step_idx``, so every pass runs ``mtp.layers[0]`` whatever
``num_nextn_predict_layers`` says (the MTP fixture has one).

What differs is the target: its tree pass needs the ancestor-only mask of vllm-specx's
CPU attention, and an MLA target (DeepSeek-V2/V3) attends through vLLM's ``CPU_MLA``
backend, which takes no mask (its multi-token verification is vLLM's causal prefill SDPA).
:func:`require_tree_target` refuses that before start in one line; the same checkpoint
runs trees as plain attention (``VLLM_MLA_DISABLE=1``: DeepSeek attention without the
latent cache, vLLM's ``CPU_ATTN`` backend, which vllm-specx's CPU attention serves).
"""

from __future__ import annotations

from typing import Any

from vllm_specx.glue.eagle_chain_proposer import EagleChainProposer


class MtpProposer(EagleChainProposer):
    """``specx_mtp``'s drafter: :class:`EagleChainProposer` over vLLM's ``mtp`` draft
    (its own name, so logs and ``vllm-specx bench`` say which draft ran)."""


def require_tree_target(target_model_config: Any, settings: dict[str, Any] | None = None,
                        draft_model: str | None = None) -> None:
    """``specx_mtp`` with ``draft_tree``: refuse, in one line before start, a target whose
    attention cannot verify a tree (MLA) and a node budget vLLM's MTP config refuses
    (with several MTP layers vLLM wants ``num_speculative_tokens`` divisible by their
    number). No-op without a tree."""
    from vllm_specx.config import refusal_error
    from vllm_specx.methods import tree_max_nodes

    settings = settings or {}
    budget = tree_max_nodes(settings)
    if budget is None:
        return
    tree = settings.get("draft_tree")
    shown = tree if isinstance(tree, bool) else dict(tree)
    if getattr(target_model_config, "use_mla", False):
        raise refusal_error(
            "draft_tree", shown,
            f"the target '{target_model_config.model}' uses MLA attention (vLLM's CPU_MLA "
            "backend), which takes no tree mask; run it as plain attention with "
            "VLLM_MLA_DISABLE=1, or drop draft_tree to verify a chain", "specx_mtp")
    layers = getattr(target_model_config.hf_config, "num_nextn_predict_layers", None) or 1
    if layers > 1 and budget > layers and budget % layers:
        raise refusal_error(
            "draft_tree", shown,
            f"the tree's node budget {budget} (vLLM's num_speculative_tokens) must be "
            f"divisible by the target's {layers} MTP layers (vLLM's rule for MTP drafts); "
            f"size the tree so that it is a multiple of {layers}", "specx_mtp")
