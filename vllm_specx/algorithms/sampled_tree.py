"""A draft tree whose children are i.i.d. draws from the drafter: the proposal the
``"sampled"`` tree rule (SpecInfer's multi-step speculative sampling,
:func:`vllm_specx.algorithms.draft_tree.verify_tree`) is lossless for.

Pure PyTorch, no vLLM import: the engine's draft-model tree drafter
(``glue/mtad_proposer.DraftTreeProposer``) runs it with the draft model as the callback.

The shape ("a spine of bushes"): depth 1 is ``branching`` i.i.d. draws from the drafter's
warped distribution after the root; at every further depth the most probable node of the
previous depth (the highest draft probability of its own sampled token, the first draw on
ties) gets ``branching`` i.i.d. draws of its own, until ``max_depth`` or the node budget
``max_nodes`` runs out (the last depth then gets what is left). Why this shape:

* The rule needs every child of a node to be an i.i.d. draw from that node's ``q`` row,
  all of them kept, in draw order; a child may not be dropped or merged because of its
  value (docs/trees.md). What may depend on values is only which nodes get children at
  all, and how many, decided before those children are drawn: the choice of the expanded
  node reads only the drafter's own draws.
* All nodes of a depth are siblings, so a request needs ONE ``q`` row per depth (what the
  sampler's residual reads) and the drafter ONE row per request per depth: the same draft
  passes as a chain of ``max_depth`` tokens.
* The budget is the same as the top-k tree's (``min(max_nodes, branching * max_depth)``,
  ``branching`` nodes per depth), so the scheduler's node budget is unchanged.

Greedy rows get the drafter's top-``branching`` tokens instead (distinct, best first),
the top one expanded: a greedy request's walk only follows the target's argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


def depth_sizes(max_nodes: int, max_depth: int, branching: int) -> list[int]:
    """Nodes per depth: ``branching`` each, the last depth what the budget leaves."""
    if min(max_nodes, max_depth, branching) < 1:
        raise ValueError(f"max_nodes, max_depth and branching must be >= 1, got "
                         f"{max_nodes}, {max_depth}, {branching}")
    sizes: list[int] = []
    left = max_nodes
    while left > 0 and len(sizes) < max_depth:
        sizes.append(min(branching, left))
        left -= sizes[-1]
    return sizes


def draw_children(logprobs: torch.Tensor, n: int, greedy: torch.Tensor,
                  generators: Mapping[int, torch.Generator] | None = None) -> torch.Tensor:
    """``n`` children per row, ``[R, n]`` int64: i.i.d. draws from ``exp(logprobs)``
    (with replacement, in draw order) for sampled rows, the top ``n`` tokens (distinct,
    best first) for greedy rows. Seeded rows (``generators``: row -> generator) draw
    from their own generator only."""
    rows, vocab = logprobs.shape
    lp = logprobs.to(torch.float32)
    out = lp.topk(min(n, vocab), dim=1).indices
    if out.shape[1] < n:  # fewer tokens than children: repeat the best one
        out = torch.cat([out, out[:, :1].expand(rows, n - out.shape[1])], dim=1)
    sampled = ~greedy.to(device=lp.device, dtype=torch.bool)
    if bool(sampled.any()):
        probs = lp.exp()
        # A row with no mass (cannot come from a warp) draws its best token.
        probs = torch.where(probs.sum(1, keepdim=True) > 0, probs, torch.ones_like(probs))
        draws = torch.multinomial(probs, n, replacement=True)
        for row, gen in (generators or {}).items():
            if row < rows and bool(sampled[row]):
                draws[row] = torch.multinomial(probs[row], n, replacement=True, generator=gen)
        out = torch.where(sampled[:, None], draws, out)
    return out


@dataclass(frozen=True)
class SampledTree:
    """Trees of ``R`` requests, all of one shape ``[N]`` nodes in BFS order.

    ``tokens`` [R, N]; ``parents`` [R, N] (local index, -1: a child of the root);
    ``depth_of_node`` [N] (0-based); ``q`` [R, D, V]: the warped draft distribution each
    depth's nodes were drawn from (node i's row is ``q[:, depth_of_node[i]]``);
    ``spine`` [R, D]: the node expanded at each depth (-1 at the last)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth_of_node: torch.Tensor
    q: torch.Tensor
    spine: torch.Tensor

    def node_q(self) -> torch.Tensor:
        """``[R, N, V]``: each node's q row (siblings share their parent's)."""
        return self.q.index_select(1, self.depth_of_node.to(self.q.device))


def sampled_spine_tree(
    first_logprobs: torch.Tensor,
    next_logprobs: Callable[[torch.Tensor], torch.Tensor],
    *,
    max_nodes: int,
    max_depth: int,
    branching: int,
    greedy: torch.Tensor,
    generators: Mapping[int, torch.Generator] | None = None,
) -> SampledTree:
    """Draft the trees (shape: module docstring).

    ``first_logprobs`` [R, V]: the drafter's warped log-probabilities after the root.
    ``next_logprobs(spine_tokens)``: given each row's expanded path so far ([R, d] tokens,
    d >= 1), the warped log-probabilities after it, [R, V]: one drafter pass per depth.
    """
    sizes = depth_sizes(max_nodes, max_depth, branching)
    rows = first_logprobs.shape[0]
    dev = first_logprobs.device
    lp = first_logprobs.to(torch.float32)
    tokens, parents, depth_of_node, q_rows, spine = [], [], [], [], []
    path: list[torch.Tensor] = []
    parent = torch.full((rows,), -1, dtype=torch.int64, device=dev)
    offset = 0
    for d, n in enumerate(sizes):
        children = draw_children(lp, n, greedy, generators)  # [R, n]
        tokens.append(children)
        parents.append(parent[:, None].expand(rows, n))
        depth_of_node += [d] * n
        q_rows.append(lp.exp())
        if d + 1 == len(sizes):
            spine.append(torch.full((rows,), -1, dtype=torch.int64, device=dev))
            break
        # The expanded child: the likeliest draw under q (torch.argmax: the first on ties).
        best = lp.gather(1, children).argmax(dim=1)
        spine.append(offset + best)
        parent = offset + best
        path.append(children.gather(1, best[:, None]))
        offset += n
        lp = next_logprobs(torch.cat(path, dim=1)).to(torch.float32)
    return SampledTree(
        tokens=torch.cat(tokens, dim=1),
        parents=torch.cat(parents, dim=1),
        depth_of_node=torch.tensor(depth_of_node, dtype=torch.int64),
        q=torch.stack(q_rows, dim=1),
        spine=torch.stack(spine, dim=1),
    )
