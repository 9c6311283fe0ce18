"""Hugging Face transformers as the reference for vLLM outputs in tests."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GreedyReference:
    token_ids: list[int]
    # log-probability of each chosen token under the full-vocabulary softmax
    logprobs: list[float]
    # top-1 minus top-2 logit at each step (how well-conditioned the argmax is)
    margins: list[float]


def hf_greedy(
    model_dir: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int
) -> list[GreedyReference]:
    """Greedy continuations of tokenised ``prompts`` with ``LlamaForCausalLM`` et al.

    Deliberately plain: every step re-runs the whole sequence in float32 (no KV
    cache), so the reference shares no caching logic with what it checks. Never stops
    at EOS (compare with ``ignore_eos=True``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens, logprobs, margins = [], [], []
            for _ in range(max_new_tokens):
                logits = model(ids).logits[0, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                top2 = torch.topk(logits, 2).values
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append(float(logp[token]))
                margins.append(float(top2[0] - top2[1]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            results.append(GreedyReference(tokens, logprobs, margins))
    return results
