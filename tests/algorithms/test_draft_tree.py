"""Draft trees: shape helpers, masks, building trees, and ``verify_tree`` against the slow
per-request reference (``tree_reference.py``) and against the chain sampler."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from vllm_specx.algorithms import draft_tree as DT
from vllm_specx.algorithms import verify as V

sys.path.insert(0, str(Path(__file__).parent))
from tree_reference import (  # noqa: E402
    TREE_VARIANTS,
    TreeCase,
    output_rows,
    random_tree_case,
    reference_verify_tree,
)
from verify_reference import RULE_VARIANTS, random_batch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- shapes


def _slow_depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def test_node_depths_and_ancestor_mask_match_a_walk_up_the_parents() -> None:
    for seed in range(30):
        case = random_tree_case(seed, "deterministic")
        batch = case.batch
        cu = batch.cu_num_nodes.tolist()
        depths = DT.node_depths(batch.parents, batch.cu_num_nodes).tolist()
        mask = DT.tree_attention_mask(batch)
        for b in range(len(cu)):
            start = cu[b - 1] if b else 0
            par = batch.parents[start:cu[b]].tolist()
            assert depths[start:cu[b]] == _slow_depths(par)
            anc = DT.ancestor_mask(torch.tensor(par, dtype=torch.int64))
            for i in range(len(par)):
                chain = {i}
                j = par[i]
                while j >= 0:
                    chain.add(j)
                    j = par[j]
                assert anc[i].nonzero().flatten().tolist() == sorted(chain)
                # The batched mask: the root column, then the same ancestors.
                assert bool(mask[b, 1 + i, 0])
                assert mask[b, 1 + i, 1:1 + len(par)].nonzero().flatten().tolist() == sorted(chain)
            assert mask[b, 0].nonzero().flatten().tolist() == [0]  # the root sees itself
            # Padding slots see only themselves (no empty softmax row).
            for i in range(len(par), mask.shape[1] - 1):
                assert mask[b, 1 + i].nonzero().flatten().tolist() == [1 + i]
        assert batch.max_depth == (max(depths) if depths else 0)


def test_tree_batch_refuses_bad_parents_and_shapes() -> None:
    ok = dict(token_ids=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, 0]),
              cu_num_nodes=torch.tensor([3]))
    DT.TreeBatch(**ok)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1 is not allowed for node 1"):
        DT.TreeBatch(**{**ok, "parents": torch.tensor([-1, 1, 0])})
    with pytest.raises(ValueError, match=r"parents\[0\] = -2"):
        DT.TreeBatch(**{**ok, "parents": torch.tensor([-2, 0, 0])})
    # Node 0 of the second request cannot point into the first request.
    with pytest.raises(ValueError, match=r"parents\[2\] = 0 is not allowed for node 0"):
        DT.TreeBatch(**{**ok, "cu_num_nodes": torch.tensor([2, 3])})
    with pytest.raises(ValueError, match="parents must be"):
        DT.TreeBatch(**{**ok, "parents": torch.tensor([-1, 0])})
    with pytest.raises(ValueError, match="cumulative sum ending at T=3"):
        DT.TreeBatch(**{**ok, "cu_num_nodes": torch.tensor([2])})
    with pytest.raises(ValueError, match="max_depth = 1 is below the batch's"):
        DT.TreeBatch(**ok, max_depth=1)
    b = DT.TreeBatch(**ok)
    assert (b.max_num_nodes, b.max_depth, b.max_children) == (3, 2, 2)


# ----------------------------------------------------------------------------- static trees


def test_tree_from_paths_sorts_breadth_first_like_vllms_token_tree() -> None:
    tree = DT.tree_from_paths([(0, 0), (1,), (0,), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, -1, 0, 0, 1, 2)
    assert tree.depths == (1, 1, 2, 2, 2, 3)
    assert tree.child_ranks == (0, 1, 0, 1, 0, 0)
    assert (tree.num_nodes, tree.max_depth, tree.max_children) == (6, 3, 2)
    DT.TreeBatch(torch.zeros(6, dtype=torch.int64), tree.parents_tensor(), torch.tensor([6]))


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0], [0, 0, 1]], r"has the path \[0, 0, 1\] but not its prefix \[0, 0\]"),
        ([[0], [1], [0]], r"lists the path \[0\] twice"),
        ([[0], []], r"paths\[1\] = \[\] is not allowed: a path is a non-empty list"),
        ([[0], [-1]], r"paths\[1\] = \[-1\] is not allowed: child ranks are integers >= 0"),
        ([], r"paths = \[\] is not allowed: a tree needs at least one path"),
        ("[[0]]", r"it must be a list of paths"),
        ([[0]] + [[0] * d for d in range(2, 18)], r"a path of depth 17, more than the limit 16"),
        ([[i] for i in range(65)], r"has 65 nodes, more than the limit 64"),
    ],
)
def test_tree_from_paths_names_each_problem(paths, message) -> None:
    with pytest.raises(ValueError, match=message):
        DT.tree_from_paths(paths)


def test_validate_tree_knob() -> None:
    assert DT.validate_tree_knob({"max_nodes": 16, "max_depth": 5, "branching": 4}) == []
    assert DT.validate_tree_knob({"max_nodes": 8}) == []
    # Unset depth / branching default to at most the nodes given (not refused).
    assert DT.validate_tree_knob({"max_nodes": 2}) == []
    assert DT.validate_tree_knob({"max_nodes": 1}) == []
    assert DT.validate_tree_knob({"paths": [[0], [1], [0, 0]]}) == []
    cases = {
        "x": "it must be a dict",
        repr({"max_nodes": 0}):
            'draft_tree["max_nodes"] = 0 is not allowed: an integer from 1 to 64',
        repr({"max_depth": True}): 'draft_tree["max_depth"] = True is not allowed',
        repr({"branching": 2.0}): 'draft_tree["branching"] = 2.0 is not allowed',
        repr({"max_nodes": 4, "max_depth": 5}): "a tree of max_nodes = 4 nodes is at most 4 deep",
        repr({"max_nodes": 4, "max_depth": 2, "branching": 5}): "more children than max_nodes = 4",
        repr({"width": 3}): "unknown keys ['width']",
        repr({"paths": [[0]], "max_nodes": 3}): "mixes \"paths\" with ['max_nodes']",
        repr({"paths": [[1, 0]]}): "not its prefix [1]",
    }
    for text, message in cases.items():
        value = "x" if text == "x" else eval(text)  # noqa: S307 (literals written above)
        problems = DT.validate_tree_knob(value)
        assert len(problems) == 1, problems
        assert message in problems[0], problems
        assert "\n" not in problems[0]


# ----------------------------------------------------------------------------- verification


@pytest.mark.parametrize("variant", TREE_VARIANTS)
def test_verify_tree_matches_the_reference_on_random_trees(variant: str) -> None:
    compared = skipped = accepted_deep = 0
    for seed in range(150):
        case = random_tree_case(1000 * TREE_VARIANTS.index(variant) + seed, variant)
        verdict = case.run()
        ref_out, ref_paths, fragile = reference_verify_tree(case)
        out = output_rows(verdict.output_token_ids)
        paths = [[i for i in row if i >= 0] for row in verdict.accepted_nodes.tolist()]
        assert verdict.num_accepted.tolist() == [len(p) for p in paths]
        for b, (got, want) in enumerate(zip(out, ref_out)):
            if fragile[b]:
                skipped += 1
                continue
            compared += 1
            assert got == want, (seed, b, got, want)
            assert paths[b] == ref_paths[b], (seed, b)
            accepted_deep += len(paths[b]) >= 2
    assert skipped < 0.02 * (compared + skipped), (compared, skipped)
    assert accepted_deep > 20  # the walks really go deep


def test_greedy_requests_follow_the_argmax_under_every_rule() -> None:
    for variant in TREE_VARIANTS:
        for seed in range(40):
            case = random_tree_case(5000 + seed, variant)
            case.is_greedy = torch.ones_like(case.is_greedy)
            ref_out, ref_paths, _ = reference_verify_tree(case)  # greedy is never fragile
            verdict = case.run()
            assert output_rows(verdict.output_token_ids) == ref_out
            # all_greedy skips the sampled work and needs no randomness: same answer.
            fast = DT.verify_tree(case.batch, case.node_probs, rule=variant,
                                  is_greedy=case.is_greedy, target_argmax=case.target_argmax,
                                  all_greedy=True)
            assert torch.equal(fast.output_token_ids, verdict.output_token_ids)
            assert torch.equal(fast.accepted_nodes, verdict.accepted_nodes)


def _chain_case(batch: V.VerifyBatch, variant: str) -> TreeCase:
    """The same drafts as a tree in which every node's parent is the previous node."""
    cu = batch.cu_num_draft_tokens.tolist()
    parents, rows, argmax = [], [], []
    chain_argmax = batch.target_argmax
    for b in range(len(cu)):
        start = cu[b - 1] if b else 0
        parents += list(range(-1, cu[b] - start - 1))
        rows += [batch.target_probs[start:cu[b]], batch.bonus_probs[b:b + 1]]
        # The chain takes the bonus row's greedy token from its probabilities.
        argmax += [chain_argmax[start:cu[b]], batch.bonus_probs[b:b + 1].argmax(-1)]
    tree = DT.TreeBatch(batch.draft_token_ids, torch.tensor(parents, dtype=torch.int64),
                        batch.cu_num_draft_tokens)
    rule = {"standard": "sampled", "one_hot": "deterministic", "mtad": "mtad"}[variant]
    return TreeCase(
        batch=tree, node_probs=torch.cat(rows), rule=rule, is_greedy=batch.is_greedy,
        uniforms=batch.uniforms, exp_noise=batch.exp_noise, target_argmax=torch.cat(argmax),
        draft_probs=batch.draft_probs if variant == "standard" else None,
        draft_token_probs=batch.draft_token_probs if variant == "mtad" else None,
        acceptance_threshold=batch.acceptance_threshold,
    )


@pytest.mark.parametrize("variant", RULE_VARIANTS)
def test_a_chain_is_verified_exactly_as_the_chain_sampler_does(variant: str) -> None:
    """Same drafts, same randomness: token for token the chain sampler's output, fragile
    comparisons included (the tree rules evaluate a chain with the same float32 ops)."""
    rejected = 0
    for seed in range(120):
        batch = random_batch(7000 + seed, variant, max_batch=24)
        chain = output_rows(V.verify(batch))
        verdict = _chain_case(batch, variant).run()
        assert output_rows(verdict.output_token_ids) == chain, seed
        n = (batch.cu_num_draft_tokens - torch.cat([torch.zeros(1, dtype=torch.int64),
                                                    batch.cu_num_draft_tokens[:-1]])).tolist()
        rejected += sum(len(c) - 1 < k for c, k in zip(chain, n))
        assert verdict.accepted_nodes.tolist() == [
            list(range(len(c) - 1)) + [-1] * (verdict.accepted_nodes.shape[1] - len(c) + 1)
            for c in chain
        ]
    assert rejected > 100


def test_requests_without_nodes_emit_one_token_from_their_root_row() -> None:
    case = random_tree_case(3, "sampled")
    empty = DT.TreeBatch(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                         torch.zeros(3, dtype=torch.int64))
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for greedy in (True, False):
        verdict = DT.verify_tree(empty, probs, rule="sampled", is_greedy=torch.full((3,), greedy),
                                 uniforms=torch.zeros(0), exp_noise=torch.ones(3, 3),
                                 draft_probs=torch.zeros(0, 3))
        assert verdict.output_token_ids.tolist() == [[1], [2], [0]]
        assert verdict.accepted_nodes.shape == (3, 0)
    assert case.batch.num_requests > 0  # the helper itself works on random cases
    # No requests at all: empty outputs of the right shapes, for every rule.
    none = torch.zeros(0, dtype=torch.int64)
    for rule in TREE_VARIANTS:
        verdict = DT.verify_tree(
            DT.TreeBatch(none, none, none), torch.zeros(0, 5), rule=rule,
            is_greedy=torch.zeros(0, dtype=torch.bool), uniforms=torch.zeros(0),
            exp_noise=torch.zeros(0, 5), draft_probs=torch.zeros(0, 5),
            draft_token_probs=torch.zeros(0))
        assert verdict.output_token_ids.shape == (0, 1) and verdict.num_accepted.shape == (0,)


def test_deterministic_rule_never_accepts_a_duplicate_sibling() -> None:
    """Root children [3, 3]: the first 3 is rejected (u >= p(3)), so p'(3) = 0 and the
    duplicate must be rejected whatever its uniform; the extra token then avoids 3."""
    probs = torch.tensor([[0.1, 0.2, 0.1, 0.6], [0.25] * 4, [0.25] * 4])
    batch = DT.TreeBatch(torch.tensor([3, 3]), torch.tensor([-1, -1]), torch.tensor([2]))
    for noise_seed in range(50):
        noise = torch.empty(1, 4).exponential_(generator=torch.Generator().manual_seed(noise_seed))
        verdict = DT.verify_tree(batch, probs, rule="deterministic",
                                 is_greedy=torch.tensor([False]),
                                 uniforms=torch.tensor([0.7, 0.0]), exp_noise=noise)
        assert verdict.num_accepted.tolist() == [0]
        assert verdict.output_token_ids[0, 0] != 3


def test_mtad_prefers_the_deepest_passing_node_then_the_likelier_draft() -> None:
    # Root -> a (node 0), b (node 1); a -> c (node 2); b -> d (node 3). V = 4.
    batch = DT.TreeBatch(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, -1, 0, 1]),
                         torch.tensor([4]))
    p = torch.full((5, 4), 0.25)
    common = dict(rule="mtad", is_greedy=torch.tensor([False]), uniforms=torch.zeros(4),
                  exp_noise=torch.ones(1, 4), acceptance_threshold=0.9)
    # Every path's S = sum(log 0.25 - log q): q = 0.25 passes exactly 0 > log 0.9.
    q = torch.tensor([0.25, 0.25, 0.25, 0.2])  # d: S = log 1.25 > 0, but lower joint q
    verdict = DT.verify_tree(batch, p, draft_token_probs=q, **common)
    assert verdict.accepted_nodes.tolist() == [[0, 2]]  # c: depth 2, joint 0.0625 > 0.05
    q = torch.tensor([0.25, 0.25, 0.9, 0.2])  # c fails (0.25 / 0.9), d passes
    verdict = DT.verify_tree(batch, p, draft_token_probs=q, **common)
    assert verdict.accepted_nodes.tolist() == [[1, 3]]
    assert verdict.output_token_ids[0, :2].tolist() == [1, 3]
    q = torch.tensor([0.9, 0.9, 0.25, 0.25])  # depth 1 fails, depth 2 passes? S = log(.25/.9)+0 < 0
    verdict = DT.verify_tree(batch, p, draft_token_probs=q, **common)
    assert verdict.num_accepted.tolist() == [0]


# ----------------------------------------------------------------------------- tree building


def _random_candidates(seed: int):
    """Per-depth [B, W_d] candidates with duplicate (parent, token) pairs, dead ones,
    ties and non-monotone scores."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 6, (), generator=g))
    depth = int(torch.randint(1, 5, (), generator=g))
    vocab = int(torch.randint(2, 5, (), generator=g))  # small: duplicates are common
    tokens, parents, scores, lps = [], [], [], []
    prev_w, prev_score = 1, torch.zeros(b, 1)
    for _ in range(depth):
        w = int(torch.randint(1, 6, (), generator=g))
        par = torch.randint(0, prev_w, (b, w), generator=g)
        lp = -torch.rand(b, w, generator=g).mul(3).round(decimals=1)  # ties happen
        sc = prev_score.gather(1, par) + lp
        noise = torch.rand(b, w, generator=g)
        sc = torch.where(noise < 0.1, sc + 1.0, sc)  # a child above its parent
        sc = torch.where(noise > 0.9, torch.full_like(sc, -math.inf), sc)
        sc = torch.where((noise > 0.85) & (noise <= 0.9), torch.full_like(sc, math.nan), sc)
        tokens.append(torch.randint(0, vocab, (b, w), generator=g))
        parents.append(par)
        scores.append(sc)
        lps.append(lp)
        prev_w, prev_score = w, sc
    return tokens, parents, scores, lps


def _node_paths(tree: DT.DraftTree, r: int) -> list[tuple[int, ...]]:
    """Request r's nodes as token paths from the root (parents come first)."""
    paths: list[tuple[int, ...]] = []
    for i in range(int(tree.num_nodes[r])):
        par = int(tree.parents[r, i])
        paths.append((paths[par] if par >= 0 else ()) + (int(tree.token_ids[r, i]),))
    return paths


@pytest.mark.parametrize("sibling_order", ["score", "input"])
def test_tree_from_beams_matches_a_python_trie(sibling_order: str) -> None:
    from tree_reference import reference_tree_from_beams

    for seed in range(200):
        tokens, parents, scores, lps = _random_candidates(seed)
        max_nodes = 1 + seed % 9
        tree = DT.tree_from_beams(tokens, parents, scores, max_nodes, token_logprobs=lps,
                                  sibling_order=sibling_order)
        want = reference_tree_from_beams(tokens, parents, scores, max_nodes, sibling_order)
        for r, nodes in enumerate(want):
            n = len(nodes)
            assert int(tree.num_nodes[r]) == n, seed
            got_paths = _node_paths(tree, r)
            assert got_paths == [p for p, *_ in nodes], (seed, r)
            assert tree.parents[r, :n].tolist() == [par for _, par, _, _ in nodes]
            assert tree.scores[r, :n].tolist() == pytest.approx([s for _, _, s, _ in nodes])
            src = list(zip(tree.source_depth[r, :n].tolist(), tree.source_index[r, :n].tolist()))
            assert src == [s for *_, s in nodes]
            assert tree.depths[r, :n].tolist() == [len(p) for p, *_ in nodes]
            lp = [float(lps[d][r, c]) for d, c in src]
            assert tree.token_logprobs[r, :n].tolist() == pytest.approx(lp)
            assert tree.token_ids[r, n:].eq(-1).all() and tree.depths[r, n:].eq(0).all()
        if int(tree.num_nodes.sum()):
            batch = tree.to_batch()  # a valid BFS TreeBatch (validated on construction)
            assert batch.max_depth <= len(tokens)


def test_every_final_beam_of_a_beam_search_is_a_path_of_its_tree() -> None:
    """MTAD's beam search steps (select_beams) -> one tree holding all B beams."""
    from vllm_specx.algorithms.beam_draft import select_beams

    g = torch.Generator().manual_seed(0)
    rows, beams, vocab, depth = 3, 4, 7, 4
    table = torch.randn(vocab + 1, vocab, generator=g).log_softmax(-1)  # bigram "drafter"
    greedy = torch.tensor([True, False, True])
    scores = torch.zeros(rows, 1)
    history = torch.full((rows, 1, 1), vocab)  # a start token
    steps = []
    for _ in range(depth):
        logprobs = table[history[:, :, -1]]
        step = select_beams(scores, logprobs, beams, greedy)
        steps.append(step)
        history = torch.cat([history.gather(1, step.parents[:, :, None].expand(
            -1, -1, history.shape[2])), step.tokens[:, :, None]], dim=2)
        scores = step.scores
    tree = DT.tree_from_beams([s.tokens for s in steps], [s.parents for s in steps],
                              [s.scores for s in steps], max_nodes=beams * depth,
                              token_logprobs=[s.token_logprobs for s in steps])
    for r in range(rows):
        n = int(tree.num_nodes[r])
        paths = _node_paths(tree, r)
        leaves = {tuple(history[r, k, 1:].tolist()) for k in range(beams)}
        assert leaves <= set(paths)
        # Each node's q is the drafter's probability of its token after its parent.
        for i, path in enumerate(paths):
            prev = path[-2] if len(path) > 1 else vocab
            assert float(tree.token_logprobs[r, i]) == pytest.approx(float(table[prev, path[-1]]))
        # A tree of B beams of depth D needs fewer than B * D nodes when prefixes are shared.
        assert n <= beams * depth


def test_expand_frontier_takes_each_nodes_top_children_and_the_best_as_frontier() -> None:
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        b, w, vocab, k, width = 3, 1 + trial % 4, 9, 1 + trial % 3, 1 + trial % 5
        logprobs = torch.randn(b, w, vocab, generator=g).log_softmax(-1)
        base = -torch.rand(b, w, generator=g) * 4
        base[0, -1] = -math.inf  # a dead frontier node
        columns = torch.randint(0, 7, (b, w), generator=g)
        got = DT.expand_frontier(logprobs, base, columns, k, width)
        for r in range(b):
            cands = []  # (score, token, parent column, lp), column order
            for j in range(w):
                order = sorted(range(vocab), key=lambda v: -float(logprobs[r, j, v]))[:k]
                for v in order:
                    lp = float(logprobs[r, j, v])
                    score = float(base[r, j]) + lp if math.isfinite(base[r, j]) else -math.inf
                    cands.append((score, v, int(columns[r, j]), lp))
            assert got.tokens[r].tolist() == [c[1] for c in cands]
            assert got.parents[r].tolist() == [c[2] for c in cands]
            assert got.scores[r].tolist() == pytest.approx([c[0] for c in cands])
            assert got.token_logprobs[r].tolist() == pytest.approx([c[3] for c in cands])
            best = sorted(range(len(cands)), key=lambda i: -cands[i][0])[:width]
            live = [i for i in best if math.isfinite(cands[i][0])]
            assert got.frontier[r, :len(live)].tolist() == live
            assert got.frontier_scores[r, len(live):].eq(-math.inf).all()


def test_an_eagle2_tree_keeps_the_best_nodes_of_every_expanded_candidate() -> None:
    """Expand 4 depths with a toy bigram drafter, then keep the best 10 nodes overall."""
    g = torch.Generator().manual_seed(11)
    rows, vocab, k, width, depth, max_nodes = 4, 8, 3, 2, 4, 10
    table = (2 * torch.randn(vocab + 1, vocab, generator=g)).log_softmax(-1)  # row vocab: root
    last = torch.full((rows, 1), vocab)  # each frontier node's token
    scores, columns = torch.zeros(rows, 1), None
    levels = []
    for _ in range(depth):
        step = DT.expand_frontier(table[last], scores, columns, k, width)
        levels.append(step)
        scores, columns = step.frontier_scores, step.frontier
        last = step.tokens.gather(1, step.frontier)
    tree = DT.tree_from_beams([s.tokens for s in levels], [s.parents for s in levels],
                              [s.scores for s in levels], max_nodes,
                              token_logprobs=[s.token_logprobs for s in levels])
    assert tree.num_nodes.tolist() == [max_nodes] * rows
    for r in range(rows):
        paths = _node_paths(tree, r)
        # Every node's draft score is the sum of the drafter's log-probs along its path.
        for i, path in enumerate(paths):
            prev = [vocab, *path[:-1]]
            want = sum(float(table[a, t]) for a, t in zip(prev, path))
            assert float(tree.scores[r, i]) == pytest.approx(want, abs=1e-5)
        # ... and the kept nodes are the best max_nodes of all candidates of all depths.
        every = sorted((float(s.scores[r, c]) for s in levels for c in range(s.scores.shape[1])),
                       reverse=True)
        assert sorted(tree.scores[r, :max_nodes].tolist(), reverse=True) == pytest.approx(
            every[:max_nodes])
        DT.TreeBatch(tree.token_ids[r], tree.parents[r], torch.tensor([max_nodes]))


def test_sampled_children_keep_their_duplicates_when_asked() -> None:
    g = torch.Generator().manual_seed(5)
    logprobs = torch.tensor([[[0.7, 0.2, 0.1]]]).log().expand(64, 1, 3).contiguous()
    step = DT.expand_frontier(logprobs, torch.zeros(64, 1), None, 4, 4, sample=True,
                              generator=g)
    merged = DT.tree_from_beams([step.tokens], [step.parents], [step.scores], 4)
    kept = DT.tree_from_beams([step.tokens], [step.parents], [step.scores], 4,
                              merge_duplicates=False, sibling_order="input")
    assert kept.num_nodes.tolist() == [4] * 64
    assert torch.equal(kept.token_ids, step.tokens)  # every draw, in draw order
    distinct = [len(set(row)) for row in step.tokens.tolist()]
    assert merged.num_nodes.tolist() == distinct and min(distinct) < 4
    # The draws follow q: token 0 about 70% of 256 draws.
    assert 0.6 < float((step.tokens == 0).float().mean()) < 0.8


def _toy_logits(context: tuple[int, ...], vocab: int, salt: int = 0) -> torch.Tensor:
    """A deterministic toy "model": logits from a hash of the context, rounded (ties)."""
    g = torch.Generator().manual_seed((hash(context) * 31 + salt) % (2**31))
    return torch.randn(vocab, generator=g).mul(1.5).round()


def test_greedy_tree_speculation_equals_greedy_decoding() -> None:
    """Many rounds of EAGLE-2 trees (expand_frontier + tree_from_beams, ragged sizes)
    verified greedily: the text is the target's greedy continuation, token for token."""
    vocab, steps_out, b = 6, 30, 5

    def draft(ctx: tuple[int, ...]) -> torch.Tensor:  # the target plus noise
        return (_toy_logits(ctx, vocab) + _toy_logits(ctx, vocab, salt=7) * 0.7).log_softmax(-1)

    reference = []
    for r in range(b):
        seq = [r]
        while len(seq) <= steps_out:
            seq.append(int(_toy_logits(tuple(seq), vocab).argmax()))
        reference.append(seq)
    seqs = [[r] for r in range(b)]
    rounds = 0
    while min(len(s) for s in seqs) <= steps_out:
        rounds += 1
        trees, node_rows = [], []
        for r, seq in enumerate(seqs):
            # Per request: 3 depths, 2 children per node, frontier 2, 1..6 nodes kept.
            frontier: list[tuple[int, ...]] = [()]
            scores, columns = torch.zeros(1, 1), None
            levels = []
            for _ in range(3):
                logprobs = torch.stack([draft(tuple(seq) + path) for path in frontier])[None]
                step = DT.expand_frontier(logprobs, scores, columns, 2, 2)
                children = [frontier[c // 2] + (int(step.tokens[0, c]),)
                            for c in range(step.tokens.shape[1])]
                levels.append(step)
                frontier = [children[int(c)] for c in step.frontier[0]]
                scores, columns = step.frontier_scores, step.frontier
            tree = DT.tree_from_beams([s.tokens for s in levels], [s.parents for s in levels],
                                      [s.scores for s in levels], 1 + (r + rounds) % 6)
            trees.append(tree)
            paths = _node_paths(tree, 0)
            node_rows.append(torch.stack([_toy_logits(tuple(seq) + p, vocab)
                                          for p in [(), *paths]]))
        batch = DT.TreeBatch(
            torch.cat([t.flat(t.token_ids) for t in trees]),
            torch.cat([t.flat(t.parents) for t in trees]),
            torch.cumsum(torch.cat([t.num_nodes for t in trees]), 0),
        )
        logits = torch.cat(node_rows)
        verdict = DT.verify_tree(batch, logits.softmax(-1), rule="deterministic",
                                 is_greedy=torch.ones(b, dtype=torch.bool),
                                 target_argmax=logits.argmax(-1), all_greedy=True)
        for seq, row in zip(seqs, output_rows(verdict.output_token_ids)):
            seq.extend(row)
    for seq, ref in zip(seqs, reference):
        assert seq[: len(ref)] == ref
    assert rounds < steps_out * 0.7  # trees were accepted: far fewer rounds than tokens
