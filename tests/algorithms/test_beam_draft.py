"""MTAD beam drafting (vllm_specx.algorithms.beam_draft) against slow references.

References here are deliberately naive: Python loops over one request, explicit
enumeration of every candidate / every sequence, and the textbook successive-sampling law.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

from vllm_specx.algorithms.beam_draft import (
    BeamSearchState,
    StreamingSelector,
    beam_search,
    recompute_tail_cost,
    select_beams,
    warp_logprobs,
)

TINY = torch.finfo(torch.float32).tiny

# --------------------------------------------------------------------------------------
# Slow references
# --------------------------------------------------------------------------------------


def ref_noise(gen: torch.Generator, n: int) -> list[float]:
    """Gumbel noise drawn from one request's generator, element by element."""
    u = torch.rand(n, generator=gen).tolist()
    return [-math.log(-math.log(max(x, TINY))) for x in u]


def ref_select_one(
    scores: list[float],
    logprobs: list[list[float]],
    num_beams: int,
    noise: list[float] | None,
) -> list[tuple[float, int, int, float]]:
    """One request: enumerate every (beam, token), rank by key, keep num_beams.

    Returns (score, parent, token, token_logprob) per kept beam, in selection order.
    """
    cands = []
    vocab = len(logprobs[0])
    for b, s in enumerate(scores):
        for v in range(vocab):
            joint = s + logprobs[b][v]
            key = joint if noise is None else joint + noise[b * vocab + v]
            cands.append((key, b * vocab + v, joint, b, v, logprobs[b][v]))
    # Highest key first; equal keys keep enumeration order (never hit with random floats).
    cands.sort(key=lambda c: (-c[0], c[1]))
    return [(c[2], c[3], c[4], c[5]) for c in cands[:num_beams]]


def ref_beam_search_one(
    next_lp,  # (prefix tuple) -> list[float] over the vocab
    num_beams: int,
    depth: int,
    gen: torch.Generator | None,
) -> tuple[list[int], list[float]]:
    """One request's beam search with Python lists; returns the best beam and its q."""
    beams = [((), 0.0, ())]  # (tokens, score, token logprobs)
    for _ in range(depth):
        lps = [next_lp(t) for t, _, _ in beams]
        noise = None if gen is None else ref_noise(gen, len(beams) * len(lps[0]))
        kept = ref_select_one([s for _, s, _ in beams], lps, num_beams, noise)
        beams = [(beams[b][0] + (v,), s, beams[b][2] + (lp,)) for s, b, v, lp in kept]
    best = max(range(len(beams)), key=lambda i: (beams[i][1], -i))
    tokens, _, lps = beams[best]
    return list(tokens), [math.exp(x) for x in lps]


class TableModel:
    """A toy "draft model": a fixed random log-prob vector per (row, prefix)."""

    def __init__(self, num_rows: int, vocab: int, seed: int, top_k: int | None = None):
        self.vocab = vocab
        self.num_rows = num_rows
        self.top_k = top_k
        self.seed = seed

    def row_lp(self, row: int, prefix: tuple[int, ...]) -> list[float]:
        g = torch.Generator().manual_seed(hash((self.seed, row, prefix)) % (2**62))
        logits = torch.randn(self.vocab, generator=g) * 2.0
        k = None if self.top_k is None else torch.tensor([self.top_k])
        return warp_logprobs(logits.unsqueeze(0), None, k, None)[0].tolist()

    def batched(self, tokens: torch.Tensor) -> torch.Tensor:
        rows, width, _ = tokens.shape
        out = torch.empty(rows, width, self.vocab)
        for r in range(rows):
            for b in range(width):
                out[r, b] = torch.tensor(self.row_lp(r, tuple(tokens[r, b].tolist())))
        return out


def gens(seeds: dict[int, int]) -> dict[int, torch.Generator]:
    return {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}


# --------------------------------------------------------------------------------------
# Warping
# --------------------------------------------------------------------------------------


def ref_warp_row(logits: list[float], t: float, k: int, p: float) -> list[float]:
    """Temperature, then top-k, then top-p, for one row, with plain sorting."""
    v = len(logits)
    if t < 1e-5:
        m = max(logits)
        z = math.log(sum(math.exp(x - m) for x in logits)) + m
        return [x - z for x in logits]
    x = [y / t for y in logits]
    order = sorted(range(v), key=lambda i: -x[i])
    keep = set(range(v))
    if 0 < k < v:
        kth = x[order[k - 1]]
        keep = {i for i in keep if x[i] >= kth}
    if p < 1.0:
        m = max(x[i] for i in keep)
        z = sum(math.exp(x[i] - m) for i in keep)
        above = 0.0
        new_keep = set()
        for i in order:
            if i not in keep:
                continue
            if above < p or not new_keep:
                new_keep.add(i)
            above += math.exp(x[i] - m) / z
        keep = new_keep
    m = max(x[i] for i in keep)
    z = math.log(sum(math.exp(x[i] - m) for i in keep)) + m
    return [x[i] - z if i in keep else float("-inf") for i in range(v)]


def test_warp_matches_reference_rows():
    torch.manual_seed(0)
    n, v = 12, 17
    logits = torch.randn(n, v) * 3
    temp = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.7, 1.3, 0.0, 0.9, 1.0, 0.3, 1.0, 1.1])
    top_k = torch.tensor([0, 3, v, 1, 5, 0, 2, 16, 4, 0, 100, 7])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.8, 0.3, 0.2, 1.0, 0.95, 0.05, 0.6, 1.0])
    got = warp_logprobs(logits, temp, top_k, top_p)
    for i in range(n):
        want = ref_warp_row(logits[i].tolist(), float(temp[i]), int(top_k[i]), float(top_p[i]))
        for a, b in zip(got[i].tolist(), want):
            if b == float("-inf"):
                assert a == float("-inf"), (i, got[i], want)
            else:
                assert a == pytest.approx(b, abs=1e-5), (i, got[i], want)


def test_warp_agrees_with_vllm_sampler_masks():
    """Same kept set as vLLM's own top-k/top-p (so q is warped like the target's p)."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    torch.manual_seed(1)
    n, v = 16, 50
    logits = torch.randn(n, v) * 2
    temp = torch.rand(n) + 0.3
    top_k = torch.randint(1, v + 1, (n,))
    top_p = torch.rand(n) * 0.9 + 0.1
    ours = warp_logprobs(logits, temp, top_k, top_p)
    theirs = topk_topp.apply_top_k_top_p_pytorch(logits / temp.unsqueeze(1), top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours, theirs.log_softmax(-1), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# One selection step
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prev_beams,vocab,num_beams", [(1, 7, 3), (3, 5, 4), (4, 6, 4), (2, 3, 8)])
def test_select_matches_enumeration(prev_beams, vocab, num_beams):
    torch.manual_seed(prev_beams * 100 + vocab)
    rows = 6
    scores = torch.randn(rows, prev_beams) * 2
    scores[2, -1] = float("-inf")  # a dead parent
    lp = torch.randn(rows, prev_beams, vocab).log_softmax(-1)
    lp[3, :, : vocab // 2] = float("-inf")  # masked tokens (top-k-like)
    greedy = torch.tensor([True, False, True, False, False, True])
    seeds = {1: 11, 3: 33, 4: 44}  # row 4 seeded, rows 1,3 seeded; row 5 greedy
    # Unseeded sampled rows are not reproducible from outside; give every sampled row a seed.
    for r in range(rows):
        if not greedy[r] and r not in seeds:
            seeds[r] = 1000 + r
    out = select_beams(scores, lp, num_beams, greedy, gens(seeds))
    ref_gens = gens(seeds)
    for r in range(rows):
        noise = None if greedy[r] else ref_noise(ref_gens[r], prev_beams * vocab)
        want = ref_select_one(scores[r].tolist(), lp[r].tolist(), num_beams, noise)
        n_real = len(want)
        for i, (s, b, v, tlp) in enumerate(want):
            got_s = float(out.scores[r, i])
            if s == float("-inf"):
                # Among dead candidates the order is unspecified; only deadness matters.
                assert got_s == float("-inf")
                continue
            assert got_s == pytest.approx(s, abs=1e-5)
            assert int(out.parents[r, i]) == b and int(out.tokens[r, i]) == v
            assert float(out.token_logprobs[r, i]) == pytest.approx(tlp, abs=1e-6)
        # Padding beams (fewer candidates than beams) are dead.
        assert torch.all(out.scores[r, n_real:] == float("-inf"))
    assert not torch.isnan(out.scores).any()


DEAD_BEAMS_CELLS = {0: [(0, 1), (1, 4)], 1: [(0, 0)], 2: [(0, 3), (0, 5), (1, 8)]}


def dead_beam_case() -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows x 2 previous beams x vocab 9 where only DEAD_BEAMS_CELLS (row -> (beam,
    token)) are finite: fewer finite candidates than the 6 beams asked for.
    Returns (scores [3, 2], log-probs [3, 2, 9])."""
    lp = torch.full((3, 2, 9), float("-inf"))
    for r, cells in DEAD_BEAMS_CELLS.items():
        for b, v in cells:
            lp[r, b, v] = -1.0 - 0.1 * v
    scores = torch.tensor([[0.0, -2.0], [-1.0, float("-inf")], [-0.5, -0.7]])
    return scores, lp


def test_dead_beams_never_beat_finite_ones():
    """Exactly m < B finite candidates: all m are kept, first, for every seed."""
    rows, num_beams = 3, 6
    scores, lp = dead_beam_case()
    finite = DEAD_BEAMS_CELLS
    for seed in range(50):
        for greedy_flag in (True, False):
            greedy = torch.full((rows,), greedy_flag)
            torch.manual_seed(seed)
            out = select_beams(scores, lp, num_beams, greedy)
            for r, cells in finite.items():
                m = len(cells)
                got = {(int(out.parents[r, i]), int(out.tokens[r, i])) for i in range(m)}
                assert got == set(cells)
                assert torch.isfinite(out.scores[r, :m]).all()
                assert torch.all(out.scores[r, m:] == float("-inf"))


def ordered_pair_probs(joint: list[float]) -> dict[tuple[int, int], float]:
    """Law of the first two draws without replacement, each in proportion to joint prob."""
    total = sum(joint)
    probs = {}
    for i, j in itertools.permutations(range(len(joint)), 2):
        pi = joint[i] / total
        probs[(i, j)] = pi * joint[j] / (total - joint[i])
    return probs


def test_sampled_selection_frequencies_match_joint_probabilities():
    """Chi-square: ordered (first, second) draws over 2 beams x 3 tokens."""
    scores = torch.tensor([[math.log(0.6), math.log(0.4)]])
    lp = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]]).log()
    joint = (scores.unsqueeze(-1) + lp).exp().flatten().tolist()
    law = ordered_pair_probs(joint)
    n = 60000
    # Batch the trials as rows: every row is the same request, independently sampled.
    torch.manual_seed(1234)
    out = select_beams(
        scores.expand(n, -1), lp.expand(n, -1, -1), 2, torch.zeros(n, dtype=torch.bool)
    )
    first = (out.parents[:, 0] * 3 + out.tokens[:, 0]).tolist()
    second = (out.parents[:, 1] * 3 + out.tokens[:, 1]).tolist()
    counts = dict.fromkeys(law, 0)
    for a, b in zip(first, second):
        counts[(a, b)] += 1
    keys = sorted(law)
    observed = [counts[k] for k in keys]
    expected = [law[k] * n for k in keys]
    chi2, pval = stats.chisquare(observed, expected)
    assert pval > 1e-3, (chi2, pval, observed, expected)
    # The joint scores of the kept beams are the true joint log-probs.
    flat = (scores.unsqueeze(-1) + lp).flatten()
    torch.testing.assert_close(out.scores[:, 0], flat[out.parents[:, 0] * 3 + out.tokens[:, 0]])


def test_first_step_draws_distinct_tokens_in_proportion():
    """First step = one empty beam: B distinct tokens; first draw ~ q (chi-square)."""
    q = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    n, num_beams = 40000, 3
    torch.manual_seed(7)
    state = BeamSearchState.start(n, num_beams, "cpu").step(
        q.log().expand(n, -1), torch.zeros(n, dtype=torch.bool)
    )
    toks = state.tokens[:, :, 0]
    assert state.tokens.shape == (n, num_beams, 1)
    # Distinct within every row.
    assert (toks.sort(dim=1).values.diff(dim=1) != 0).all()
    counts = torch.bincount(toks[:, 0], minlength=5).tolist()
    _, pval = stats.chisquare(counts, (q * n).tolist())
    assert pval > 1e-3
    # Inclusion in the kept set: compare with exact enumeration of ordered triples.
    incl = torch.zeros(5)
    for perm in itertools.permutations(range(5), 3):
        p, rest = 1.0, 1.0
        for t in perm:
            p *= float(q[t]) / rest
            rest -= float(q[t])
        for t in perm:
            incl[t] += p
    emp = torch.stack([(toks == t).any(1).float().mean() for t in range(5)])
    torch.testing.assert_close(emp, incl, atol=0.015, rtol=0)


# --------------------------------------------------------------------------------------
# Streaming selection (one beam at a time, as the vLLM drafter feeds it)
# --------------------------------------------------------------------------------------


def stream(scores, lp, num_beams, greedy, generators=None, seed=0):
    """Feed every row's beams in a random per-row order."""
    rows, prev_beams, _ = lp.shape
    g = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(prev_beams, generator=g) for _ in range(rows)])
    sel = StreamingSelector(scores, num_beams, greedy, generators)
    for i in range(prev_beams):
        parent = order[:, i]
        sel.add(parent, lp[torch.arange(rows), parent])
    return sel.result()


@pytest.mark.parametrize(
    "prev_beams,vocab,num_beams", [(3, 5, 4), (4, 6, 4), (2, 3, 8), (8, 40, 8)]
)
def test_streaming_greedy_equals_select_beams(prev_beams, vocab, num_beams):
    torch.manual_seed(vocab)
    rows = 7
    scores = torch.randn(rows, prev_beams) * 2
    scores[2, -1] = float("-inf")
    lp = torch.randn(rows, prev_beams, vocab).log_softmax(-1)
    lp[3, :, : vocab // 2] = float("-inf")
    greedy = torch.ones(rows, dtype=torch.bool)
    want = select_beams(scores, lp, num_beams, greedy)
    for seed in range(3):
        got = stream(scores, lp, num_beams, greedy, seed=seed)
        finite = torch.isfinite(want.scores)
        assert torch.equal(torch.isfinite(got.scores), finite)
        torch.testing.assert_close(got.scores[finite], want.scores[finite])
        assert torch.equal(got.parents[finite], want.parents[finite])
        assert torch.equal(got.tokens[finite], want.tokens[finite])
        torch.testing.assert_close(got.token_logprobs[finite], want.token_logprobs[finite])


def test_streaming_sampled_frequencies_match_joint_probabilities():
    scores = torch.tensor([[math.log(0.6), math.log(0.4)]])
    lp = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]]]).log()
    joint = (scores.unsqueeze(-1) + lp).exp().flatten().tolist()
    law = ordered_pair_probs(joint)
    n = 60000
    torch.manual_seed(4321)
    got = stream(scores.expand(n, -1), lp.expand(n, -1, -1), 2, torch.zeros(n, dtype=torch.bool))
    first = (got.parents[:, 0] * 3 + got.tokens[:, 0]).tolist()
    second = (got.parents[:, 1] * 3 + got.tokens[:, 1]).tolist()
    counts = dict.fromkeys(law, 0)
    for a, b in zip(first, second):
        counts[(a, b)] += 1
    keys = sorted(law)
    _, pval = stats.chisquare([counts[k] for k in keys], [law[k] * n for k in keys])
    assert pval > 1e-3


def test_streaming_dead_beams_and_seeds():
    rows, prev_beams, vocab, num_beams = 3, 2, 9, 6
    scores, lp = dead_beam_case()
    finite = DEAD_BEAMS_CELLS
    greedy = torch.zeros(rows, dtype=torch.bool)
    for seed in range(20):
        got = stream(scores, lp, num_beams, greedy, gens({0: seed, 2: seed + 1}), seed=seed)
        for r, cells in finite.items():
            m = len(cells)
            assert {(int(got.parents[r, i]), int(got.tokens[r, i])) for i in range(m)} == set(cells)
            assert torch.all(got.scores[r, m:] == float("-inf"))
    # Seeded rows: same generator seed and feeding order -> same selection.
    lp2 = torch.randn(rows, prev_beams, vocab).log_softmax(-1)
    a = stream(scores, lp2, 4, greedy, gens({0: 9, 1: 9, 2: 9}), seed=1)
    b = stream(scores, lp2, 4, greedy, gens({0: 9, 1: 9, 2: 9}), seed=1)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


# --------------------------------------------------------------------------------------
# Whole search
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "vocab,num_beams,depth,top_k",
    [(5, 1, 3, None), (6, 3, 4, None), (4, 4, 3, 2), (7, 8, 2, 3), (5, 2, 1, None)],
)
def test_beam_search_matches_slow_reference(vocab, num_beams, depth, top_k):
    rows = 5
    model = TableModel(rows, vocab, seed=vocab * 10 + num_beams, top_k=top_k)
    greedy = torch.tensor([True, False, False, True, False])
    seeds = {1: 5, 2: 6, 4: 8}
    tokens, q, state = beam_search(model.batched, rows, num_beams, depth, greedy, gens(seeds))
    assert tokens.shape == (rows, depth) and q.shape == (rows, depth)
    ref_g = gens(seeds)
    for r in range(rows):
        want_t, want_q = ref_beam_search_one(
            lambda prefix, r=r: model.row_lp(r, prefix),
            num_beams,
            depth,
            None if greedy[r] else ref_g[r],
        )
        assert tokens[r].tolist() == want_t
        assert q[r].tolist() == pytest.approx(want_q, abs=1e-6)
        # q_j is the per-token probability on the chosen beam, not a beam score.
        prefix: tuple[int, ...] = ()
        for j, t in enumerate(want_t):
            assert q[r, j].item() == pytest.approx(math.exp(model.row_lp(r, prefix)[t]), abs=1e-6)
            prefix += (t,)
        assert float(q[r].log().sum()) == pytest.approx(float(state.scores[r].max()), abs=1e-4)


@pytest.mark.parametrize("vocab,depth", [(3, 3), (4, 2), (2, 4)])
def test_greedy_equals_exhaustive_when_beams_cover_all_prefixes(vocab, depth):
    """With B >= V^(depth-1) no prefix is ever dropped: the best beam is the argmax over
    all V^depth sequences."""
    num_beams = vocab ** (depth - 1)
    rows = 4
    model = TableModel(rows, vocab, seed=99 + vocab)
    tokens, q, _ = beam_search(
        model.batched, rows, num_beams, depth, torch.ones(rows, dtype=torch.bool)
    )
    for r in range(rows):
        best, best_lp = None, float("-inf")
        for seq in itertools.product(range(vocab), repeat=depth):
            lp = sum(model.row_lp(r, seq[:j])[seq[j]] for j in range(depth))
            if lp > best_lp:
                best, best_lp = list(seq), lp
        assert tokens[r].tolist() == best
        assert float(q[r].log().sum()) == pytest.approx(best_lp, abs=1e-4)


def test_beam_search_can_beat_greedy_path():
    """A case where the greedy first token leads nowhere: B=2 finds the better pair."""

    # Token 0 first (0.55) then nearly flat; token 1 first (0.45) then 0.99.
    def lp(tokens: torch.Tensor) -> torch.Tensor:
        rows, width, d = tokens.shape
        out = torch.empty(rows, width, 4)
        for b in range(width):
            if d == 0:
                p = torch.tensor([0.55, 0.45, 0.0, 0.0])
            elif int(tokens[0, b, 0]) == 0:
                p = torch.tensor([0.3, 0.25, 0.25, 0.2])
            else:
                p = torch.tensor([0.0, 0.0, 0.99, 0.01])
            out[:, b] = p.log()
        return out

    greedy = torch.ones(1, dtype=torch.bool)
    t1, _, _ = beam_search(lp, 1, 1, 2, greedy)
    t2, q2, _ = beam_search(lp, 1, 2, 2, greedy)
    assert t1.tolist() == [[0, 0]]
    assert t2.tolist() == [[1, 2]]
    torch.testing.assert_close(q2, torch.tensor([[0.45, 0.99]]))


def test_topk_smaller_than_beams_does_not_crash_or_pick_dead_beam():
    """top-k = 1 with B = 4: only one finite path exists and it must be returned."""
    rows, vocab, num_beams, depth = 3, 6, 4, 4
    model = TableModel(rows, vocab, seed=5, top_k=1)
    for greedy_flag in (True, False):
        greedy = torch.full((rows,), greedy_flag)
        tokens, q, state = beam_search(model.batched, rows, num_beams, depth, greedy)
        assert not torch.isnan(state.scores).any()
        assert (q > 0).all()
        for r in range(rows):
            prefix: tuple[int, ...] = ()
            for j in range(depth):
                lp = model.row_lp(r, prefix)
                assert lp[int(tokens[r, j])] == 0.0  # the only kept token
                prefix += (int(tokens[r, j]),)
            assert torch.isfinite(state.scores[r]).sum() == 1


def test_seeded_rows_are_reproducible_and_batch_independent():
    vocab, num_beams, depth = 11, 4, 3
    model = TableModel(4, vocab, seed=3)
    greedy = torch.zeros(4, dtype=torch.bool)
    a, qa, _ = beam_search(model.batched, 4, num_beams, depth, greedy, gens({0: 42, 2: 7}))
    torch.manual_seed(12345)  # different global RNG for the unseeded rows
    b, qb, _ = beam_search(model.batched, 4, num_beams, depth, greedy, gens({0: 42, 2: 7}))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    torch.testing.assert_close(qa[[0, 2]], qb[[0, 2]])

    # Row 0 alone (its own batch of one row) gives the same draft as inside the batch.
    class RowZero(TableModel):
        def batched(self, tokens):
            out = torch.empty(tokens.shape[0], tokens.shape[1], self.vocab)
            for b in range(tokens.shape[1]):
                out[0, b] = torch.tensor(self.row_lp(0, tuple(tokens[0, b].tolist())))
            return out

    solo, _, _ = beam_search(
        RowZero(1, vocab, seed=3).batched, 1, num_beams, depth, greedy[:1], gens({0: 42})
    )
    assert torch.equal(solo[0], a[0])

    # A different seed changes the sampled beams somewhere over a few tries.
    diffs = 0
    for s in range(5):
        c, _, st = beam_search(model.batched, 4, num_beams, depth, greedy, gens({0: 100 + s}))
        diffs += int(not torch.equal(c[0], a[0]))
    assert diffs > 0


def test_recompute_tail_cost():
    assert recompute_tail_cost(4, 4) == 4 * (1 + 2 + 3)
    assert recompute_tail_cost(1, 2) == 1
    assert recompute_tail_cost(8, 1) == 0


@pytest.mark.parametrize(
    "vocab,num_beams,depth,top_k",
    [(5, 1, 3, None), (6, 3, 4, None), (4, 4, 3, 2), (7, 8, 2, 3), (5, 2, 1, None)],
)
def test_batched_search_with_a_model_callback_matches_slow_reference(
    vocab, num_beams, depth, top_k
):
    """beam_search_batched (the in-vLLM drafter's search: one model call per depth, beams
    fed to the selector one at a time) drafts what the slow reference drafts on greedy
    rows, with the same per-token q."""
    from vllm_specx.algorithms.beam_draft import beam_search_batched

    rows = 4
    model = TableModel(rows, vocab, seed=vocab * 7 + num_beams, top_k=top_k)
    greedy = torch.ones(rows, dtype=torch.bool)
    calls = []

    def forward(state):
        calls.append(state.tokens.shape)
        lp = model.batched(state.tokens)  # [R, B, V]

        def beam_logprobs(beam):
            return lp[torch.arange(rows), beam]

        return beam_logprobs

    first = model.batched(torch.zeros(rows, 1, 0, dtype=torch.long))[:, 0]
    tokens, q, _ = beam_search_batched(first, depth, num_beams, forward, greedy)
    assert len(calls) == depth - 1  # one model call (one draft pass) per depth after the first
    for r in range(rows):
        want_t, want_q = ref_beam_search_one(
            lambda prefix, r=r: model.row_lp(r, prefix), num_beams, depth, None
        )
        assert tokens[r].tolist() == want_t
        assert q[r].tolist() == pytest.approx(want_q, abs=1e-6)


def test_row_width_one_on_greedy_rows_is_the_argmax_chain():
    """row_width = 1 keeps only the best beam of a greedy row: the B = 1 search's tokens
    and q; rows left at full width are untouched."""
    from vllm_specx.algorithms.beam_draft import beam_search_batched

    rows, vocab, depth, num_beams = 3, 6, 4, 4
    model = TableModel(rows, vocab, seed=11)
    greedy = torch.ones(rows, dtype=torch.bool)
    fed = []

    def forward(state):
        fed.append(torch.isfinite(state.scores).sum(dim=1).tolist())
        lp = model.batched(state.tokens)
        return lambda beam: lp[torch.arange(rows), beam]

    first = model.batched(torch.zeros(rows, 1, 0, dtype=torch.long))[:, 0]
    width = torch.tensor([1, num_beams, 1])
    tokens, q, _ = beam_search_batched(first, depth, num_beams, forward, greedy, row_width=width)
    chain, chain_q, _ = beam_search_batched(first, depth, 1, forward, greedy)
    wide, wide_q, _ = beam_search_batched(first, depth, num_beams, forward, greedy)
    for r in (0, 2):
        assert tokens[r].tolist() == chain[r].tolist()
        assert q[r].tolist() == pytest.approx(chain_q[r].tolist(), abs=1e-6)
    assert tokens[1].tolist() == wide[1].tolist()
    assert fed[0] == [1, num_beams, 1]  # a narrowed row keeps one live beam to feed


def _row_callback(model: TableModel, rows: list[int], fed: list | None = None):
    """A model callback over ``rows`` of ``model`` (row i of the search is model row
    rows[i]); ``fed`` collects, per call, the search rows that have a live beam."""

    def forward(state):
        live = torch.isfinite(state.scores)
        if fed is not None:
            fed.append(live.any(dim=1).nonzero().squeeze(1).tolist())
        lp = torch.zeros(len(rows), state.width, model.vocab)
        for i, r in enumerate(rows):
            for b in range(state.width):
                if live[i, b]:  # dead beams and finished rows cost the callback nothing
                    lp[i, b] = torch.tensor(model.row_lp(r, tuple(state.tokens[i, b].tolist())))
        return lambda beam: lp[torch.arange(len(rows)), beam]

    first = torch.stack([torch.tensor(model.row_lp(r, ())) for r in rows])
    return forward, first


@pytest.mark.parametrize("vocab,num_beams,depth,top_k", [(6, 3, 4, None), (5, 4, 3, 2),
                                                         (7, 1, 4, None)])
def test_row_depth_caps_equal_each_rows_own_search(vocab, num_beams, depth, top_k):
    """Per-row depths (cost control, mtad): a greedy row capped at d drafts exactly what
    the slow reference's depth-d search of that row alone drafts (its best beam over its d
    tokens, with its q), zeros past d; a row at depth 0 drafts nothing; and a row whose
    depth is reached has no live beam in any later call (it takes no rows there)."""
    from vllm_specx.algorithms.beam_draft import beam_search_batched

    caps = [depth, 0, 1, 2, depth - 1, 3]
    rows = list(range(len(caps)))
    model = TableModel(len(rows), vocab, seed=vocab * 13 + num_beams, top_k=top_k)
    greedy = torch.ones(len(rows), dtype=torch.bool)
    fed: list[list[int]] = []
    forward, first = _row_callback(model, rows, fed)
    tokens, q, _ = beam_search_batched(first, depth, num_beams, forward, greedy,
                                       row_depth=torch.tensor(caps))
    assert tokens.shape == (len(rows), depth) and q.shape == (len(rows), depth)
    for r, cap in enumerate(caps):
        if cap:
            want_t, want_q = ref_beam_search_one(
                lambda prefix, r=r: model.row_lp(r, prefix), num_beams, cap, None)
            assert tokens[r, :cap].tolist() == want_t, (r, cap)
            assert q[r, :cap].tolist() == pytest.approx(want_q, abs=1e-6)
        assert tokens[r, cap:].tolist() == [0] * (depth - cap)
        assert q[r, cap:].tolist() == [0.0] * (depth - cap)
    # One call per depth after the first, up to the deepest row; the call that feeds
    # token j's beams (j = 1..) carries exactly the rows capped deeper than j.
    assert len(fed) == max(caps) - 1
    for j, live_rows in enumerate(fed, start=1):
        assert live_rows == [r for r, c in enumerate(caps) if c > j], (j, live_rows)


def test_row_depth_seeded_sampled_rows_equal_their_own_search_and_generator():
    """Sampled seeded rows capped at d: the tokens and q of a depth-d search of that row
    alone with the same seed, and the generator left exactly where that search leaves it
    (a finished row draws nothing more; a row at depth 0 draws nothing at all), so the
    verifier's draws after the round do not depend on the other rows' depths. With
    row_width 1 on a greedy row the cap applies to its argmax chain too."""
    from vllm_specx.algorithms.beam_draft import beam_search_batched

    vocab, num_beams, depth = 9, 3, 4
    caps = [2, 4, 0, 3, 1]
    seeds = {0: 11, 1: 12, 2: 13, 3: 14}
    greedy = torch.tensor([False, False, False, False, True])
    width = torch.tensor([3, 3, 3, 3, 1])
    model = TableModel(len(caps), vocab, seed=5)
    forward, first = _row_callback(model, list(range(len(caps))))
    generators = gens(seeds)
    tokens, q, _ = beam_search_batched(first, depth, num_beams, forward, greedy, generators,
                                       row_width=width, row_depth=torch.tensor(caps))
    for r, cap in enumerate(caps):
        solo_gens = gens({0: seeds[r]}) if r in seeds else None
        if cap:
            solo_fwd, solo_first = _row_callback(model, [r])
            want, want_q, _ = beam_search_batched(
                solo_first, cap, num_beams, solo_fwd, greedy[r:r + 1], solo_gens,
                row_width=width[r:r + 1])
            assert tokens[r, :cap].tolist() == want[0].tolist(), (r, cap)
            assert q[r, :cap].tolist() == pytest.approx(want_q[0].tolist(), abs=1e-6)
        if r in seeds:
            left = solo_gens[0] if cap else torch.Generator().manual_seed(seeds[r])
            assert torch.equal(generators[r].get_state(), left.get_state()), r
