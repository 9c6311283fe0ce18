"""Slow, obviously-correct reference for draft-tree verification, plus random tree batches.

The reference walks ONE request at a time with plain Python loops over float64 numbers,
reading the rules of ``vllm_specx.algorithms.draft_tree`` literally: ``p'`` is kept as a
normalised distribution and renormalised after every rejection. Like
``verify_reference`` it reports whether a request's outcome is *fragile*: decided by a
comparison closer than float32 rounding (``u`` within 1e-6 relative of ``p'/q``, ``S``
within ~1e-4 of ``log tau``, two tied MTAD candidates' joint draft probabilities within
1e-5, or two extra-token race scores within 1e-5 relative). The float32 implementation
may decide those the other way, so exact-match tests skip them and assert they are rare.

Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from verify_reference import race

from vllm_specx.algorithms.draft_tree import TreeBatch, verify_tree

TREE_VARIANTS = ("sampled", "deterministic", "mtad")


@dataclass
class TreeCase:
    """Everything one ``verify_tree`` call takes."""

    batch: TreeBatch
    node_probs: torch.Tensor
    rule: str
    is_greedy: torch.Tensor
    uniforms: torch.Tensor
    exp_noise: torch.Tensor
    target_argmax: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    draft_token_probs: torch.Tensor | None = None
    acceptance_threshold: float = 1.0

    def run(self):
        return verify_tree(
            self.batch,
            self.node_probs,
            rule=self.rule,
            is_greedy=self.is_greedy,
            uniforms=self.uniforms,
            exp_noise=self.exp_noise,
            target_argmax=self.target_argmax,
            draft_probs=self.draft_probs,
            draft_token_probs=self.draft_token_probs,
            acceptance_threshold=self.acceptance_threshold,
        )


def reference_verify_tree(case: TreeCase) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """Per request: (emitted tokens, accepted node indices, fragile flag)."""
    batch = case.batch
    cu = batch.cu_num_nodes.tolist()
    tokens = batch.token_ids.tolist()
    parents = batch.parents.tolist()
    probs = case.node_probs.double().numpy()
    vocab = probs.shape[1]
    argmax = (case.node_probs.argmax(-1) if case.target_argmax is None
              else case.target_argmax).tolist()
    greedy = case.is_greedy.tolist()
    uniforms = case.uniforms.double().tolist()
    noise = case.exp_noise.double().numpy()
    q_rows = None if case.draft_probs is None else case.draft_probs.double().numpy()
    q_tok = None if case.draft_token_probs is None else case.draft_token_probs.double().tolist()
    log_tau = math.log(case.acceptance_threshold)
    outputs, paths, fragile_flags = [], [], []
    for b in range(len(cu)):
        start = cu[b - 1] if b else 0
        n = cu[b] - start
        xs = tokens[start:start + n]
        par = parents[start:start + n]

        def row(node: int) -> int:  # node_probs row after `node`'s path (-1 = root)
            return start + b + 1 + node  # noqa: B023 (start, b: this request's)

        def children(node: int) -> list[int]:
            return [i for i in range(n) if par[i] == node]  # noqa: B023

        def ok(x: int) -> bool:
            return 0 <= x < vocab

        fragile = False
        path: list[int] = []
        cur = -1
        if greedy[b]:
            while True:
                hit = [c for c in children(cur) if xs[c] == argmax[row(cur)]]
                if not hit:
                    break
                cur = hit[0]
                path.append(cur)
            extra = argmax[row(cur)]
        elif case.rule == "sampled":
            p_cur = probs[row(cur)].copy()
            while True:
                moved = False
                for c in children(cur):
                    x = xs[c]
                    q = q_rows[start + c]
                    u = uniforms[start + c]
                    if not ok(x) or q[x] <= 0:
                        accept = False
                    else:
                        accept = u < p_cur[x] / q[x]
                        fragile |= abs(u * q[x] - p_cur[x]) <= 1e-6 * max(p_cur[x], u * q[x])
                    if accept:
                        cur = c
                        path.append(c)
                        p_cur = probs[row(c)].copy()
                        moved = True
                        break
                    residual = np.maximum(p_cur - q, 0.0)
                    if residual.sum() > 0:  # else p' stays as it was
                        p_cur = residual / residual.sum()
                if not moved:
                    break
            extra, race_fragile = race(p_cur, noise[b])
            fragile |= race_fragile
        elif case.rule == "deterministic":
            # p' = p without the rejected tokens, normalised by 1 - their mass.
            while True:
                moved = False
                p_row = probs[row(cur)]
                rejected: set[int] = set()
                mass = 1.0
                for c in children(cur):
                    x = xs[c]
                    u = uniforms[start + c]
                    p_x = p_row[x] if ok(x) and x not in rejected else 0.0
                    accept = p_x > 0 and u * mass < p_x
                    fragile |= p_x > 0 and abs(u * mass - p_x) <= 1e-6 * max(p_x, u * mass) + 1e-6
                    if accept:
                        cur = c
                        path.append(c)
                        moved = True
                        break
                    if ok(x) and x not in rejected:
                        rejected.add(x)
                        mass -= p_row[x]
                if not moved:
                    break
            residual = probs[row(cur)].copy()
            for x in rejected:
                residual[x] = 0.0
            if residual.sum() <= 0:
                residual = probs[row(cur)]
            extra, race_fragile = race(residual, noise[b])
            fragile |= race_fragile
        else:  # mtad
            s = [0.0] * n
            joint = [0.0] * n
            depth = [0] * n
            magnitude = [0.0] * n
            for i in range(n):  # parents come first, so theirs are ready
                x = xs[i]
                p = probs[row(par[i])][x] if ok(x) else 0.0
                q = q_tok[start + i]
                good = p > 0 and q > 0
                term = math.log(p) - math.log(q) if good else -math.inf
                lq = math.log(q) if good else -math.inf
                up = par[i]
                s[i] = term + (s[up] if up >= 0 else 0.0)
                joint[i] = lq + (joint[up] if up >= 0 else 0.0)
                depth[i] = 1 + (depth[up] if up >= 0 else 0)
                magnitude[i] = (abs(term) if good else 0.0) + (magnitude[up] if up >= 0 else 0.0)
                if math.isfinite(s[i]) and magnitude[i] > 0:
                    fragile |= abs(s[i] - log_tau) <= 1e-4 * (1.0 + magnitude[i])
            passing = [i for i in range(n) if s[i] > log_tau]
            if passing:
                deepest = max(depth[i] for i in passing)
                tied = [i for i in passing if depth[i] == deepest]
                best = max(joint[i] for i in tied)
                cur = min(i for i in tied if joint[i] == best)
                fragile |= any(0 < abs(joint[i] - best) <= 1e-5 * (1 + abs(best)) for i in tied)
            node = cur
            while node >= 0:
                path.insert(0, node)
                node = par[node]
            extra, race_fragile = race(probs[row(cur)], noise[b])
            fragile |= race_fragile
        outputs.append([xs[i] for i in path] + [extra])
        paths.append(path)
        fragile_flags.append(fragile)
    return outputs, paths, fragile_flags


def output_rows(out: torch.Tensor) -> list[list[int]]:
    """[B, D + 1] output -> emitted tokens per request (asserting the -1 padding)."""
    rows = []
    for r in out.tolist():
        emitted = [t for t in r if t != -1]
        assert r[: len(emitted)] == emitted, f"-1 inside the emitted prefix: {r}"
        rows.append(emitted)
    return rows


# ----------------------------------------------------------------------------- random data


def _probs(g: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """[rows, V] float32 distributions with exact zeros and, sometimes, exact ties."""
    scale = 0.5 + 2.5 * float(torch.rand((), generator=g))
    logits = torch.randn(rows, vocab, generator=g) * scale
    if float(torch.rand((), generator=g)) < 0.3:
        logits = logits.round()
    drop = torch.rand(rows, vocab, generator=g) < 0.25
    drop[:, 0] &= False  # at least one token survives
    return logits.masked_fill(drop, -math.inf).softmax(-1)


def random_tree_case(seed: int, variant: str, max_batch: int = 12, max_nodes: int = 9,
                     vocab: int | None = None) -> TreeCase:
    """A random ragged batch of random trees (parents any earlier node or the root),
    mixed greedy/sampled requests, probabilities with zeros and ties, duplicate sibling
    tokens (small vocabularies), off-support and out-of-range tokens."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=g))

    v = vocab if vocab is not None else randint(2, 12)
    b = randint(1, max_batch)
    num = torch.randint(0, max_nodes + 1, (b,), generator=g)
    if float(torch.rand((), generator=g)) < 0.1:
        num[:] = 0
    t = int(num.sum())
    parents = []
    for n in num.tolist():
        for i in range(n):
            # Bias towards chains and bushy roots alike.
            parents.append(randint(-1, i - 1))
    parents_t = torch.tensor(parents, dtype=torch.int64)
    cu = num.cumsum(0)
    starts = (cu - num).tolist()
    node_probs = _probs(g, t + b, v)
    target_argmax = None
    if float(torch.rand((), generator=g)) < 0.5:
        target_argmax = v - 1 - node_probs.flip(-1).argmax(-1)  # the LAST maximum
    greedy_token = node_probs.argmax(-1) if target_argmax is None else target_argmax
    # Each node's parent row, the row its token is checked against.
    req = torch.repeat_interleave(torch.arange(b), num)
    start_of = torch.tensor(starts, dtype=torch.int64)[req]
    parent_row = start_of + req + 1 + parents_t
    # q rows: one per parent (siblings share it), close to the target's.
    q_per_row = 0.5 * node_probs + 0.5 * _probs(g, t + b, v)  # column 0 stays > 0
    zero = torch.rand(t + b, v, generator=g) < 0.15
    zero[:, 0] = False
    q_per_row = q_per_row.masked_fill(zero, 0.0)
    q_per_row = q_per_row / q_per_row.sum(-1, keepdim=True)
    draft_probs = q_per_row[parent_row] if t else torch.zeros(0, v)
    if t:
        tokens = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
    else:
        tokens = torch.zeros(0, dtype=torch.int64)
    r = torch.rand(t, generator=g)
    tokens = torch.where(r < 0.35, greedy_token[parent_row] if t else tokens, tokens)
    tokens = torch.where((r > 0.9) & (r < 0.96), torch.randint(0, v, (t,), generator=g), tokens)
    tokens = torch.where(r > 0.985, torch.full_like(tokens, -1), tokens)
    tokens = torch.where((r > 0.97) & (r <= 0.985), torch.full_like(tokens, v), tokens)
    case = TreeCase(
        batch=TreeBatch(tokens, parents_t, cu),
        node_probs=node_probs,
        rule=variant,
        is_greedy=torch.rand(b, generator=g) < 0.3,
        uniforms=torch.rand(t, generator=g),
        exp_noise=torch.empty(b, v).exponential_(generator=g),
        target_argmax=target_argmax,
    )
    if variant == "sampled":
        case.draft_probs = draft_probs.float()
    elif variant == "mtad":
        safe = tokens.clamp(0, v - 1)
        q_tok = draft_probs.gather(1, safe[:, None]).squeeze(1) if t else torch.zeros(0)
        q_tok = torch.where(torch.rand(t, generator=g) < 0.05, torch.zeros_like(q_tok), q_tok)
        case.draft_token_probs = q_tok.float()
        case.acceptance_threshold = float(torch.empty(()).uniform_(0.05, 1.0, generator=g))
    return case


# ----------------------------------------------------------------------------- tree building


def reference_tree_from_beams(tokens, parents, scores, max_nodes, sibling_order="score"):
    """Per request, a dict trie: {path tuple: (score, first (depth, column))}, the best
    ``max_nodes`` by (score desc, depth, column), in BFS order. Returns per request a list
    of (path, parent index, score, (depth, column)) in the output order."""
    depth_count = len(tokens)
    b = tokens[0].shape[0]
    result = []
    for r in range(b):
        seq: list[list[tuple[int, ...] | None]] = []  # each candidate's token path
        eff: list[list[float]] = []
        trie: dict[tuple[int, ...], tuple[float, tuple[int, int]]] = {}
        for d in range(depth_count):
            seq.append([])
            eff.append([])
            for c in range(tokens[d].shape[1]):
                s = float(scores[d][r, c])
                alive = not math.isnan(s) and s > -math.inf
                prefix: tuple[int, ...] | None = ()
                if d:
                    pc = int(parents[d][r, c])
                    prefix = seq[d - 1][pc]
                    if prefix is None:
                        alive = False
                    else:
                        s = min(s, trie[prefix][0])  # capped by the parent NODE's score
                if not alive:
                    seq[d].append(None)
                    eff[d].append(-math.inf)
                    continue
                path = (*prefix, int(tokens[d][r, c]))
                seq[d].append(path)
                eff[d].append(s)
                if path not in trie:
                    trie[path] = (s, (d, c))
        ranked = sorted(trie.items(), key=lambda kv: (-kv[1][0], kv[1][1]))[:max_nodes]
        kept = dict(ranked)
        order: list[tuple[int, ...]] = []
        for d in range(1, depth_count + 1):
            level = [p for p in kept if len(p) == d]
            if sibling_order == "score":
                level.sort(key=lambda p: (-kept[p][0], kept[p][1]))
            else:
                level.sort(key=lambda p: kept[p][1])
            # stable: by parent's index, keeping the sibling order
            level.sort(key=lambda p: order.index(p[:-1]) if len(p) > 1 else -1)
            order += level
        result.append([
            (p, order.index(p[:-1]) if len(p) > 1 else -1, kept[p][0], kept[p][1]) for p in order
        ])
    return result
