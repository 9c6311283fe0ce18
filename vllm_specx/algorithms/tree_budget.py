"""Tree budget: how much of each request's drafted tree the target should verify.

Pure NumPy, no vLLM import. Cost control for draft trees (issue 37; docs/cost-control.md,
"Trees"): after the drafter has built every request's tree, keep for each request a
connected subtree containing the root (keeping a node needs its parent) so that the
step's expected tokens per unit of time is maximal::

    rate(K) = (R + sum_{kept nodes n} v(n)) / (paid + target(S(K)))

``R`` requests each emit one token whatever is kept; ``v(n)`` is the probability that
the path from the root to ``n`` is accepted; ``paid`` is the part of the step already
spent (the drafter's passes: they run before the tree exists, so they cannot be won
back, but they still belong to the step's time); ``target(S)`` is the target's forward
over ``R`` requests and ``S`` kept nodes in all (any non-decreasing function: the
measured tree costs are not linear in ``S``). Keeping nothing anywhere (``S = 0``) is a
plain decoding step.

Why the best ``S`` nodes are the ``S`` largest values
------------------------------------------------------
A path's acceptance probability cannot grow along the path, so ``v(child) <= v(parent)``
(:func:`monotone_path_values` enforces it where a calibration broke it). For a fixed total
``S`` the target's cost is fixed, so the best set maximises the kept value: the ``S``
largest values. Sorted by ``(-v, depth)`` a parent always comes before its children, so
every prefix of that order is a union of rooted subtrees: the constraint costs nothing.
Only ``S`` remains, and :func:`prune_trees` tries every ``S`` (``O(N log N)``).

Whole sibling groups (the sampled i.i.d. rule)
----------------------------------------------
The sampled rule of :func:`~vllm_specx.algorithms.draft_tree.verify_tree` is lossless only
for i.i.d. children in draw order; dropping the low-value siblings of a group keeps a
biased subset. A request flagged ``whole_groups`` keeps either all children of a kept node
or none. Then the largest-values argument fails (a group is an indivisible item), and
:func:`prune_trees` solves those requests exactly with a tree knapsack (the best value
with ``s`` nodes, for each ``s``, per request) merged across requests by a max-plus
convolution; still exact, ``O(N^2)`` in the nodes of those requests.

Whole groups are not enough to keep the sampled rule lossless when the values read the
groups' own draws: whether a node's children are verified must not depend on what they
(or their descendants) drew. One child, ``q = p``, kept only when ``q`` of its token
exceeds 0.5, with ``p = (0.7, 0.3)``: the first token comes out with probability
``0.7 + 0.3 * 0.7 = 0.91``. So the engine does not prune sampled trees after drafting: it
chooses their depth before drafting from how often earlier rounds' accepted paths reached
each depth (``glue/tree_cost.TreeCostControl.verified_whole``).

Depth before drafting
---------------------
The drafter's passes are paid before the tree exists, so their number is chosen from
what the last steps' trees were worth: :func:`choose_tree_depth` takes per depth the
expected kept value and kept nodes of a tree drafted that deep, and picks the depth with
the best rate (depth 0: no drafting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_specx.algorithms.draft_length import StepCosts

TargetCost = Callable[[int], float]  # total kept nodes S -> target forward time


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node (1 for a child of the root); ``parents[i] < i`` or ``-1``."""
    parents = np.asarray(parents, dtype=np.int64)
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(
                f"tree_budget: parents[{i}] = {int(p)}; a parent is -1 (the root) or an "
                "earlier node"
            )
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth


def monotone_path_values(parents: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``v(n) <- min(v(n), v(parent))``, clipped to ``[0, 1]``.

    A path's acceptance probability cannot exceed its prefix's; a calibrated estimate can
    (per-node scaling, a head's per-depth rates), and the largest-values argument of the
    module doc needs it not to.
    """
    parents = np.asarray(parents, dtype=np.int64)
    out = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0).copy()
    for i, p in enumerate(parents):  # parents come first, so out[p] is final
        if p >= 0:
            out[i] = min(out[i], out[p])
    return out


def calibrated_path_values(
    parents: np.ndarray, path_draft_probs: np.ndarray, acceptance_scale: float
) -> np.ndarray:
    """``v(n) = min(1, acceptance_scale * q(path to n))``, made monotone.

    ``path_draft_probs``: the drafter's cumulative probability of each node's path.
    ``acceptance_scale``: the request's measured ratio of accepted tokens to the drafter's
    predicted ones (1 for a well-calibrated drafter), as the chain control's history gives.
    """
    q = np.asarray(path_draft_probs, dtype=np.float64)
    return monotone_path_values(parents, np.minimum(1.0, acceptance_scale * q))


def step_costs_target(costs: StepCosts, num_reqs: int) -> TargetCost:
    """The chain control's learnt target cost as a function of the kept tree nodes.

    ``MeasuredCosts`` learns the target in query tokens (``B`` requests' own tokens plus
    ``S`` drafts), which is what a tree's nodes are too, so the same model sizes trees.
    Verifying any node at all adds the target's fixed verification cost
    (``verify_fixed``), which :func:`step_costs_paid` leaves out.
    """
    return lambda s: float(costs.target(num_reqs, int(s))
                           + (costs.verify_fixed if s > 0 else 0.0))


def step_costs_paid(costs: StepCosts, drafted: bool, passes: int, fed_rows: int) -> float:
    """What a tree step has paid before pruning: the first pass (``fixed``), the round's
    first draw (``draft_round``, when it drafted at all) and ``passes`` head passes over
    ``fed_rows`` rows in all; not the target's verification cost in it, which only a
    step that keeps a node pays (:func:`step_costs_target`)."""
    return float(costs.fixed + (costs.draft_round - costs.verify_fixed if drafted else 0.0)
                 + passes * costs.draft_pass + fed_rows * costs.draft_row)


@dataclass(frozen=True)
class TreeBudget:
    keep: list[np.ndarray]  # per request: bool [n_r], kept nodes (a rooted subtree)
    total_nodes: int  # S: kept nodes over all requests
    expected_tokens: float  # R + kept value
    step_time: float  # paid + target(S)
    rate: float


def _order_key(values: np.ndarray, depths: np.ndarray) -> np.ndarray:
    # Largest value first; on ties the shallower node, so a parent precedes its children.
    return np.lexsort((depths, -values))


def _request_curve(
    parents: np.ndarray, values: np.ndarray, whole_groups: bool
) -> tuple[np.ndarray, list[list[int]]]:
    """Best kept value with exactly ``s`` nodes (``-inf`` if impossible), and a witness.

    Tree knapsack from the leaves up: ``f[n][s]`` is the best value below ``n`` (``n``
    excluded) with ``s`` nodes, given ``n`` is kept; the root is node ``-1``.
    """
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n + 1)]  # index n + ... : root at n
    for i, p in enumerate(parents):
        children[n if p < 0 else int(p)].append(i)
    f: list[np.ndarray | None] = [None] * (n + 1)
    wit: list[list[list[int]] | None] = [None] * (n + 1)

    def merge(a, wa, b, wb):
        out = np.full(len(a) + len(b) - 1, -np.inf)
        w: list[list[int]] = [[] for _ in range(len(out))]
        for i in range(len(a)):
            if a[i] == -np.inf:
                continue
            for j in range(len(b)):
                if b[j] == -np.inf:
                    continue
                if a[i] + b[j] > out[i + j]:
                    out[i + j] = a[i] + b[j]
                    w[i + j] = wa[i] + wb[j]
        return out, w

    for node in list(range(n - 1, -1, -1)) + [n]:
        kids = children[node]
        cur, cw = np.zeros(1), [[]]
        if whole_groups and kids:
            # All kids together (each then optionally extends below itself), or none.
            grp, gw = np.array([float(values[kids].sum())]), [list(kids)]
            for c in kids:
                grp, gw = merge(grp, gw, f[c], wit[c])
            none_or_all = np.full(len(grp) + len(kids), -np.inf)
            nw: list[list[int]] = [[] for _ in range(len(none_or_all))]
            none_or_all[0] = 0.0
            none_or_all[len(kids):] = grp
            for s in range(len(grp)):
                nw[len(kids) + s] = gw[s]
            cur, cw = none_or_all, nw
        else:
            for c in kids:
                # Child c: absent, or kept (1 node, value v_c) with its own subtree.
                opt = np.concatenate([[0.0], values[c] + f[c]])
                ow = [[]] + [[c] + x for x in wit[c]]
                cur, cw = merge(cur, cw, opt, ow)
        f[node], wit[node] = cur, cw
    return f[n], wit[n]


def prune_trees(
    parents: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    paid: float,
    target: TargetCost,
    whole_groups: Sequence[bool] | None = None,
    max_nodes: int | None = None,
) -> TreeBudget:
    """Keep per request the rooted subtree that maximises the step's rate (module doc).

    ``values`` are made monotone first. ``whole_groups[r]``: request ``r`` is verified
    with the sampled i.i.d. rule, keep whole sibling groups only. ``max_nodes``: the
    target's cap on kept nodes in all (vLLM's ``num_speculative_tokens`` budget).
    Ties in rate: the fewer nodes.
    """
    num_reqs = len(parents)
    if whole_groups is None:
        whole_groups = [False] * num_reqs
    parents = [np.asarray(p, dtype=np.int64) for p in parents]
    vals = [monotone_path_values(p, v) for p, v in zip(parents, values)]
    depths = [node_depths(p) for p in parents]
    total = sum(len(p) for p in parents)
    cap = total if max_nodes is None else min(total, max_nodes)

    free = [r for r in range(num_reqs) if not whole_groups[r]]
    grouped = [r for r in range(num_reqs) if whole_groups[r]]

    # Free requests: best value with s nodes = sum of the s largest values (module doc).
    flat_v = np.concatenate([vals[r] for r in free]) if free else np.zeros(0)
    flat_d = np.concatenate([depths[r] for r in free]) if free else np.zeros(0, np.int64)
    flat_r = np.concatenate([np.full(len(vals[r]), r) for r in free]) if free else flat_d
    flat_i = np.concatenate([np.arange(len(vals[r])) for r in free]) if free else flat_d
    order = _order_key(flat_v, flat_d)
    free_curve = np.concatenate([[0.0], np.cumsum(flat_v[order])])

    # Grouped requests: exact per-request curves, merged by max-plus convolution.
    g_curve, g_wit = np.zeros(1), [[]]
    for r in grouped:
        c, w = _request_curve(parents[r], vals[r], True)
        merged = np.full(len(g_curve) + len(c) - 1, -np.inf)
        mw: list[list[tuple[int, int]]] = [[] for _ in range(len(merged))]
        for i in range(len(g_curve)):
            if g_curve[i] == -np.inf:
                continue
            for j in range(len(c)):
                if c[j] != -np.inf and g_curve[i] + c[j] > merged[i + j]:
                    merged[i + j] = g_curve[i] + c[j]
                    mw[i + j] = g_wit[i] + [(r, x) for x in w[j]]
        g_curve, g_wit = merged, mw

    best = (-1.0, 0, 0, 0)  # rate, S, free part, grouped part
    for sg in range(len(g_curve)):
        if g_curve[sg] == -np.inf or sg > cap:
            continue
        for sf in range(min(len(free_curve) - 1, cap - sg) + 1):
            s = sf + sg
            tokens = num_reqs + free_curve[sf] + g_curve[sg]
            rate = tokens / (paid + float(target(s)))
            if rate > best[0] + 1e-12 or (abs(rate - best[0]) <= 1e-12 and s < best[1]):
                best = (rate, s, sf, sg)
    rate, s, sf, sg = best
    keep = [np.zeros(len(p), dtype=bool) for p in parents]
    for k in order[:sf]:
        keep[int(flat_r[k])][int(flat_i[k])] = True
    for r, x in g_wit[sg]:
        keep[r][x] = True
    tokens = num_reqs + free_curve[sf] + g_curve[sg]
    return TreeBudget(keep, int(s), float(tokens), float(paid + target(s)), float(rate))


def choose_tree_depth(
    depth_values: Sequence[float],
    depth_nodes: Sequence[int],
    num_reqs: int,
    base: float,
    pass_costs: Sequence[float],
    target: TargetCost,
    skip_cost: float = 0.0,
) -> int:
    """Drafter passes to run before drafting (0: a plain step).

    ``depth_values[d - 1]`` / ``depth_nodes[d - 1]``: the expected kept value and kept
    nodes, over the batch, of depth ``d`` of the trees (from the last steps' pruned
    trees); ``pass_costs[d - 1]``: the drafter's pass ``d``; ``base``: the step's cost
    outside the drafter and the target; ``skip_cost``: what depth 0 leaves to be paid
    later (a drafter that then skips its first pass catches its KV up in a later pass:
    ``StepCosts.skip_debt`` per request). Returns ``argmax_D (R + sum_{d<=D} value) /
    (base + [D = 0] skip_cost + sum_{d<=D} pass + target(sum_{d<=D} nodes))``, the
    shallower on ties.
    """
    best_d, best_rate = 0, num_reqs / (base + skip_cost + float(target(0)))
    value, nodes, passes = 0.0, 0, 0.0
    for d in range(1, len(depth_values) + 1):
        value += float(depth_values[d - 1])
        nodes += int(depth_nodes[d - 1])
        passes += float(pass_costs[d - 1])
        rate = (num_reqs + value) / (base + passes + float(target(nodes)))
        if rate > best_rate + 1e-12:
            best_d, best_rate = d, rate
    return best_d
