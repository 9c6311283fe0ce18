"""The draft-model tree with i.i.d. children (``algorithms/sampled_tree.py``): its shape,
its draws, and, end to end with ``verify_tree``'s ``"sampled"`` rule on toy bigram models,
output distributed as the target's (chi-square)."""

from __future__ import annotations

import pytest
import torch
from chi_square_helpers import chi_square, random_table

from vllm_specx.algorithms.draft_tree import TreeBatch, verify_tree
from vllm_specx.algorithms.sampled_tree import depth_sizes, draw_children, sampled_spine_tree


def test_depth_sizes_spend_the_budget_branching_per_depth():
    assert depth_sizes(8, 3, 3) == [3, 3, 2]
    assert depth_sizes(16, 5, 4) == [4, 4, 4, 4]
    assert depth_sizes(20, 5, 4) == [4, 4, 4, 4, 4]
    assert depth_sizes(2, 5, 4) == [2]
    with pytest.raises(ValueError):
        depth_sizes(0, 1, 1)


def _bigram_tree(q_table: torch.Tensor, roots: torch.Tensor, greedy: torch.Tensor,
                 sizes: tuple[int, int, int], g: torch.Generator | None = None):
    calls: list[torch.Tensor] = []

    def next_logprobs(path: torch.Tensor) -> torch.Tensor:
        calls.append(path.clone())
        return q_table[path[:, -1]].log()

    torch.manual_seed(0) if g is None else None
    tree = sampled_spine_tree(q_table[roots].log(), next_logprobs, max_nodes=sizes[0],
                              max_depth=sizes[1], branching=sizes[2], greedy=greedy)
    return tree, calls


def test_the_spine_tree_shape_rows_and_expanded_nodes():
    g = torch.Generator().manual_seed(1)
    q_table = random_table(g, 7, 7, zeros=1)
    roots = torch.tensor([0, 3, 5, 6])
    greedy = torch.tensor([False, True, False, False])
    tree, calls = _bigram_tree(q_table, roots, greedy, (8, 3, 3))
    assert tree.tokens.shape == (4, 8)
    assert tree.depth_of_node.tolist() == [0] * 3 + [1] * 3 + [2] * 2
    assert len(calls) == 2  # one drafter call per depth after the root
    for r in range(4):
        par = tree.parents[r].tolist()
        assert par[:3] == [-1] * 3
        spine = tree.spine[r].tolist()
        assert par[3:6] == [spine[0]] * 3 and par[6:] == [spine[1]] * 2 and spine[2] == -1
        last = int(roots[r])
        lo = 0
        for d, n in enumerate([3, 3, 2]):
            kids = tree.tokens[r, lo:lo + n]
            assert torch.allclose(tree.q[r, d], q_table[last])  # the row they came from
            q_kids = q_table[last][kids]
            assert bool((q_kids > 0).all())
            if bool(greedy[r]):
                assert kids.tolist() == q_table[last].topk(n).indices.tolist()
            if d < 2:
                best = int(spine[d]) - lo
                # the likeliest draw, the first one on ties
                assert best == int(torch.nonzero(q_kids == q_kids.max())[0])
                last = int(kids[best])
                assert int(calls[d][r, -1]) == last
            lo += n
    node_q = tree.node_q()
    assert torch.equal(node_q[:, 4], tree.q[:, 1])


def test_draws_are_iid_with_replacement_and_seeded_rows_use_their_generator():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 2).log()
    greedy = torch.tensor([False, False])
    gens = {1: torch.Generator().manual_seed(5)}
    draws = draw_children(probs.expand(2, 4).repeat(1, 1), 20000, greedy, gens)
    freq = torch.bincount(draws[0], minlength=4).double() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64),
                          atol=0.02)
    again = draw_children(probs, 20000, greedy, {1: torch.Generator().manual_seed(5)})
    assert torch.equal(draws[1], again[1])


def _run_round(p_table, q_table, roots, sizes, g, rule="sampled", q_rows=None):
    n_req = roots.shape[0]
    tree, _ = _bigram_tree(q_table, roots, torch.zeros(n_req, dtype=torch.bool), sizes, g)
    n = tree.tokens.shape[1]
    rows = torch.cat([roots[:, None], tree.tokens], dim=1)  # root + nodes, request-major
    node_probs = p_table[rows.reshape(-1)]
    batch = TreeBatch(token_ids=tree.tokens.reshape(-1), parents=tree.parents.reshape(-1),
                      cu_num_nodes=torch.arange(1, n_req + 1) * n)
    q = tree.node_q().reshape(-1, p_table.shape[1]) if q_rows is None else q_rows(tree)
    verdict = verify_tree(
        batch, node_probs, rule=rule, is_greedy=torch.zeros(n_req, dtype=torch.bool),
        uniforms=torch.rand(n_req * n, generator=g),
        exp_noise=torch.empty(n_req, p_table.shape[1]).exponential_(generator=g),
        draft_probs=q)
    return verdict


def _markov_p_values(verdict, p_table, roots) -> list[float]:
    """Column c of the output, given column c - 1 (the root's token for c = 0), against
    the target's bigram row: lossless output is a Markov chain under p."""
    out, acc = verdict.output_token_ids, verdict.num_accepted
    prev = roots
    p_values = []
    for c in range(out.shape[1]):
        has = acc >= c  # column c exists (an accepted node or the extra token)
        if int(has.sum()) < 2000:
            break
        p_values.append(chi_square(out[has, c], p_table[prev[has]], prev[has])[2])
        prev = out[:, c].clamp(min=0)
    return p_values


def test_iid_children_verified_by_the_sampled_rule_follow_the_target():
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    vocab = 6
    p_table = random_table(g, vocab, vocab, zeros=1, scale=1.5)
    q_table = random_table(g, vocab, vocab, zeros=1, scale=1.5)
    roots = torch.randint(0, vocab, (40000,), generator=g)
    verdict = _run_round(p_table, q_table, roots, (8, 3, 3), g)
    p_values = _markov_p_values(verdict, p_table, roots)
    assert len(p_values) >= 3 and min(p_values) > 1e-3, p_values
    # Accepts deep paths: more than a token per round on these tables.
    assert float(verdict.num_accepted.double().mean()) > 0.5
    # The control: the q rows of the wrong depth (a wrong residual) is caught.
    bad = _run_round(p_table, q_table, roots, (8, 3, 3), g,
                     q_rows=lambda t: t.q[:, :1].expand(-1, t.tokens.shape[1], -1)
                     .reshape(-1, vocab))
    assert min(_markov_p_values(bad, p_table, roots)) < 1e-6
