"""Scheduling the beam tails of MTAD drafting into draft forward passes.

Pure PyTorch on small integer tensors (no vLLM import); the in-vLLM drafter
(``vllm_specx.glue.mtad_proposer``) runs the passes these functions plan.

The problem: at depth ``j`` every request has ``B`` beams, each a ``j``-token tail that must
sit in the request's lookahead KV slots (positions ``P+1 .. P+j``) when the draft computes
that beam's next-token logits. The beams of one request share those slots, so they are
visited one after another, and the KV of a slot stays valid for the next beam when the
tokens up to it agree (attention is causal). Hence three small computations:

* :func:`lexicographic_order`: visit each request's beams in lexicographic order of their
  tails, so beams sharing a prefix follow each other;
* :func:`held_prefix_len` / :func:`tail_feed_start`: how much of a tail the slots already
  hold, i.e. where feeding can start (the last tail token is always fed: its output is the
  logits the search needs);
* :func:`split_rows_by_token_budget`: group the requests of one pass into passes that fit
  the drafter's token buffers.
"""

from __future__ import annotations

import torch


def lexicographic_order(tails: torch.Tensor) -> torch.Tensor:
    """[R, B] permutation sorting each row's beams by their token tails ``tails`` [R, B, j],
    so that beams sharing a prefix are adjacent.

    A stable radix sort from the last column: equal tails keep their beam order.
    """
    rows, beams, depth = tails.shape
    order = torch.arange(beams, device=tails.device).expand(rows, beams).contiguous()
    for col in reversed(range(depth)):
        keys = tails[:, :, col].gather(1, order)
        perm = torch.sort(keys, dim=1, stable=True).indices
        order = order.gather(1, perm)
    return order


def held_prefix_len(
    held: torch.Tensor, held_len: torch.Tensor, tails: torch.Tensor
) -> torch.Tensor:
    """[R] int64: how many leading tokens of each tail the lookahead slots already hold.

    ``held`` [R, >= j]: the tokens last written to each request's lookahead slots, valid
    for the first ``held_len[r]`` of them; ``tails`` [R, j]: the tails to be held next.
    The answer is the length of the common prefix of ``tails[r]`` and
    ``held[r, :held_len[r]]``: the slot KV past the first disagreement was computed from
    other tokens and must be recomputed (causality).
    """
    rows, j = tails.shape
    cols = torch.arange(j, device=tails.device)
    agree = (held[:, :j] == tails) & (cols < held_len.unsqueeze(1))
    return agree.to(torch.int64).cumprod(dim=1).sum(dim=1)


def tail_feed_start(
    held: torch.Tensor, held_len: torch.Tensor, tails: torch.Tensor, reuse: bool = True
) -> torch.Tensor:
    """[R] int64: the first tail index to feed the draft for each request.

    With ``reuse`` the tokens already held are skipped, except the last tail token, which
    is always fed (its output is the next-token logits); without it every tail is fed from
    its start (what recomputing the tail costs, for measurement).
    """
    rows, j = tails.shape
    if not reuse:
        return torch.zeros(rows, dtype=torch.int64, device=tails.device)
    return torch.clamp(held_prefix_len(held, held_len, tails), max=j - 1)


def split_rows_by_token_budget(q_lens: torch.Tensor, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[lo, hi)`` covering ``q_lens`` ([R] tokens per row), each
    as long as possible with at most ``max_tokens`` tokens in all.

    A row that alone exceeds the budget gets a pass of its own (the caller's buffers must
    hold one row; vLLM's drafter buffers hold a request's whole verified step). No rows,
    no passes.
    """
    lens = [int(n) for n in q_lens.tolist()]
    ranges: list[tuple[int, int]] = []
    lo = 0
    while lo < len(lens):
        hi, total = lo, 0
        while hi < len(lens) and (hi == lo or total + lens[hi] <= max_tokens):
            total += lens[hi]
            hi += 1
        ranges.append((lo, hi))
        lo = hi
    return ranges


# --------------------------------------------------------------------------------------
# Batched drafting: every beam in its own KV slot
# --------------------------------------------------------------------------------------


def beam_tail_span_blocks(k: int, block_size: int) -> int:
    """Most KV blocks one beam's tail can touch: its ``K - 1`` tokens sit at the
    consecutive positions ``P+1 .. P+K-1``, which start anywhere inside a block."""
    tail = k - 1
    if tail <= 0:
        return 0
    return -(-(tail - 1) // block_size) + 1


def assign_beam_slots(parents: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
    """[R, B] int64: the KV slot (0..B-1) each new beam's tail goes to.

    ``parents`` [R, B]: the beam of the previous step each new beam extends;
    ``parent_slots`` [R, Bp]: the slot each of those beams occupied. A new beam takes its
    parent's slot when no earlier beam of its row took it (that slot already holds its
    whole tail but the newest token); every other beam takes the lowest slot left free.
    So one child per parent extends in place, and siblings re-feed their tails elsewhere.
    Host-side loop over small [R, B] tensors (R requests x B beams per drafting step).
    """
    rows, beams = parents.shape
    out = torch.empty(rows, beams, dtype=torch.int64)
    par = parents.tolist()
    pslot = parent_slots.tolist()
    for r in range(rows):
        taken = [False] * beams
        slot_of: list[int | None] = [None] * beams
        for b in range(beams):
            s = pslot[r][par[r][b]]
            if s < beams and not taken[s]:
                taken[s] = True
                slot_of[b] = s
        free = (s for s in range(beams) if not taken[s])
        for b in range(beams):
            out[r, b] = slot_of[b] if slot_of[b] is not None else next(free)
    return out
