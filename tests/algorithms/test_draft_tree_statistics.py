"""Statistical proofs: both sampled tree rules are lossless, MTAD's extra token is p.

Setting: V = 6, every request drafts the same static tree shape, depth 2: three children
of the root, two children under each of them (9 nodes). Target and draft are Markov
"models" (``P0``, ``P1[x]``, ``P2[y]``: the distribution after the root, after a depth-1
token x, after a depth-2 token y; ``Q0``, ``Q1[x]`` the same for the drafter), with exact
zeros and different supports, so ``p(x) = 0``, ``q(x) = 0`` and residuals that exclude
tokens all happen. 100,000 requests, each with fresh drafts, verified in ONE
``verify_tree`` call.

Losslessness, checked per output column: among the requests whose output reaches column
j, grouped by the tokens before it, the token in column j must follow the target's
conditional (``P0``, ``P1[t0]``, ``P2[t1]``): once a path is accepted, the next token is a
fresh verification at that node whatever the path's siblings were. Pearson chi-square,
cells expected below 5 pooled per group, p-value > 1e-3 with fixed seeds.

Proposals: ``"sampled"`` (SpecInfer) gets children drawn i.i.d. from q, in draw order
(duplicates happen). ``"deterministic"`` gets, per request at random, either the
drafter's top-k (the EAGLE-2 case) or i.i.d. draws (duplicate siblings), since the rule is
lossless for any children chosen without the verifier's randomness. A control shows that
the sampled rule applied to top-k children (a proposal it is NOT made for) is caught.
"""

from __future__ import annotations

import pytest
import torch
from chi_square_helpers import chi_square, random_table

from vllm_specx.algorithms.draft_tree import (
    TreeBatch,
    expand_frontier,
    tree_from_beams,
    tree_from_paths,
    verify_tree,
)

V, N = 6, 100_000
SIGNIFICANCE = 1e-3
SHAPE = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]])
ROOT_CHILDREN, CHILDREN = 3, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _table(g: torch.Generator, rows: int, zeros: int = 2, scale: float = 1.0) -> torch.Tensor:
    return random_table(g, rows, V, zeros, scale)


def _drafter(g: torch.Generator, target: torch.Tensor) -> torch.Tensor:
    """Rows near the target's, each with one exact zero of its own."""
    mix = 0.5 * target + 0.5 * _table(g, target.shape[0], zeros=1)
    drop = torch.randint(0, V, (target.shape[0], 1), generator=g)
    mix = mix.scatter(1, drop, 0.0)
    return mix / mix.sum(1, keepdim=True)


def _children(q_rows: torch.Tensor, k: int, g: torch.Generator, top_k: torch.Tensor):
    """[N, k] children: i.i.d. draws from q_rows [N, V], or its top-k where ``top_k``."""
    drawn = torch.multinomial(q_rows, k, replacement=True, generator=g)
    best = q_rows.topk(k, dim=1).indices
    return torch.where(top_k[:, None], best, drawn)


class TreeDraws:
    """One 100k-request tree verification of the Markov setting, and what it emitted."""

    def __init__(self, rule: str, proposal: str, seed: int, tau: float = 0.3):
        g = torch.Generator().manual_seed(seed)
        self.p0, self.p1, self.p2 = _table(g, 1, scale=2.0), _table(g, V, scale=2.0), _table(g, V)
        # A drafter that roughly knows the target, with its own zeros (q = 0 where p > 0
        # and the other way round both occur).
        self.q0, self.q1 = _drafter(g, self.p0), _drafter(g, self.p1)
        top_k = {"iid": torch.zeros(N, dtype=torch.bool), "topk": torch.ones(N, dtype=torch.bool),
                 "mixed": torch.rand(N, generator=g) < 0.5}[proposal]
        d1 = _children(self.q0.expand(N, V), ROOT_CHILDREN, g, top_k)  # [N, 3]
        d2 = torch.stack(  # [N, 3, 2]: children of each depth-1 node
            [_children(self.q1[d1[:, i]], CHILDREN, g, top_k) for i in range(ROOT_CHILDREN)], 1
        )
        n_nodes = SHAPE.num_nodes
        # Node order of SHAPE: the 3 depth-1 nodes, then the children of node 0, 1, 2.
        tokens = torch.cat([d1, d2.reshape(N, -1)], dim=1)  # [N, 9]
        # node_probs: per request [root row, then the row after each node].
        rows = torch.cat([self.p0.expand(N, V)[:, None], self.p1[d1], self.p2[d2.reshape(N, -1)]],
                         dim=1)  # [N, 10, V]
        q_rows = torch.cat([self.q0.expand(N, ROOT_CHILDREN, V), self.q1[d1].repeat_interleave(
            CHILDREN, dim=1)], dim=1)  # [N, 9, V]: the row each node was drawn from
        self.tokens = tokens
        self.batch = TreeBatch(
            tokens.reshape(-1),
            SHAPE.parents_tensor().repeat(N),
            torch.arange(1, N + 1) * n_nodes,
            max_num_nodes=n_nodes, max_depth=2, max_children=ROOT_CHILDREN,
        )
        q_tok = q_rows.gather(2, tokens[:, :, None]).squeeze(2)
        self.verdict = verify_tree(
            self.batch,
            rows.reshape(-1, V),
            rule=rule,
            is_greedy=torch.zeros(N, dtype=torch.bool),
            uniforms=torch.rand(N * n_nodes, generator=g),
            exp_noise=torch.empty(N, V).exponential_(generator=g),
            draft_probs=q_rows.reshape(-1, V) if rule == "sampled" else None,
            draft_token_probs=q_tok.reshape(-1) if rule == "mtad" else None,
            acceptance_threshold=tau,
        )
        self.out = self.verdict.output_token_ids
        self.accepted = self.verdict.num_accepted

    def target_row(self, j: int, prefix: torch.Tensor) -> torch.Tensor:
        """The target distribution at column j given the emitted prefix [n, >= j]."""
        n = prefix.shape[0]
        if j == 0:
            return self.p0.expand(n, V)
        return (self.p1 if j == 1 else self.p2)[prefix[:, j - 1]]

    def columns(self) -> list[tuple[int, int, float]]:
        """(column, requests reaching it, chi-square p-value against the target)."""
        results = []
        for j in range(3):
            reached = self.out[:, j] != -1
            prefix = self.out[reached].clamp(min=0)
            group = prefix[:, j - 1] if j else torch.zeros(len(prefix), dtype=torch.int64)
            stat, dof, p = chi_square(self.out[reached, j], self.target_row(j, prefix), group)
            print(f"column {j}: n={int(reached.sum())} chi2={stat:.1f} dof={dof} p={p:.3g}")
            results.append((j, int(reached.sum()), p))
        return results


@pytest.mark.parametrize(
    "rule, proposal, seed",
    [("sampled", "iid", 101), ("deterministic", "mixed", 202), ("deterministic", "iid", 303)],
)
def test_sampled_tree_rules_reproduce_the_target(rule: str, proposal: str, seed: int) -> None:
    draws = TreeDraws(rule, proposal, seed)
    results = draws.columns()
    assert all(n > 5_000 for _, n, _ in results), results
    assert all(p > SIGNIFICANCE for *_, p in results), results
    # Not a degenerate run: every depth is reached, and later siblings get accepted.
    assert set(draws.accepted.unique().tolist()) == {0, 1, 2}
    first = draws.verdict.accepted_nodes[:, 0]
    assert ((first == 1) | (first == 2)).float().mean() > 0.05
    # Duplicate siblings occurred (i.i.d. draws), and none was accepted after its twin.
    if proposal != "topk":
        d1 = draws.tokens[:, :ROOT_CHILDREN]
        assert (d1[:, 0] == d1[:, 1]).float().mean() > 0.05


def test_mtad_extra_token_follows_p_at_the_accepted_node() -> None:
    draws = TreeDraws("mtad", "iid", seed=404, tau=1.0)
    a = draws.accepted
    assert (torch.bincount(a, minlength=3) > 500).all(), torch.bincount(a)  # every depth
    tokens = draws.out.gather(1, a[:, None]).squeeze(1)
    prefix = draws.out.clamp(min=0)
    dist = torch.zeros(N, V)
    for depth in range(3):
        at = a == depth
        dist[at] = draws.target_row(depth, prefix[at])
    prev = torch.where(a > 0, prefix.gather(1, (a - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    stat, dof, pval = chi_square(tokens, dist, a * V + prev)
    print(f"mtad extra token: chi2={stat:.1f} dof={dof} p={pval:.3g}")
    assert pval > SIGNIFICANCE


def test_the_sampled_rule_on_top_k_children_is_caught() -> None:
    """Control: SpecInfer's rule assumes i.i.d. children; fed the drafter's top-k it is
    biased, and the same chi-square machinery says so decisively."""
    draws = TreeDraws("sampled", "topk", seed=505)
    assert min(p for *_, p in draws.columns()) < 1e-12


@pytest.mark.parametrize("rule", ["sampled", "deterministic"])
def test_drafted_trees_are_lossless_end_to_end(rule: str) -> None:
    """The whole pure pipeline: expand_frontier (i.i.d. children for "sampled", EAGLE-2's
    top-k plus pruning to the best 5 nodes for "deterministic"), tree_from_beams, then
    verify_tree; the first two output columns must follow the target."""
    n = 50_000
    g = torch.Generator().manual_seed(606 if rule == "sampled" else 707)
    p0, p1, p2 = _table(g, 1, scale=2.0), _table(g, V, scale=2.0), _table(g, V)
    q0, q1 = _drafter(g, p0), _drafter(g, p1)
    sample = rule == "sampled"
    first = expand_frontier(q0.log().expand(n, 1, V), torch.zeros(n, 1), None, 3, 2,
                            sample=sample, generator=g)
    parent_tok = first.tokens.gather(1, first.frontier)  # [n, 2]
    second = expand_frontier(q1[parent_tok].log(), first.frontier_scores, first.frontier,
                             2, 2, sample=sample, generator=g)
    tree = tree_from_beams(
        [first.tokens, second.tokens], [first.parents, second.parents],
        [first.scores, second.scores], 7 if sample else 5,
        merge_duplicates=not sample, sibling_order="input" if sample else "score",
    )
    width = tree.token_ids.shape[1]
    assert tree.num_nodes.tolist() == [width] * n  # q has no zero where p is peaked here
    tokens, parents, depths = tree.token_ids, tree.parents, tree.depths
    parent_token = tokens.gather(1, parents.clamp(min=0))
    after = torch.where((depths == 1)[:, :, None], p1[tokens.clamp(min=0)],
                        p2[tokens.clamp(min=0)])
    rows = torch.cat([p0.expand(n, 1, V), after], dim=1)  # [n, 1 + width, V]
    q_rows = torch.where((depths == 1)[:, :, None], q0.expand(n, width, V), q1[parent_token])
    batch = TreeBatch(tokens.reshape(-1), parents.reshape(-1), torch.arange(1, n + 1) * width,
                      max_num_nodes=width, max_depth=2)
    verdict = verify_tree(
        batch, rows.reshape(-1, V), rule=rule, is_greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=torch.rand(n * width, generator=g),
        exp_noise=torch.empty(n, V).exponential_(generator=g),
        draft_probs=q_rows.reshape(-1, V) if sample else None,
    )
    out = verdict.output_token_ids
    assert (verdict.num_accepted == 2).any() and (verdict.num_accepted == 0).any()
    for j, dist in ((0, lambda pre: p0.expand(len(pre), V)), (1, lambda pre: p1[pre[:, 0]])):
        reached = out[:, j] != -1
        prefix = out[reached].clamp(min=0)
        group = prefix[:, 0] if j else torch.zeros(len(prefix), dtype=torch.int64)
        stat, dof, pval = chi_square(out[reached, j], dist(prefix), group)
        print(f"{rule} end to end, column {j}: n={int(reached.sum())} chi2={stat:.1f} p={pval:.3g}")
        assert int(reached.sum()) > 5_000 and pval > SIGNIFICANCE


@pytest.mark.parametrize("merge", [False, True])
def test_merging_iid_duplicates_breaks_the_sampled_rule(merge: bool) -> None:
    """Why tree_from_beams(merge_duplicates=False) exists: three i.i.d. root children
    verified by SpecInfer's rule reproduce P0; merged into distinct tokens they do not
    (a dropped duplicate skips the residual update its rejection makes)."""
    n = 100_000
    g = torch.Generator().manual_seed(808)
    p0 = _table(g, 1, scale=2.0)
    q0 = _drafter(g, p0)
    step = expand_frontier(q0.log().expand(n, 1, V), torch.zeros(n, 1), None, 3, 3,
                           sample=True, generator=g)
    tree = tree_from_beams([step.tokens], [step.parents], [step.scores], 3,
                           merge_duplicates=merge, sibling_order="input")
    batch = tree.to_batch()
    # Every request's rows: P0 after the root, and (unused but for leaves) P0 after nodes.
    node_probs = p0.expand(batch.num_nodes + n, V)
    verdict = verify_tree(
        batch, node_probs, rule="sampled", is_greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=torch.rand(batch.num_nodes, generator=g),
        exp_noise=torch.empty(n, V).exponential_(generator=g),
        draft_probs=q0.expand(batch.num_nodes, V),
    )
    _, _, pval = chi_square(verdict.output_token_ids[:, 0], p0.expand(n, V),
                            torch.zeros(n, dtype=torch.int64))
    assert (pval < 1e-12) if merge else (pval > SIGNIFICANCE), pval
