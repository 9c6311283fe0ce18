"""MTAD: verify all B beams as one tree, or only the best beam? A pure-algorithm estimate.

Synthetic bigram "models" (no vLLM, no weights): a peaky target ``P[prev]`` over V tokens
and a drafter that knows it imperfectly (``log q = log p + noise``, renormalised). Each
round starts from a random context token, runs MTAD's beam search
(``beam_draft.beam_search``: B beams, depth K, sampled at T = 1) and verifies either

* the single best beam as a chain (``verify.verify``, rule ``"mtad"``), or
* every beam at once as one tree (``draft_tree.tree_from_beams`` + ``verify_tree``,
  rule ``"mtad"``, and also ``"deterministic"``, which is lossless for beams).

It reports block efficiency (tokens emitted per round = accepted + 1) and the target's
perplexity of the emitted tokens (``exp`` of their mean ``-log P[prev][token]``), next to
the target's own perplexity at the same contexts (``exp`` of the mean entropy of
``P[prev]``: what sampling from P there would give; a lossless rule matches it). Every
round is independent, so the numbers are per-round averages over ``--rounds`` rounds
(vectorised, one call per variant).

    python benchmarks/tree_mtad_simulation.py --rounds 20000

This is an estimate on toy models, not the engine measurement issue 37 asks for (fixture
and real pair, in vLLM); it says which way the effect goes and why.
"""

from __future__ import annotations

import argparse
import math

import torch

from vllm_specx.algorithms.beam_draft import beam_search
from vllm_specx.algorithms.draft_tree import TreeBatch, tree_from_beams, verify_tree
from vllm_specx.algorithms.verify import VerifyBatch, verify


def models(vocab: int, sharpness: float, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = sharpness * torch.randn(vocab, vocab, generator=g)
    p = target_logits.softmax(-1)
    q = (target_logits + noise * torch.randn(vocab, vocab, generator=g)).softmax(-1)
    return p, q


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    p, q = models(args.vocab, args.sharpness, args.noise, args.seed)
    n, b, k, v = args.rounds, args.beams, args.depth, args.vocab
    context = torch.randint(0, v, (n,))
    log_q = q.log()

    def next_logprobs(tokens: torch.Tensor) -> torch.Tensor:
        last = context[:, None].expand(-1, tokens.shape[1]) if tokens.shape[2] == 0 \
            else tokens[:, :, -1]
        return log_q[last]

    greedy = torch.zeros(n, dtype=torch.bool)
    best, best_q, state = beam_search(next_logprobs, n, b, k, greedy)

    entropy = -(p * p.log()).sum(-1)  # [V]: the target's entropy after each token

    def nll(out: torch.Tensor) -> tuple[float, float, float]:
        """(block efficiency, perplexity of the emitted tokens under the target, the
        target's own perplexity at the same contexts: what sampling from P would give)."""
        prev = torch.cat([context[:, None], out[:, :-1]], dim=1).clamp(min=0)
        emitted = out >= 0
        logp = p[prev, out.clamp(min=0)].log()
        total = float(emitted.sum())
        own = float(entropy[prev][emitted].sum()) / total
        return total / n, math.exp(-float(logp[emitted].sum()) / total), math.exp(own)

    noise = torch.empty(n, v).exponential_()
    results: dict[str, tuple[float, float, float]] = {}

    # The best beam as a chain.
    prev = torch.cat([context[:, None], best[:, :-1]], dim=1)
    chain = VerifyBatch(
        rule="mtad", draft_token_ids=best.reshape(-1),
        cu_num_draft_tokens=torch.arange(1, n + 1) * k,
        target_probs=p[prev].reshape(-1, v), bonus_probs=p[best[:, -1]],
        is_greedy=greedy, uniforms=torch.rand(n * k), exp_noise=noise, max_spec_len=k,
        draft_token_probs=best_q.reshape(-1), acceptance_threshold=args.tau,
    )
    results["best beam, chain, mtad"] = nll(verify(chain))

    # Every beam as one tree (what glue/mtad_proposer.py builds).
    live = torch.isfinite(state.scores)
    logq = state.token_logprobs.masked_fill(~live[:, :, None], -math.inf)
    cum = logq.cumsum(dim=2)
    cols = torch.arange(b).expand(n, b)
    tree = tree_from_beams([state.tokens[:, :, d] for d in range(k)], [cols] * k,
                           [cum[:, :, d] for d in range(k)], b * k,
                           token_logprobs=[logq[:, :, d] for d in range(k)])
    batch: TreeBatch = tree.to_batch()
    width = tree.token_ids.shape[1]
    nodes = torch.arange(width)[None, :] < tree.num_nodes[:, None]
    after = p[tree.token_ids.clamp(min=0)]  # [n, width, V]
    rows = torch.cat([p[context][:, None], after], dim=1)
    row_keep = torch.cat([torch.ones(n, 1, dtype=torch.bool), nodes], dim=1)
    node_probs = rows[row_keep]
    q_tok = tree.token_logprobs.exp()[nodes]
    for rule in ("mtad", "deterministic"):
        verdict = verify_tree(
            batch, node_probs, rule=rule, is_greedy=greedy,
            uniforms=torch.rand(batch.num_nodes), exp_noise=noise,
            draft_token_probs=q_tok if rule == "mtad" else None,
            acceptance_threshold=args.tau,
        )
        results[f"all beams, tree, {rule}"] = nll(verdict.output_token_ids)

    print(f"V={v} beams={b} depth={k} tau={args.tau} rounds={n} sharpness={args.sharpness} "
          f"noise={args.noise}: tree nodes per round {float(tree.num_nodes.float().mean()):.2f}")
    print("| variant | tokens per round | perplexity of the emitted tokens | "
          "the target's own perplexity at their contexts |")
    print("| --- | --- | --- | --- |")
    for name, (eff, ppl, own) in results.items():
        print(f"| {name} | {eff:.3f} | {ppl:.3f} | {own:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--sharpness", type=float, default=3.0)
    parser.add_argument("--noise", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
