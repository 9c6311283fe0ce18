"""Drawing one draft token per request in chain drafting (the adaptive and MTP drafters).

Pure PyTorch, no vLLM import: the glue passes the rows of vLLM's sampling metadata it
needs (temperature, top-k, top-p, the seeded requests' generators).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from vllm_specx.algorithms.beam_draft import gumbel_noise, warp_logprobs


def draw_draft_tokens(
    logits: torch.Tensor,
    rows: torch.Tensor,
    greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator],
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    *,
    need_probs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw one draft token for each of ``rows`` (indices into the batch).

    ``logits``: ``[len(rows), V]``, one row per drawn request. ``greedy`` (``[batch]``
    bool), ``temperature``/``top_k``/``top_p`` (``[batch]`` or None) and ``generators``
    (batch row -> ``torch.Generator``, vLLM's convention for seeded requests) are indexed
    by batch row. ``temperature is None`` means every request is greedy (vLLM drops it
    then).

    Returns (tokens ``[n]``, probabilities ``[n, V]``): greedy rows take the argmax of the
    raw logits (as vLLM's drafter does) and report the unwarped softmax; sampled rows draw
    from the warped distribution (Gumbel-max, a seeded row from its own generator only)
    and report it. ``need_probs=False`` (the caller reads no probabilities: a fixed-length
    round of argmax drafts) returns None for them when every request is greedy, saving
    the ``[n, V]`` softmax; the tokens are the same.
    """
    if temperature is None:  # every request greedy
        tokens = logits.argmax(dim=-1)
        return tokens, logits.float().softmax(dim=-1) if need_probs else None
    dev_rows = rows.to(logits.device)

    def sel(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[dev_rows]

    logq = warp_logprobs(logits, sel(temperature), sel(top_k), sel(top_p))
    row_greedy = greedy[dev_rows]
    local_generators = {
        i: generators[int(r)] for i, r in enumerate(rows.tolist()) if int(r) in generators
    }
    noise = gumbel_noise(logq.shape[0], logq.shape[1], logq.device, local_generators,
                         rows=~row_greedy)
    sampled = (logq + noise).argmax(dim=-1)
    tokens = torch.where(row_greedy, logits.argmax(dim=-1), sampled)
    return tokens, logq.exp()
